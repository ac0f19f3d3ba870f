"""The run lock lives with the job: rank 0 holds it, every other rank follows rank 0's decision.

Real processes only: a holder process, real local submitit jobs submitted by the production
executor (orchestrator.submit.executor) and waited on with its production wait, the real CLI. The
two-detached-SLURM-jobs case is in test_slurm.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import run_cli, wait_until

from orchestrator.ckpt import history
from orchestrator.ckpt.lock import RunLock
from orchestrator.config.checks import validate
from orchestrator.config.compose import compose_config
from orchestrator.data.prepare import prepare
from orchestrator.errors import RunLockedError
from orchestrator.runtime.start.job import decision_path
from orchestrator.submit import executor, jobs

HOLD = (
    "import sys; from orchestrator.ckpt.lock import RunLock; "
    "lock = RunLock(sys.argv[1]).acquire(); print('held', flush=True); sys.stdin.read()"
)


@pytest.fixture
def holder(tmp_path):
    """A live process holding the run lock of ``tmp_path / 'run'``."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc, run_dir
    finally:
        proc.kill()
        proc.wait()


def test_job_is_refused_on_every_rank_and_trains_nothing(holder, tmp_path):
    """A job submitted past the launcher (as a second detached job would be) while another run holds
    the lock: rank 0 refuses naming the holder, rank 1 stops with the same error instead of waiting
    in a collective, nothing is trained, the holder's lock is untouched."""
    proc, run_dir = holder
    cfg = compose_config(
        ["parallelism.data_parallel_size=2", f"run.dir={run_dir}", "data=mock", f"data.cache_dir={tmp_path / 'cache'}"]
    )
    layout = validate(cfg)
    lock_before = (run_dir / RunLock.NAME).read_text()
    job = executor.submit(cfg, layout, prepare(cfg.data))
    folder = run_dir / "submitit"
    deadline = time.monotonic() + 120
    while len(jobs.result_outcomes(folder, job.job_id)) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert jobs.result_outcomes(folder, job.job_id) == {0: "error", 1: "error"}  # each rank ended on its own
    for rank in (0, 1):
        error = str(job.task(rank).exception())
        assert "RunLockedError" in error and f"pid {proc.pid} on host" in error, error
    with pytest.raises(RunLockedError, match=f"in use by another run \\(pid {proc.pid}"):
        executor.wait(job, cfg, layout.world_size)  # the production wait reports it: a user error, exit 2
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
    assert (run_dir / RunLock.NAME).read_text() == lock_before and proc.poll() is None
    decision = json.loads(decision_path(run_dir, job.job_id).read_text())
    assert decision["ok"] is False and decision["attempt"] == 0
    refused = [r for r in history.read_records(run_dir) if r["event"] == "lock_refused"]
    assert [r["job_id"] for r in refused] == [str(job.job_id)] and refused[0]["holder"]["pid"] == proc.pid


def test_a_fork_that_reads_the_refusal_late_still_ends_with_it(holder, tmp_path):
    """Rank 1 of a forked local job held (SIGSTOP) from just after the fork until well after rank 0 wrote the
    refusal: rank 0 waits for it instead of exiting at once (its exit would kill the fork, PR_SET_PDEATHSIG, before
    it wrote a result: the job then never ended in CI under load), and both ranks end with the refusal."""
    from orchestrator.runtime.start import forked

    proc, run_dir = holder
    cfg = compose_config(
        ["parallelism.data_parallel_size=2", f"run.dir={run_dir}", "data=mock", f"data.cache_dir={tmp_path / 'cache'}"]
    )
    layout = validate(cfg)
    job = executor.submit(cfg, layout, prepare(cfg.data))
    folder = run_dir / "submitit"
    pids = wait_until(lambda: forked.read_rank_pids(folder, job.job_id), 120, "the forked ranks' pids", poll_s=0.005)
    os.kill(pids[1], signal.SIGSTOP)  # before its first read of the decision (rank 0 takes the lock after this file)
    try:
        wait_until(lambda: decision_path(run_dir, job.job_id).exists(), 60, "rank 0's refusal")
        time.sleep(2.0)  # rank 0 raised; it must still be there for its fork
        assert _alive(pids[0]), "rank 0 exited with its fork stopped: the fork dies before its result"
    finally:
        os.kill(pids[1], signal.SIGCONT)
    wait_until(lambda: len(jobs.result_outcomes(folder, job.job_id)) == 2, 120, "both ranks' results")
    assert jobs.result_outcomes(folder, job.job_id) == {0: "error", 1: "error"}
    assert "RunLockedError" in str(job.task(1).exception())


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_launcher_probe_refuses_in_one_line_before_submitting(holder, tmp_path):
    proc, run_dir = holder
    out = run_cli(
        ["data=mock", f"run.dir={run_dir}", "training.train_iters=2"],
        cache=tmp_path / "cache",
        check=False,
        timeout=300,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: run.dir: ") and f"pid {proc.pid}" in lines[0], lines
    assert not (run_dir / "submitit").exists()


def _take(run_dir: Path, env: dict) -> subprocess.CompletedProcess:
    code = (
        "import sys; from orchestrator.ckpt.lock import RunLock; from orchestrator.errors import RunLockedError\n"
        "try:\n    RunLock(sys.argv[1]).acquire(); print('taken')\n"
        "except RunLockedError as e:\n    print('refused', e)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(run_dir)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_requeued_attempt_takes_over_its_own_lock(tmp_path):
    """The lock of SLURM job 987654321 whose process is gone: the next attempt of that job takes it over;
    while the holding process lives, another job is refused."""
    run_dir = tmp_path / "run"
    first = _take(run_dir, {"SLURM_JOB_ID": "987654321"})  # exits without releasing, like a requeued rank 0
    assert first.stdout.strip() == "taken"
    held = json.loads((run_dir / RunLock.NAME).read_text())
    assert held["job_id"] == "987654321"
    assert RunLock(run_dir).stale_reason(held) is not None  # its pid is dead
    again = _take(run_dir, {"SLURM_JOB_ID": "987654321"})
    assert again.stdout.strip() == "taken", again.stdout + again.stderr
    assert json.loads((run_dir / RunLock.NAME).read_text())["token"] != held["token"]


def test_probe_takes_nothing(tmp_path):
    lock = RunLock(tmp_path)
    lock.probe()  # unlocked: nothing to say
    assert not (tmp_path / RunLock.NAME).exists()
    with RunLock(tmp_path):
        with pytest.raises(RunLockedError, match=r"^run.dir: .* is in use by another run \(pid \d+"):
            RunLock(tmp_path).probe()
    lock.probe()


def _gated_python(path: Path, gate: Path) -> str:
    """A ``cluster.python`` that waits for ``gate`` to exist before running the job's interpreter: the job is
    submitted (its submitit controller lives) but its rank 0 has not taken the run lock, as in SLURM's queue."""
    path.write_text(f'#!/bin/sh\nwhile [ ! -e "{gate}" ]; do sleep 0.05; done\nexec "{sys.executable}" "$@"\n')
    path.chmod(0o755)
    return str(path)


def _listing(run_dir: Path) -> list:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))


def test_second_launch_is_refused_before_the_first_job_takes_the_lock(tmp_path):
    """The same command launched twice, the second while the first's job is submitted but its rank 0 has not
    started (gated, like a job pending in SLURM's queue): the second launcher refuses in one line naming the
    first job, exit 2, and writes nothing. Then a job that slipped past the launcher (a genuine race) is refused
    the lock by the job, and neither the run's status nor its history counts it; the first run completes."""
    from orchestrator.ckpt.attempts import attempts, format_attempts
    from orchestrator.ckpt.history import read_records
    from orchestrator.submit.status import run_status

    run_dir, gate_a, gate_b = tmp_path / "run", tmp_path / "gate_a", tmp_path / "gate_b"
    args = ["data=mock", f"run.dir={run_dir}", "training.train_iters=3", "training.log_interval=1"]
    args_a = [*args, f"cluster.python={_gated_python(tmp_path / 'py_a', gate_a)}"]
    env = dict(os.environ, ORCHESTRATOR_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
    with open(tmp_path / "first.out", "w") as out:
        first = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", *args_a], cwd=Path(__file__).resolve().parents[1], env=env,
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        jobs_file = run_dir / "jobs.jsonl"
        submitted = wait_until(
            lambda: [r for r in history.read_records(run_dir) if r["event"] == "submitted"], 300, "the first submission"
        )
        job_a = submitted[0]["job_id"]
        logs = [run_dir / "submitit" / f"{job_a}_0_log.{ext}" for ext in ("out", "err")]
        wait_until(lambda: all(p.exists() for p in logs), 300, "job A's task (gated)")  # its controller writes no more
        before = (jobs_file.read_bytes(), _listing(run_dir))
        assert not (run_dir / RunLock.NAME).exists()  # the gap: submitted, the lock not taken yet
        second = run_cli(args_a, cache=tmp_path / "cache", check=False, timeout=240)
        assert second.returncode == 2, second.stdout + second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: run.dir: {run_dir} is in use by another run"), lines
        assert f"job {job_a}, pid {job_a} on host" in lines[0] and "fix: " in lines[0], lines
        assert "submitted job" not in second.stdout, second.stdout
        assert (jobs_file.read_bytes(), _listing(run_dir)) == before  # nothing created, nothing recorded

        cfg = compose_config(
            [
                *args,
                f"cluster.python={_gated_python(tmp_path / 'py_b', gate_b)}",
                f"data.cache_dir={tmp_path / 'cache'}",
            ]
        )
        job_b = executor.submit(cfg, validate(cfg), prepare(cfg.data))  # slipped past the launcher's check
        gate_a.touch()
        holder = wait_until(lambda: RunLock(run_dir).holder() or first.poll() is not None, 300, "job A's lock")
        assert isinstance(holder, dict), (tmp_path / "first.out").read_text()[-2000:]
        assert json.loads(decision_path(run_dir, job_a).read_text())["ok"] is True
        # job A's rank held (SIGSTOP) while B starts: under load, A's 3 iterations had ended and freed the lock
        # before B's rank had imported torch, and B trained (2 of 5 runs beside a loaded CI run)
        os.kill(holder["pid"], signal.SIGSTOP)
        try:
            gate_b.touch()
            wait_until(lambda: jobs.result_outcomes(run_dir / "submitit", job_b.job_id), 300, "job B's refusal")
        finally:
            os.kill(holder["pid"], signal.SIGCONT)
        assert jobs.result_outcomes(run_dir / "submitit", job_b.job_id) == {0: "error"}
        assert first.wait(timeout=300) == 0, (tmp_path / "first.out").read_text()
    finally:
        gate_a.touch(), gate_b.touch()
        if first.poll() is None:
            first.kill()
            first.wait()
    status = run_status(run_dir)
    assert (status.state, status.job.job_id, status.iteration) == ("completed", job_a, 3), status
    items = attempts(read_records(run_dir))
    assert [(a.job_id, a.cause, a.iteration) for a in items] == [(job_a, "completed", 3)], format_attempts(items)
    shown = run_cli(["status", str(run_dir.parent), "--history"], cache=tmp_path / "cache")
    assert "running" not in shown.stdout and f"job {job_b.job_id}" not in shown.stdout, shown.stdout
