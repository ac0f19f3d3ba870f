"""Real multi-process Megatron-core training through the CLI (gloo on CPU).

These are the acceptance checks of issue 2 (and the resume ones of issue 3):
layout equivalence, every shipped parallelism trains, resume continues, bad
layouts fail before any process starts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import losses_by_iteration, read_metrics, run_cli

pytestmark = pytest.mark.slow

SMALL = ["data.stdlib_max_mb=2", "training.log_interval=1"]


def test_invalid_pipeline_split_fails_before_any_process(tmp_path, cache_dir):
    proc = run_cli(["+experiment=gpt_pp2_dp2", "parallelism.pipeline_model_parallel_size=3",
                    f"run.root={tmp_path}"], cache=cache_dir, check=False, timeout=120)
    assert proc.returncode == 2
    assert "model.num_layers=4" in proc.stderr and "pipeline_model_parallel_size=3" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "gpt_pp2_dp2" / "submitit").exists()  # nothing was started


def test_layouts_agree_from_the_same_initial_weights(tmp_path, cache_dir):
    """parallelism=none and pp2_dp2, same iteration-0 weights and data order: same losses (1e-3 rel)."""
    common = SMALL + [f"run.root={tmp_path}", "training.train_iters=20", "optimizer.lr_warmup_iters=2"]
    run_cli(common + ["parallelism=none", "run.name=init", "training.train_iters=0"], cache=cache_dir)
    init = tmp_path / "init" / "checkpoints" / "iter_0000000"
    assert (init / "manifest.json").exists()
    run_cli(common + ["parallelism=none", "run.name=single", f"checkpoint.init_from={init}"], cache=cache_dir)
    run_cli(common + ["parallelism=pp2_dp2", "run.name=pp2dp2", f"checkpoint.init_from={init}"], cache=cache_dir)
    a, b = losses_by_iteration(tmp_path / "single"), losses_by_iteration(tmp_path / "pp2dp2")
    assert sorted(a) == sorted(b) == list(range(1, 21))
    for it in range(1, 21):
        assert abs(a[it] - b[it]) <= 1e-3 * abs(a[it]), (it, a[it], b[it])
    assert a[20] < a[1] - 0.5  # and it learns


@pytest.mark.parametrize("parallelism", ["pp2_vpp2_dp2", "tp2_pp2", "pp4"])
def test_other_layouts_train(tmp_path, cache_dir, parallelism):
    run_cli(SMALL + [f"parallelism={parallelism}", f"run.root={tmp_path}", "run.name=x",
                     "training.train_iters=8", "checkpoint.save_at_end=false"], cache=cache_dir)
    losses = losses_by_iteration(tmp_path / "x")
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses.values())
    assert losses[8] < losses[1] - 0.3


def test_interrupted_run_resumes_and_matches_uninterrupted(tmp_path, cache_dir):
    """Stop after 4 of 10 iterations (checkpoint), rerun the same command: iterations 5..10 match (1e-5 rel)."""
    common = SMALL + ["+experiment=gpt_pp2_dp2", f"run.root={tmp_path}", "training.train_iters=10",
                      "checkpoint.save_interval=null"]
    run_cli(common + ["run.name=full"], cache=cache_dir)
    first = run_cli(common + ["run.name=cut", "training.exit_after_iters=4"], cache=cache_dir)
    assert "exited: iteration 4" in first.stdout
    assert (tmp_path / "cut" / "checkpoints" / "iter_0000004" / "manifest.json").exists()
    second = run_cli(common + ["run.name=cut"], cache=cache_dir)
    assert "will resume from" in second.stdout and "iter_0000004" in second.stdout
    records = read_metrics(tmp_path / "cut")
    assert [r["iteration"] for r in records] == list(range(1, 11))  # no iteration retrained
    full, cut = losses_by_iteration(tmp_path / "full"), losses_by_iteration(tmp_path / "cut")
    for it in range(5, 11):
        assert abs(full[it] - cut[it]) <= 1e-5 * abs(full[it]), (it, full[it], cut[it])
    manifest = json.loads((tmp_path / "cut" / "checkpoints" / "iter_0000010" / "manifest.json").read_text())
    assert manifest["iteration"] == 10 and manifest["consumed_samples"] == 160


def test_changed_layout_is_refused_before_submission(tmp_path, cache_dir):
    common = SMALL + ["+experiment=gpt_pp2_dp2", f"run.root={tmp_path}", "training.train_iters=2"]
    run_cli(common, cache=cache_dir)
    jobs_before = sorted((tmp_path / "gpt_pp2_dp2" / "submitit").glob("*_submitted.pkl"))
    proc = run_cli(common + ["parallelism.pipeline_model_parallel_size=1"], cache=cache_dir, check=False)
    assert proc.returncode == 2
    assert "parallelism.pipeline_model_parallel_size" in proc.stderr and "| 2" in proc.stderr
    assert "parallelism.pipeline_model_parallel_size=2" in proc.stderr  # the override that matches
    assert sorted((tmp_path / "gpt_pp2_dp2" / "submitit").glob("*_submitted.pkl")) == jobs_before


def _rank_processes(run_dir: Path):
    import psutil

    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "submitit.core._submit" in cmd and str(run_dir) in cmd:
            out.append(p)
    return out


def test_sigkill_of_one_rank_fails_fast_and_resume_matches(tmp_path, cache_dir):
    """kill -9 one rank mid-run: the launcher reports it (exit 1) instead of hanging; the rerun resumes
    from the last complete checkpoint and its losses match an uninterrupted run (1e-5 rel)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    common = SMALL + ["+experiment=gpt_pp2_dp2", f"run.root={tmp_path}", "training.train_iters=14",
                      "checkpoint.save_interval=4"]
    run_cli(common + ["run.name=full"], cache=cache_dir)
    run_dir = tmp_path / "killed"
    env = dict(os.environ, ORCHESTRATOR_CACHE=str(cache_dir))
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *common, "run.name=killed"], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists() and any(r["iteration"] >= 5 for r in read_metrics(run_dir)):
            break
        time.sleep(0.2)
    ranks = _rank_processes(run_dir)
    assert len(ranks) >= 4, ranks
    os.kill(ranks[0].pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 1, (out[-2000:], err[-2000:])
    assert "died without a result" in err
    assert not _rank_processes(run_dir)  # the survivors were stopped, not left blocked in a collective

    second = run_cli(common + ["run.name=killed"], cache=cache_dir)
    assert "will resume from" in second.stdout
    resumed_at = int(second.stdout.split("(iteration ")[1].split(")")[0])
    assert resumed_at in (4, 8)
    full, killed = losses_by_iteration(tmp_path / "full"), losses_by_iteration(run_dir)
    assert max(killed) == 14
    for it in range(resumed_at + 1, 15):
        assert abs(full[it] - killed[it]) <= 1e-5 * abs(full[it]), (it, full[it], killed[it])


def test_reshard_opt_in_continues_with_the_same_losses(tmp_path, cache_dir):
    """PP=2 checkpoint resumed with PP=1 and checkpoint.allow_reshard=true: torch_dist reshards model
    and optimizer state; losses after the resume match the uninterrupted PP=2 run (1e-3 rel)."""
    common = SMALL + ["+experiment=gpt_pp2_dp2", f"run.root={tmp_path}", "training.train_iters=7",
                      "checkpoint.save_interval=null"]
    run_cli(common + ["run.name=full"], cache=cache_dir)
    run_cli(common + ["run.name=cut", "training.exit_after_iters=4"], cache=cache_dir)
    refused = run_cli(common + ["run.name=cut", "parallelism.pipeline_model_parallel_size=1"], cache=cache_dir,
                      check=False)
    assert refused.returncode == 2 and "checkpoint.allow_reshard=true" in refused.stderr
    run_cli(common + ["run.name=cut", "parallelism.pipeline_model_parallel_size=1", "checkpoint.allow_reshard=true"],
            cache=cache_dir)
    full, cut = losses_by_iteration(tmp_path / "full"), losses_by_iteration(tmp_path / "cut")
    for it in range(5, 8):
        assert abs(full[it] - cut[it]) <= 1e-3 * abs(full[it]), (it, full[it], cut[it])
    manifest = json.loads((tmp_path / "cut" / "checkpoints" / "iter_0000007" / "manifest.json").read_text())
    assert manifest["layout"]["pipeline_model_parallel_size"] == 1
    assert "parallelism.pipeline_model_parallel_size" in manifest["origin"]["resharded"]
