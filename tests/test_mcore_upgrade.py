"""A run whose megatron-core is upgraded mid-run: saved under 0.16.1, resumed under 0.19.2.

Users install us on Python 3.12, where pip picks megatron-core 0.19.x, and upgrade in the middle of a
run. gpt_tiny on one rank saves at iteration 4 under this Python's megatron-core 0.16.1, then copies of
that run continue to 8 under 0.16.1 and under 0.19.2 (the venv `launch/mcore-env.sh 0.19.2 DIR` builds;
CI builds it at /opt/mcore-0.19.2). The 0.19.2 resume says in one line that the version changed, its
manifest records 0.19.2 with 0.16.1 as where it came from, and its losses equal the 0.16.1
continuation's to 1e-5. Going back (that 0.19.2 checkpoint under 0.16.1, whose load crashed with an
AttributeError) is refused in the launcher, naming both versions, with nothing written.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from importlib.metadata import version

import pytest
from conftest import losses_by_iteration, run_cli

MCORE19 = os.environ.get("ORCHESTRATOR_MCORE19_PYTHON", "/opt/mcore-0.19.2/bin/python")


def _skip_reason() -> str:
    if not version("megatron-core").startswith("0.16."):
        return (
            f"saves under megatron-core 0.16.x (this Python has {version('megatron-core')}): run it with the "
            "system Python, the main CI leg"
        )
    if not os.access(MCORE19, os.X_OK):
        return f"{MCORE19} not found: bash launch/mcore-env.sh 0.19.2 /opt/mcore-0.19.2 builds it"
    return ""


pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason())]

ARGS = [
    "model=gpt_tiny",
    "parallelism=none",
    "data.stdlib_max_mb=2",
    "training.log_interval=1",
    "training.eval_iters=0",
    "training.train_iters=8",
    "checkpoint.save_interval=4",
    "run.name=r",
]


def test_a_0_16_checkpoint_resumes_under_0_19_with_the_same_losses(tmp_path, cache_dir):
    base = tmp_path / "base"
    run_cli(ARGS + [f"run.root={base}", "training.exit_after_iters=4"], cache=cache_dir, timeout=900)
    runs = {}
    for name, python in (("0.16", sys.executable), ("0.19", MCORE19)):
        root = tmp_path / name
        shutil.copytree(base, root, symlinks=True)
        proc = run_cli(ARGS + [f"run.root={root}"], cache=cache_dir, timeout=900, python=python)
        runs[name] = (root / "r", proc)
    (new_dir, new), (old_dir, old) = runs["0.19"], runs["0.16"]
    said = [line for line in new.stdout.splitlines() + new.stderr.splitlines() if "versions changed" in line]
    assert said == ["[orchestrator] warning: versions changed since iter_0000004: megatron-core 0.16.1 -> 0.19.2"], said
    assert "versions changed" not in old.stdout + old.stderr
    manifest = json.loads((new_dir / "checkpoints" / "iter_0000008" / "manifest.json").read_text())
    assert manifest["versions"]["megatron-core"] == "0.19.2"
    assert manifest["origin"]["from_versions"]["megatron-core"] == "0.16.1"
    assert manifest["origin"]["resumed_from"].endswith("iter_0000004")
    a, b = losses_by_iteration(old_dir), losses_by_iteration(new_dir)
    assert sorted(a) == sorted(b) == list(range(1, 9))
    for it in range(5, 9):
        assert abs(a[it] - b[it]) <= 1e-5 * abs(a[it]), (it, a[it], b[it])
    back = run_cli(ARGS + [f"run.root={new_dir.parent}", "training.train_iters=12"], cache=cache_dir, check=False)
    assert back.returncode == 2, back.stdout[-2000:] + back.stderr[-2000:]
    assert back.stderr.startswith(f"error: cannot resume from {new_dir}/checkpoints/iter_0000008"), back.stderr
    row = [line for line in back.stderr.splitlines() if line.startswith("versions.megatron-core")]
    assert [c.strip() for c in row[0].split("|")] == ["versions.megatron-core", "0.19.2", "0.16.1", "refused"], row
    assert sorted(p.name for p in (new_dir / "checkpoints").iterdir() if p.name.startswith("iter_")) == [
        "iter_0000004",
        "iter_0000008",
    ]
