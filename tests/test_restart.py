"""In-place restarts (``cluster.max_restarts``, runtime/start/inplace.py): bad input, and a SLURM job whose killed
rank restarts all ranks inside the same allocation. (The local restart, and restarts used up: test_train.py.)

Time (2 cores, load ~8 from the other helpers): the SLURM test ~90 s, its local reference running alongside.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import agent_worker, losses_by_iteration, read_metrics, run_cli
from test_slurm_train import (ACROSS_NODES, SMALL, Cli, assert_losses_match, iterations_done, needs_two_nodes,
                              submitted_job, wait_until)
from orchestrator.ckpt import history
from orchestrator.submit import jobs


@pytest.mark.parametrize("override, key", [
    (["cluster.spare_nodes=1", "cluster.max_restarts=1"], "cluster.spare_nodes=1"),
    (["cluster=slurm_dev", "cluster.max_restarts=-1"], "cluster.max_restarts=-1"),
    (["cluster=slurm_dev", "cluster.spare_nodes=1"], "cluster.spare_nodes=1"),
])
def test_bad_restart_settings_are_one_line_before_anything_is_queued(tmp_path, cache_dir, override, key):
    """Spares on a local job, a negative count, spares without restarts: one `error:` line naming the key and
    the fix, exit 2, no run directory."""
    proc = run_cli(SMALL + [f"run.root={tmp_path}", "run.name=bad", *override], cache=cache_dir, check=False)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {key}:"), proc.stderr
    assert "fix: " in lines[0] and not (tmp_path / "bad").exists()


RESTART_ITERS = 14
RESTART_SAVE = 4


@needs_two_nodes
def test_in_place_restart_of_a_killed_rank_keeps_the_slurm_job_and_its_losses(tmp_path, cache_dir):
    """Acceptance of issue 28: kill -9 one rank of a 2-node PP2 x DP2 job after iteration 10 with
    cluster.max_restarts=1. The same SLURM job (never requeued) restarts all ranks in its allocation from the
    checkpoint at 8 and completes; every loss, the retrained ones too, equals an uninterrupted local run's
    (1e-5 rel.); the history shows the restart (failed rank, recovery time) apart from requeues. Prints the
    time from the kill to the first new iteration, next to the job's own start-up and checkpoint load."""
    n = RESTART_ITERS
    common = SMALL + [f"run.root={tmp_path}", f"training.train_iters={n}", f"checkpoint.save_interval={RESTART_SAVE}"]
    run_dir = tmp_path / "slurm"
    ref = Cli(common + ["cluster=local", "run.name=local"], cache_dir, tmp_path / "logs_local")
    cli = Cli(common + ["cluster=slurm_dev", *ACROSS_NODES, "run.name=slurm", "cluster.max_restarts=1"],
              cache_dir, tmp_path / "logs")
    try:
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        wait_until(lambda: iterations_done(run_dir) >= 10, 400, "iteration 10 on SLURM", cli, poll_s=0.1)
        before = len(read_metrics(run_dir))
        victim = wait_until(lambda: agent_worker(run_dir, 2), 30, "rank 2's process")
        node = victim.environ()["SLURMD_NODENAME"]
        victim.kill()
        killed_at = time.time()
        wait_until(lambda: len(read_metrics(run_dir)) > before, 300, "an iteration after the restart", cli, poll_s=0.1)
        first_new = time.time()
        assert ref.wait(400) == 0, ref.describe()
        assert cli.wait(400) == 0, cli.describe()
    finally:
        ref.kill()
        cli.kill()
    out = cli.stdout
    assert f"completed: iteration {n} |" in out and out.rstrip().endswith(f"| job {job_id}"), out[-3000:]
    assert "restarting all ranks in place: restart 1 of cluster.max_restarts=1" in out, out[-3000:]
    st = wait_until(lambda: (s := jobs.slurm_job_status(job_id)) and s.ended and s, 60, "SLURM to end the job")
    assert st.state == "completed" and st.restarts == 0, st  # one job, never requeued

    starts = [a for a in history.attempts(history.read_records(run_dir)) if a.job_id == job_id]
    assert [(a.attempt, a.restart, a.cause, a.restarted) for a in starts] == \
        [(0, 0, "crashed", True), (0, 1, "completed", False)], starts
    assert 2 in (starts[0].failed or []) and starts[1].start_iteration == 8, starts
    records = read_metrics(run_dir)
    assert [r["iteration"] for r in records][before:] == list(range(9, n + 1)), records
    local = losses_by_iteration(tmp_path / "local")
    for rec in records:
        assert_losses_match({rec["iteration"]: rec["lm_loss"]}, local, [rec["iteration"]])
    listing = run_cli(["status", str(tmp_path), "--history"], cache=cache_dir).stdout
    assert f"job {job_id} attempt 0 restart 1 " in listing and "crashed (restarted in place; rank(s) " in listing, listing

    start_up = records[0]["time"] - next(r["time"] for r in history.read_records(run_dir) if r["event"] == "submitted")
    log = (run_dir / "submitit" / f"{job_id}_0_log.out").read_text()
    print(f"kill -9 of rank 2 on {node}: the first new iteration {first_new - killed_at:.1f} s after the kill "
          f"(recorded: {starts[1].recovery_s:.1f} s from the failure); the job's own start-up to its first "
          f"iteration {start_up:.1f} s; {[ln for ln in log.splitlines() if 'loaded in' in ln][-1:]}")
