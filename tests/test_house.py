"""The house rules of orchestrator/: module and function sizes, and the import contracts of pyproject
(`lint-imports`, also run by .ci/run) holding on the real tree and failing on a tree with a cycle."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 80


def function_lines(src: str) -> dict:
    """Each function of ``src`` -> its lines, ``def`` line to last line, both included."""
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(src))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _offenders() -> list:
    found = []
    for path in sorted((REPO / "orchestrator").rglob("*.py")):
        src = path.read_text()
        rel = path.relative_to(REPO)
        if src.count("\n") > MAX_MODULE_LINES:
            found.append(f"{rel}: {src.count(chr(10))} lines")
        found += [f"{rel}: {name}() is {n} lines" for name, n in function_lines(src).items() if n > MAX_FUNCTION_LINES]
    return found


def test_function_lines_count_the_def_and_the_last_line():
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    src = f"def eighty():\n{body}\n\ndef eighty_one():\n{body}    return 1\n"
    assert function_lines(src) == {"eighty": 80, "eighty_one": 81}


def test_no_module_over_350_lines_and_no_function_over_80():
    assert _offenders() == []


def private_imports(root: Path) -> list:
    """``from orchestrator.x import _name`` anywhere under ``root/orchestrator`` (lazy imports too): a module that
    needs another's helper gets it public, or the helper moves."""
    found = []
    for path in sorted((root / "orchestrator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("orchestrator"):
                found += [
                    f"{path.relative_to(root)}: from {node.module} import {a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    return found


def test_no_module_imports_another_modules_private_names(tmp_path):
    assert private_imports(REPO) == []
    bad = tmp_path / "orchestrator" / "a.py"
    bad.parent.mkdir()
    bad.write_text("def f():\n    from orchestrator.b import _helper\n")
    assert private_imports(tmp_path) == ["orchestrator/a.py: from orchestrator.b import _helper"]


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    return subprocess.run(
        [lint, "--config", str(root / "pyproject.toml")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)},
    )


def test_import_contracts_hold_and_fail_on_an_added_cycle(tmp_path):
    if not (shutil.which("lint-imports") or Path(sys.executable).with_name("lint-imports").exists()):
        pytest.fail("lint-imports not installed: pip install -e '.[test]'")
    ok = _lint_imports(REPO)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-2000:]
    assert "0 broken" in ok.stdout and "4 kept" in ok.stdout

    copy = tmp_path / "tree"
    shutil.copytree(
        REPO / "orchestrator",
        copy / "orchestrator",
        symlinks=True,
        ignore=shutil.ignore_patterns("__pycache__", "conf"),
    )
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")
    rundir = copy / "orchestrator" / "ckpt" / "rundir.py"  # manifest imports rundir: rundir -> manifest closes a cycle
    rundir.write_text(rundir.read_text() + "\nimport orchestrator.ckpt.manifest  # noqa: E402,F401\n")
    torch_in_plan = copy / "orchestrator" / "plan" / "report.py"
    torch_in_plan.write_text(torch_in_plan.read_text() + "\nimport torch  # noqa: E402,F401\n")
    broken = _lint_imports(copy)
    assert broken.returncode != 0
    assert "no import cycles" in broken.stdout and "BROKEN" in broken.stdout
    assert "orchestrator.plan.report -> torch" in broken.stdout
