"""What a fresh pair of eyes found at the command line: a dry run that says more than the run does, ``--json``
ignored, miscounted refusals, a missing path called a torn checkpoint, an output directory created at the root,
planning-only keys in the resume diff, negative zeros, RST markup in ``--help``, usage lines naming another
command, and a bare ``tune`` that starts tuning. Hand-built run directories and checkpoints; nothing trains."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from test_manifest import BYTE_ID, pp2_dp2, save_checkpoint

from orchestrator.ckpt.compare import compare
from orchestrator.ckpt.manifest import read_manifest
from orchestrator.config.compose import compose_config
from orchestrator.config.layout import layout_from_config
from orchestrator.errors import ConfigError


def _one_error_line(err: str, *expected: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "; fix: " in lines[0], err
    for text in expected:
        assert text in lines[0], (text, lines[0])
    return lines[0]


# ---------------------------------------------------------------- 1. a dry run ends where the run ends
def test_a_dry_run_of_a_finished_run_stops_at_nothing_to_train(tmp_path, capsys):
    from orchestrator.data.prepare import data_fingerprint
    from orchestrator.data.tokenizer import tokenizer_identity
    from orchestrator.pipeline import run

    base = ["+experiment=gpt_pp2_dp2", f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    cfg = compose_config(base + ["training.train_iters=50"])
    save_checkpoint(cfg, 50, fingerprint=data_fingerprint(cfg.data), tokenizer=tokenizer_identity(cfg.data))
    capsys.readouterr()
    for flag in ("dry_run=true", "plan=true"):
        assert run(compose_config(base + ["training.train_iters=50", flag])) is None
        out = capsys.readouterr().out
        assert "nothing to train (raise training.train_iters to continue)" in out, out
        assert "would start" not in out and "would resume" not in out, out
    assert run(compose_config(base + ["training.train_iters=50"]))["status"] == "already_done"  # the real run
    assert "would start" not in capsys.readouterr().out


# ---------------------------------------------------------------- 2. status --goodput --json
def test_status_goodput_json_is_the_account_as_json(tmp_path, capsys):
    from orchestrator.submit.status import main as status

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    jobs = [
        {"event": "submitted", "job_id": "7", "cluster": "local", "time": 0.0},
        {"event": "attempt_started", "job_id": "7", "attempt": 0, "iteration": 0, "time": 2.0},
        {"event": "attempt_ended", "job_id": "7", "attempt": 0, "cause": "completed", "iteration": 4, "time": 8.0},
    ]
    metrics = [{"event": "start", "iteration": 0, "load_s": None, "time": 4.0}]
    metrics += [{"iteration": i, "step_time_s": 1.0, "time": 4.0 + i} for i in range(1, 5)]
    (run_dir / "jobs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in jobs))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    assert status([str(run_dir), "--goodput", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["run_dir"] == str(run_dir) and got["wall_s"] == 8.0 and got["ettr"] == 0.5
    assert got["seconds"]["productive"] == 4.0 and got["attempts"] == 1 and got["kept_iterations"] == 4
    assert status([str(run_dir), "--goodput"]) == 0 and "ETTR 50.0%" in capsys.readouterr().out  # the table stays


# ---------------------------------------------------------------- 3, 4, 6: manifest check / list
def _manifest(argv, capsys):
    from orchestrator.ckpt.cli import main

    code = main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_manifest_check_counts_refused_and_reshard_rows_apart(tmp_path, capsys):
    base = ["+experiment=gpt_pp2_dp2", f"run.dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    ckpt = save_checkpoint(compose_config(base), 100)
    code, out, _ = _manifest(["check", str(ckpt), "--", *base, "parallelism=tp2_pp2"], capsys)
    rows = [line.rsplit("|", 1)[-1].strip() for line in out.splitlines() if line.count(" | ") == 3][1:]
    assert code == 1 and sorted(rows) == ["refused", "reshard opt-in", "reshard opt-in"], out
    assert (
        "resume refused: 1 difference the checkpoint cannot carry, and 2 more that need "
        "checkpoint.allow_reshard=true" in out
    ), out
    code, out, _ = _manifest(
        ["check", str(ckpt), "--", *base, "parallelism=tp2_pp2", "checkpoint.allow_reshard=true"], capsys
    )
    assert code == 1 and out.splitlines()[-1] == "resume refused: 1 difference the checkpoint cannot carry", out


def test_manifest_of_a_path_that_does_not_exist_says_so(tmp_path, capsys):
    missing = tmp_path / "x" / "nonexist"
    for argv in (["check", str(missing)], ["show", str(missing)], ["list", str(missing)]):
        code, out, err = _manifest(argv, capsys)
        assert code == 2 and out == "", (argv, out)
        line = _one_error_line(err, str(missing), "does not exist")
        assert "torn" not in line and "no checkpoints" not in line, line
    assert not (tmp_path / "x").exists()
    (tmp_path / "empty").mkdir()  # a run directory without checkpoints yet is no error
    code, out, _ = _manifest(["list", str(tmp_path / "empty")], capsys)
    assert code == 0 and "no checkpoints" in out


# ---------------------------------------------------------------- 5. plan_picture, and the resume diff
def test_a_plan_picture_in_a_missing_directory_is_refused_and_nothing_is_created(tmp_path):
    from orchestrator.config.checks import validate

    where = tmp_path / "nonexistent"
    cfg = compose_config([f"run.root={tmp_path / 'runs'}", "plan=true", f"plan_picture={where / 'x.png'}"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value).startswith(f"plan_picture='{where / 'x.png'}': the directory {where} does not exist")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            f"run.root={tmp_path / 'runs'}",
            "plan=true",
            f"plan_picture={where}/x.png",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 2 and proc.stdout.startswith("[orchestrator] composing "), proc.stdout
    assert len(proc.stdout.splitlines()) == 1, proc.stdout  # no plan, nothing drawn
    _one_error_line(proc.stderr, "plan_picture=", "does not exist")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_resume_diff_leaves_out_planning_keys_and_an_empty_mapping_is_no_change(tmp_path):
    cfg = pp2_dp2(tmp_path / "run")
    manifest = read_manifest(save_checkpoint(cfg, 50))
    sweep = dataclasses.replace(cfg.sweep, warm_pool=not cfg.sweep.warm_pool)
    planned = dataclasses.replace(cfg, plan=True, dry_run=True, plan_picture="ok.png", plan_headroom=0.5, sweep=sweep)
    layout = layout_from_config(planned)
    assert compare(manifest, planned, layout, data_fingerprint="fp-1", tokenizer=BYTE_ID) == []
    for empty in (None, "missing"):  # a manifest that recorded model.megatron as null, or not at all
        if empty is None:
            manifest["config"]["model"]["megatron"] = None
        else:
            del manifest["config"]["model"]["megatron"]
        assert compare(manifest, cfg, layout_from_config(cfg), data_fingerprint="fp-1", tokenizer=BYTE_ID) == []


# ---------------------------------------------------------------- 6. cosmetics
def test_no_negative_zero_in_the_step_breakdown():
    from orchestrator.plan.step_breakdown import CATEGORIES, describe
    from orchestrator.submit.status import format_breakdown

    stage = {c: 0.0 for c in CATEGORIES}
    stage.update(stage=0, step_s=0.01, compute=0.9, bubble=0.1001, sync=-0.0001, other=-0.0001, mfu=None)
    line = describe({"stages": [stage]}, "over 3 timed iterations")
    assert "-0" not in line and "loop sync 0%" in line and "other 0%" in line, line
    table = "\n".join(format_breakdown("run", {"stages": [stage], "what": "x"}))
    assert "-0.0%" not in table and "0.0%" in table, table


def _tool(*argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )


def test_help_and_usage_are_plain_and_name_the_command_the_readme_uses():
    for argv in (["megatron-config", "--help"], ["manifest", "--help"], ["manifest", "check", "--help"]):
        proc = _tool(*argv)
        assert proc.returncode == 0 and "``" not in proc.stdout and ":mod:" not in proc.stdout, proc.stdout
    readme = (REPO / "README.md").read_text()
    for name in ("convert", "sweep"):
        assert f"python -m orchestrator {name} " in readme
        proc = _tool(name)
        assert proc.returncode == 2, proc.stderr
        _one_error_line(proc.stderr, f"python -m orchestrator {name}:")


def test_bare_tune_prints_its_usage_and_starts_nothing(tmp_path):
    proc = _tool("tune", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout.startswith("usage: python -m orchestrator tune"), proc.stdout
    _one_error_line(proc.stderr, "tune:")
    assert list(tmp_path.iterdir()) == []
