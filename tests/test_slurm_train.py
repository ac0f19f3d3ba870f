"""Real training on the real SLURM dev cluster through the real CLI (issue 4's acceptance).

`python -m orchestrator +experiment=gpt_pp2_dp2 cluster=slurm_dev ...` submits through submitit's
sbatch to the single-node cluster of launch/ (`launch/slurm-dev-up.sh`, as root) and waits; no
mocks. Skipped, with the reason, when `sinfo` does not answer. Every wait is bounded.

* 4 tasks through sbatch/srun train, checkpoint, report success with the job id; losses equal the
  local run of the same config (1e-5 relative).
* A time limit shorter than the training (`--time=2 --signal=USR2@30`): USR2 -> save -> `scontrol
  requeue` -> SLURM restarts the job -> it resumes through the manifest check -> finishes; the
  launcher waits through the requeue and reports success; losses, including those after each
  resume point, equal an uninterrupted local run (1e-5 relative).
* scancel while the launcher waits: reported as cancelled (non-zero exit) within 60 s.
* A rank killed with SIGKILL: the launcher reports it and the job ends instead of hanging.
* `python -m orchestrator status` lists each run with its state, requeues, last iteration and loss.

Time (2 cores): SLURM sends `--signal=USR2@30` of a 2-minute job 60-90 s after it starts
(slurmctld checks time limits every 30 s and warns up to 30 s early); a requeued job restarts
~15 s after the requeue here (`KillWait=10`, `cred_expire=10`). The uninterrupted reference run
therefore runs *while* the SLURM job starts up instead of after it: its busy ranks stretch the
SLURM job's start-up (~25 s alone, ~60 s next to them), so the first allocation trains for at
most ~30 s before its signal (measured: stopped after 31-139 of 200 iterations) and 200
iterations outlast it; the rest (20-45 s) fits into the second allocation before its signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from conftest import REPO, losses_by_iteration, read_metrics, slurm_unavailable_reason
from orchestrator.ckpt import history
from orchestrator.submit import jobs, sbatch, status




_REASON = slurm_unavailable_reason()


def needs_slurm(test):
    """Marks ``slurm`` and ``slow``; skipped, with the reason, without the dev cluster."""
    test = pytest.mark.skipif(bool(_REASON), reason=f"SLURM dev cluster not reachable: {_REASON}")(test)
    return pytest.mark.slurm(pytest.mark.slow(test))


SMALL = ["+experiment=gpt_pp2_dp2", "data.stdlib_max_mb=2", "training.log_interval=1"]
REL = 1e-5


# ---- helpers -----------------------------------------------------------------------------------

class Cli:
    """`python -m orchestrator ARGS` in the background, output to files (no pipe to fill up)."""

    def __init__(self, args: List[str], cache: Path, logs: Path):
        logs.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = logs / "stdout.txt", logs / "stderr.txt"
        env = dict(os.environ, ORCHESTRATOR_CACHE=str(cache), PYTHONUNBUFFERED="1")
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env,
                                         stdout=out, stderr=err, text=True)

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def describe(self) -> str:
        return f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the launcher did not end within {timeout:.0f} s\n{self.describe()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # the launcher cancels its job on Ctrl-C
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_until(predicate, timeout_s: float, what: str, cli: Optional[Cli] = None, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if cli is not None and cli.proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({cli.proc.returncode}) before {what}\n{cli.describe()}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}" + (f"\n{cli.describe()}" if cli else ""))


def submitted_job(run_dir: Path) -> Optional[str]:
    """The job id of the run's (latest) submission record, once the launcher has submitted."""
    jobs = [r for r in history.read_records(run_dir) if r.get("event") == "submitted"]
    return str(jobs[-1]["job_id"]) if jobs else None


def iterations_done(run_dir: Path) -> int:
    if not (run_dir / "metrics.jsonl").exists():
        return 0
    try:
        return max((r["iteration"] for r in read_metrics(run_dir)), default=0)
    except json.JSONDecodeError:  # a line being written
        return 0


def events(run_dir: Path, name: str) -> List[dict]:
    path = run_dir / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == name]


def assert_losses_match(slurm: Dict[int, float], local: Dict[int, float], iterations) -> None:
    for it in iterations:
        assert it in slurm and it in local, (it, sorted(slurm)[-3:], sorted(local)[-3:])
        assert abs(slurm[it] - local[it]) <= REL * abs(local[it]), (it, slurm[it], local[it])


def status_rows(root: Path) -> Dict[str, dict]:
    """`python -m orchestrator status ROOT --json`, keyed by run directory name; the table too."""
    cmd = [sys.executable, "-m", "orchestrator", "status", str(root)]
    table = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    out = subprocess.run(cmd + ["--json"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {Path(d["run_dir"]).name: d for d in map(json.loads, out.stdout.splitlines())}
    for name in rows:
        assert any(line.split()[:1] == [name] for line in table.stdout.splitlines()), table.stdout
    rows["_table"] = {"text": table.stdout}
    return rows


def table_line(rows: Dict[str, dict], name: str) -> str:
    return next(line for line in rows["_table"]["text"].splitlines() if line.split()[:1] == [name])


def rank_process(run_dir: Path, rank: int):
    """The python process of SLURM task ``rank`` of this run (srun's children on this node)."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if "submitit.core._submit" in cmd and str(run_dir) in cmd and not cmd.startswith("srun") \
                    and p.environ().get("SLURM_PROCID") == str(rank):
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


# ---- the srun line (no cluster needed) ---------------------------------------------------------

def test_srun_line_kills_the_step_when_a_rank_dies(tmp_path):
    """`--kill-on-bad-exit=1` on every srun line unless cluster.srun_args says otherwise."""
    from hydra import compose, initialize_config_dir

    from orchestrator.spec.schema import register_configs, to_job_config

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = to_job_config(compose("config", overrides=["+experiment=gpt_pp2_dp2", "cluster=slurm_dev",
                                                         f"run.dir={tmp_path}"]))
    line = sbatch.srun_line(sbatch.render_sbatch(cfg, 4, tmp_path))
    assert " --kill-on-bad-exit=1 " in line
    cfg.cluster.srun_args = ["--cpu-bind=none", "--kill-on-bad-exit=0"]
    line = sbatch.srun_line(sbatch.render_sbatch(cfg, 4, tmp_path))
    assert "--kill-on-bad-exit=1" not in line and " --cpu-bind=none --kill-on-bad-exit=0 " in line


# ---- end to end on SLURM -----------------------------------------------------------------------

# Iterations of the time-limit run: more than the first allocation trains before its signal (see the
# module docstring), few enough that the second allocation usually finishes before its own signal
# (a second requeue is allowed: cluster.max_num_timeout=3).
TIME_LIMIT_ITERS = 200


@needs_slurm
def test_slurm_run_with_time_limit_requeues_resumes_and_matches_local(tmp_path, cache_dir):
    """The acceptance run on the dev cluster: 4 tasks through sbatch/srun, checkpoints, success with
    the job id, and, with --time=2 --signal=USR2@30: signal -> save -> requeue -> resume (manifest
    check in the job) -> finish; the launcher waits through the requeue and reports success; every
    loss, before and after each resume point, equals an uninterrupted local run of the same config.
    (One run covers both acceptance checks of issue 4: the suite must stay under 15 minutes.)"""
    n = TIME_LIMIT_ITERS
    common = SMALL + [f"run.root={tmp_path}", f"training.train_iters={n}", "checkpoint.save_interval=null"]
    run_dir = tmp_path / "slurm"
    # The uninterrupted reference first; once it trains, the SLURM job: the two share the CPUs
    # while the SLURM job runs towards its first time limit.
    ref = Cli(common + ["cluster=local", "run.name=local"], cache_dir, tmp_path / "logs_local")
    cli = None
    try:
        wait_until(lambda: iterations_done(tmp_path / "local") >= 1, 240, "the reference run to train", ref)
        cli = Cli(common + ["cluster=slurm_dev", "run.name=slurm", "cluster.timeout_min=2",
                            "cluster.signal_delay_s=30", "cluster.max_num_timeout=3"], cache_dir, tmp_path / "logs")
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        assert ref.wait(400) == 0, ref.describe()
        assert cli.wait(420) == 0, cli.describe()
    finally:
        ref.kill()
        if cli is not None:
            cli.kill()
    out = cli.stdout
    stops = [e["iteration"] for e in events(run_dir, "stopped")]
    assert stops, f"no time-limit stop: the job finished {n} iterations before its signal; " \
                  f"raise TIME_LIMIT_ITERS for this machine\n{out[-2000:]}"

    # The launcher: waited through the requeue(s), then success with the job id.
    assert f"job {job_id} requeued (1 of at most 3)" in out, out
    assert f"completed: iteration {n} |" in out and out.rstrip().endswith(f"| job {job_id}"), out

    # SLURM and the job records: requeued, restarted, completed (the batch script ends a moment
    # after the ranks have written their results).
    st = wait_until(lambda: (s := jobs.slurm_job_status(job_id)) and s.ended and s, 60, "SLURM to end the job")
    assert st.state == "completed" and st.restarts == len(stops) >= 1, (st, stops)
    requeued = [r for r in history.read_records(run_dir) if r["event"] == "requeued"]
    assert [r["restart_count"] for r in requeued] == list(range(len(stops))), requeued
    assert all(r["job_id"] == job_id and r["signal"] == "SIGUSR2" for r in requeued), requeued

    # SLURM ran it as 4 tasks of one job (sbatch + srun), each rank leaving a success result.
    folder = run_dir / "submitit"
    for rank in range(4):
        assert (folder / f"{job_id}_{rank}_result.pkl").exists()
        assert f"global_rank={rank}(4)" in (folder / f"{job_id}_{rank}_log.out").read_text()
    script = (folder / f"{job_id}_submission.sh").read_text()
    assert "#SBATCH --ntasks-per-node=4" in script and "#SBATCH --partition=dev" in script
    assert sbatch.srun_line(script).startswith("srun ")
    assert f"submitted job {job_id} (slurm, 4 tasks)" in out, out
    assert json.loads((run_dir / "checkpoints" / f"iter_{n:07d}" / "manifest.json").read_text())["iteration"] == n

    # Each stop saved a checkpoint (manifest last) and the next allocation resumed from it.
    log = (run_dir / "submitit" / f"{job_id}_0_log.out").read_text()
    for it in stops:
        ckpt = run_dir / "checkpoints" / f"iter_{it:07d}"
        assert json.loads((ckpt / "manifest.json").read_text())["iteration"] == it
        assert f"resumed from {ckpt} at iteration {it}" in log, log[-3000:]
    err = (run_dir / "submitit" / f"{job_id}_0_log.err").read_text()
    assert f"requeued SLURM job {job_id}: requeue 1 of at most 3" in err
    assert "SLURM job %s restarted: requeue 1 of at most 3 (SLURM_RESTART_COUNT=1)" % job_id in err

    # No iteration trained twice; the losses equal the uninterrupted run's, around every resume too.
    records = read_metrics(run_dir)
    assert [r["iteration"] for r in records] == list(range(1, n + 1))
    slurm, local = losses_by_iteration(run_dir), losses_by_iteration(tmp_path / "local")
    assert_losses_match(slurm, local, range(1, n + 1))
    for it in stops:
        assert_losses_match(slurm, local, range(it + 1, min(it + 4, n + 1)))  # spelled out: just after

    rows = status_rows(tmp_path)
    row = rows["slurm"]
    assert row["state"] == "completed" and row["job"]["restarts"] == len(stops), row
    assert row["iteration"] == n and abs(row["lm_loss"] - local[n]) <= REL * local[n], row
    line = table_line(rows, "slurm")
    assert f"completed after {len(stops)} requeue" in line and line.split()[-2:] == [str(n), f"{local[n]:.4f}"], line

    # The attempt history (issue 11): one attempt per allocation with its cause and the iteration it
    # reached, in `status` (--json and --history) and in the final checkpoint's manifest.
    causes, reached = ["timeout"] * len(stops) + ["completed"], stops + [n]
    attempts = row["attempts"]
    assert [(a["job_id"], a["attempt"], a["cause"], a["iteration"]) for a in attempts] == [
        (job_id, k, c, it) for k, (c, it) in enumerate(zip(causes, reached))], attempts
    assert all(a["start"] and a["end"] and a["start"] < a["end"] for a in attempts), attempts
    final = json.loads((run_dir / "checkpoints" / f"iter_{n:07d}" / "manifest.json").read_text())
    assert [(h["attempt"], h["cause"], h["iteration"]) for h in final["history"]] == [
        (k, c, it) for k, (c, it) in enumerate(zip(causes, reached))], final["history"]
    listing = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(tmp_path), "--history"], cwd=REPO,
                             capture_output=True, text=True, timeout=60).stdout
    assert f"job {job_id} attempt 0 " in listing and f"timeout (requeued)  iteration {stops[0]}" in listing, listing
    assert f"job {job_id} attempt {len(stops)} " in listing and f"completed  iteration {n}" in listing, listing


@needs_slurm
def test_scancel_is_reported_as_cancelled_within_60_s(tmp_path, cache_dir):
    run_dir = tmp_path / "slurm"
    cli = Cli(SMALL + [f"run.root={tmp_path}", "training.train_iters=5000", "cluster=slurm_dev",
                       "run.name=slurm"], cache_dir, tmp_path / "logs")
    try:
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        wait_until(lambda: iterations_done(run_dir) >= 2, 180, "training on SLURM", cli)
        t0 = time.monotonic()
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        code = cli.wait(60)
        elapsed = time.monotonic() - t0
        print(f"launcher ended {elapsed:.1f} s after the {'scancel' if 'scancel' in cli.out_path.parent.parent.name else 'kill'}")
    finally:
        cli.kill()
    assert code == 1 and elapsed < 60, (code, elapsed, cli.describe())
    assert f"job {job_id} was cancelled" in cli.stderr, cli.describe()
    assert "Traceback" not in cli.stderr
    st = jobs.slurm_job_status(job_id)
    assert st.state == "cancelled" and st.restarts == 0, st  # SIGTERM of scancel: stopped, not requeued
    rows = status_rows(tmp_path)
    assert rows["slurm"]["state"] == "cancelled" and rows["slurm"]["iteration"] >= 2, rows["slurm"]
    assert table_line(rows, "slurm").split()[1:3] == ["cancelled", job_id]


@needs_slurm
def test_killed_rank_ends_the_job_instead_of_hanging(tmp_path, cache_dir):
    """SIGKILL one rank (what the OOM killer does): no result file from it; srun ends the step
    (--kill-on-bad-exit=1), the launcher reports the failure, the job does not hang."""
    run_dir = tmp_path / "slurm"
    cli = Cli(SMALL + [f"run.root={tmp_path}", "training.train_iters=5000", "cluster=slurm_dev",
                       "run.name=slurm"], cache_dir, tmp_path / "logs")
    try:
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        wait_until(lambda: iterations_done(run_dir) >= 2, 180, "training on SLURM", cli)
        victim = wait_until(lambda: rank_process(run_dir, 1), 30, "rank 1's process")
        t0 = time.monotonic()
        victim.kill()
        code = cli.wait(60)
        elapsed = time.monotonic() - t0
        print(f"launcher ended {elapsed:.1f} s after the {'scancel' if 'scancel' in cli.out_path.parent.parent.name else 'kill'}")
        wait_until(lambda: jobs.slurm_job_status(job_id).state not in ("running", "pending"), 60,
                   "the job to end")
    finally:
        cli.kill()
    assert code == 1 and elapsed < 60, (code, elapsed, cli.describe())
    assert f"error: job {job_id}" in cli.stderr, cli.describe()
    assert "task 1: Killed" in (run_dir / "submitit" / f"{job_id}_0_log.err").read_text()  # srun saw it
    assert rank_process(run_dir, 0) is None and rank_process(run_dir, 2) is None  # nobody left blocked
    assert status.run_status(run_dir).state in ("failed", "cancelled")


# ---- a late time-limit signal (no cluster needed) ----------------------------------------------

_LATE_USR2 = r'''
import os, signal, subprocess, sys, time
from orchestrator.runtime.preempt import StopRequest
stop = StopRequest().install()
if sys.argv[1] == "done":
    stop.training_done()
class SlowTeardown:
    def __del__(self):
        time.sleep(1.5)
keep = SlowTeardown()  # destroyed during interpreter finalization, after Python's handlers are gone
subprocess.Popen(["sh", "-c", f"sleep 0.7; kill -USR2 {os.getpid()}"])
'''


def test_usr2_during_teardown_after_training_does_not_kill_the_task(tmp_path):
    """Seen on the dev cluster: the time-limit USR2 reached a job that had just finished, during
    its teardown; the tasks died of it (exit 140) after writing their success results and SLURM
    recorded the job FAILED. After StopRequest.training_done() it is ignored."""
    script = tmp_path / "late_usr2.py"
    script.write_text(_LATE_USR2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    plain = subprocess.run([sys.executable, str(script), "plain"], cwd=REPO, env=env, timeout=60)
    assert plain.returncode == -signal.SIGUSR2  # the failure mode, reproduced
    done = subprocess.run([sys.executable, str(script), "done"], cwd=REPO, env=env, timeout=60)
    assert done.returncode == 0
