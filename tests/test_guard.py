"""Issue 11's faults: NaN/inf stop, hang watchdog, attempt history, disk full during a save.

Fast tests drive the pieces directly (real threads, files, exceptions; no process group needed).
The slow ones run real local jobs through the CLI (gloo on CPU, gpt_tiny):

* ``optimizer.lr=1000``: the job stops at the first non-finite gradient norm with one line naming
  the iteration, the value and the ranks; no checkpoint at or after it; ``status`` says ``nan``; a
  rerun with a sane lr resumes from the last good checkpoint and finishes with finite losses.
* SIGSTOP of one rank of a 2-rank job: the job ends within ``hang_timeout_s`` + 30 s naming that
  rank; the live rank's stacks are in ``<run_dir>/stacks/``.
* A run directory on a small tmpfs whose second checkpoint does not fit: one line naming ENOSPC,
  the path and the free space; after growing the filesystem the rerun resumes from the first.
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, losses_by_iteration, read_metrics, run_cli
from orchestrator.ckpt import history
from orchestrator.errors import DiskFullError, NonFiniteLossError
from orchestrator.runtime import guard as guard_mod
from orchestrator.runtime.watchdog import HANG_EXIT_CODE, JobWatch, Watchdog, hang_path, stacks_path

SMALL = ["model=gpt_tiny", "data.stdlib_max_mb=2", "training.log_interval=1", "training.eval_iters=0"]


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("SUBMITIT_EXECUTOR", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_RESTART_COUNT", "SUBMITIT_LOCAL_JOB_ID"):
        monkeypatch.delenv(key, raising=False)


# ---- attempt history -----------------------------------------------------------------------------

def test_attempts_fold_records_and_limits_count_separately(tmp_path):
    run = tmp_path / "run"
    history.record_submission(run, "7", "slurm", {"stdout": str(run / "s" / "7_0_log.out")}, num_tasks=4)
    history.record_attempt_started(run, "7", 0, iteration=0, host="n1")
    assert history.claim_attempt_end(run, "7", 0) and not history.claim_attempt_end(run, "7", 0)
    history.record_attempt_ended(run, "7", 0, "timeout", iteration=131, message="time limit", requeued=True)
    history.record_attempt_started(run, "7", 1, iteration=131, host="n2")
    history.record_attempt_ended(run, "7", 1, "hang", iteration=150, message="hang: rank 3")
    history.record_attempt_ended(run, "7", 1, "crashed", iteration=150)  # a second end: ignored
    history.record_attempt_started(run, "7", 2, iteration=150, host="n2")
    records = history.read_records(run)
    items = history.attempts(records)
    assert [(a.attempt, a.cause, a.iteration, a.start_iteration, a.host) for a in items] == [
        (0, "timeout", 131, 0, "n1"), (1, "hang", 150, 131, "n2"), (2, None, 150, 150, "n2")]
    assert items[0].requeued and items[1].end is not None and items[2].end is None
    assert history.count_ended(records, "7", history.TIMEOUT_CAUSES) == 1
    assert history.count_ended(records, "7", history.FAILURE_CAUSES) == 1
    # the manifest of the final save: the running attempt reports that iteration and "completed"
    final = history.history_for_manifest(run, 200, 200)
    assert [(a["cause"], a["iteration"]) for a in final] == [("timeout", 131), ("hang", 150), ("completed", 200)]
    assert history.history_for_manifest(run, 180, 200)[-1]["cause"] is None
    lines = history.format_attempts(items)
    assert "timeout (requeued)  iteration 131" in lines[0] and "running" in lines[2]


# ---- NaN guard (no process group: every decision is local) --------------------------------------

def _cfg(tmp_path, **training):
    from orchestrator.spec.schema import JobConfig

    cfg = JobConfig()
    cfg.run.dir = str(tmp_path)
    cfg.training.hang_timeout_s = None
    for key, value in training.items():
        setattr(cfg.training, key, value)
    return cfg


def test_nan_stops_with_one_message_and_records_the_attempt(tmp_path, clean_env):
    (tmp_path / "checkpoints" / "iter_0000004").mkdir(parents=True)
    (tmp_path / "checkpoints" / "iter_0000004" / "manifest.json").write_text("{}")
    (tmp_path / "checkpoints" / "iter_0000006").mkdir()  # torn: no manifest
    g = guard_mod.Guard(_cfg(tmp_path, train_iters=10), tmp_path, 0, "hostA", start_iteration=0)
    assert g.check(5, 5.25, 0.75) is True
    g.beat(5)
    assert g.check(6, None, 1.5) is True  # a rank off the last stage: no loss
    with pytest.raises(NonFiniteLossError) as info:
        g.check(7, float("inf"), float("nan"))
    msg = str(info.value)
    assert msg.startswith("non-finite gradient norm nan at iteration 7; lm loss non-finite on rank(s) 0")
    assert "the latest checkpoint stays iter_0000004" in msg and "\n" not in msg
    try:
        raise info.value
    except NonFiniteLossError:
        g.close()  # from a `finally`: the NaN end is already recorded
    events = [r["event"] for r in history.read_records(tmp_path)]
    assert events == ["attempt_started", "nan", "attempt_ended"]
    (a,) = history.attempts(history.read_records(tmp_path))
    assert (a.cause, a.iteration, a.message) == ("nan", 7, msg)


def test_completed_and_exited_attempts(tmp_path, clean_env):
    for iters, cause in ((8, "completed"), (20, "exited")):
        run = tmp_path / cause
        g = guard_mod.Guard(_cfg(run, train_iters=iters), run, 0, None)
        g.beat(8)
        assert guard_mod.last_iteration() == 8
        g.close()
        assert guard_mod.last_iteration() is None
        (a,) = history.attempts(history.read_records(run))
        assert (a.cause, a.iteration) == (cause, 8)


def test_skip_policy_without_guard_step_refuses_to_pretend(tmp_path, clean_env):
    """optimizer.step() already applied the update: skipping would be a lie, so it stops, saying so."""
    g = guard_mod.Guard(_cfg(tmp_path, nan_policy="skip", max_skipped_steps=3), tmp_path, 0, None)
    with pytest.raises(NonFiniteLossError, match="needs the loop to step through Guard.step"):
        g.check(3, None, float("inf"))


# ---- disk full ------------------------------------------------------------------------------------

def test_explain_save_failure(tmp_path):
    path = tmp_path / "checkpoints" / "iter_0000004"
    (tmp_path / "checkpoints" / "iter_0000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "iter_0000002" / "manifest.json").write_text("{}")
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("unexpected pos 704 vs 598") from inner
    except RuntimeError as exc:
        err = guard_mod.explain_save_failure(exc, path)
    assert isinstance(err, DiskFullError)
    text = str(err)
    assert text.startswith(f"no space left on device (ENOSPC) saving checkpoint {path}: ")
    assert " free of " in text and "latest complete checkpoint is iter_0000002" in text
    # the same writer message on a filesystem with room is not blamed on the disk
    assert guard_mod.explain_save_failure(RuntimeError("unexpected pos 704 vs 598"), path) is None
    assert guard_mod.explain_save_failure(ValueError("shape mismatch"), path) is None


# ---- hang watchdog (two ranks as two watchdogs in this process) ---------------------------------

class _Exit(SystemExit):
    pass


def _watchdogs(run_dir: Path, iterations, timeout_s=1.0):
    exits = {}

    def exit_for(rank):
        def _exit(code):
            exits[rank] = code
            raise _Exit(code)  # ends the watchdog thread like os._exit ends the process
        return _exit

    dogs = [Watchdog(run_dir, r, len(iterations), f"host{r}", "job9", 0, timeout_s, poll_s=0.1, exit=exit_for(r))
            for r in range(len(iterations))]
    for dog, it in zip(dogs, iterations):
        dog.start()
        dog.progress(it)
    return dogs, exits


def _wait(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.05)
    return predicate()


def test_watchdog_names_the_silent_rank_and_dumps_stacks(tmp_path):
    dogs, exits = _watchdogs(tmp_path, [3, 3])
    dogs[1].stop()  # rank 1's process "stopped": its thread no longer writes
    t0 = time.monotonic()
    assert _wait(lambda: 0 in exits, 10), "rank 0 never declared the hang"
    elapsed = time.monotonic() - t0
    assert exits == {0: HANG_EXIT_CODE} and 1.0 <= elapsed < 4.0, (exits, elapsed)
    hang = json.loads(hang_path(tmp_path, "job9", 0).read_text())
    assert hang["stalled"] == [1] and hang["hosts"] == "host1" and hang["done"] and hang["reporter"] == 0
    assert "rank(s) 1 on host(s) host1 made no progress" in hang["message"]
    assert "not responding" in hang["message"] and "after iteration 3" in hang["message"]
    stacks = stacks_path(tmp_path, 0).read_text()
    assert "# rank 0 on host0" in stacks and "test_watchdog_names_the_silent_rank" in stacks  # the main thread
    (a,) = history.attempts(history.read_records(tmp_path))
    assert (a.cause, a.iteration, a.message) == ("hang", 3, hang["message"])
    assert [r["stalled"] for r in history.read_records(tmp_path) if r["event"] == "hang"] == [[1]]


def test_watchdog_names_the_rank_behind_and_every_live_rank_dumps(tmp_path):
    dogs, exits = _watchdogs(tmp_path, [4, 5])  # both alive; rank 0 never finished iteration 5
    assert _wait(lambda: len(exits) == 2, 15), exits
    assert exits == {0: HANG_EXIT_CODE, 1: HANG_EXIT_CODE}
    hang = json.loads(hang_path(tmp_path, "job9", 0).read_text())
    assert hang["stalled"] == [0] and "behind the others (they reached iteration 5)" in hang["message"]
    assert stacks_path(tmp_path, 0).exists() and stacks_path(tmp_path, 1).exists()
    assert len([r for r in history.read_records(tmp_path) if r["event"] == "attempt_ended"]) == 1


def test_no_hang_while_progressing_or_saving(tmp_path):
    dogs, exits = _watchdogs(tmp_path, [1, 1], timeout_s=0.6)
    with dogs[0].phase_of("save", 5.0), dogs[1].phase_of("save", 5.0):
        time.sleep(1.5)  # longer than hang_timeout_s, inside a save
    for it in range(2, 12):
        time.sleep(0.2)
        for dog in dogs:
            dog.progress(it)
    for dog in dogs:
        dog.stop()
    assert exits == {} and not hang_path(tmp_path, "job9", 0).exists()


def test_launcher_backstop_sees_every_rank_silent(tmp_path):
    dogs, exits = _watchdogs(tmp_path, [2, 2], timeout_s=30)
    watch = JobWatch(tmp_path, "job9", 2, timeout_s=0.3, grace_s=0.0, every_s=0.05)
    assert _wait(lambda: watch.silent_for() is not None, 2)
    assert watch.hung() is None  # the ranks' threads are writing
    for dog in dogs:
        dog.stop()
    assert _wait(lambda: watch.hung() is not None, 5)
    assert "no rank of job job9 (hosts host0,host1) wrote its heartbeat" in watch.hung()
