"""Issue 11's faults: NaN/inf stop, hang watchdog, attempt history, disk full during a save.

Fast tests drive the pieces directly (real threads, files, exceptions; no process group needed).
The slow ones run real local jobs through the CLI (gloo on CPU, gpt_tiny):

* ``optimizer.lr=1000``: the job stops at the first non-finite gradient norm with one line naming
  the iteration, the value and the ranks; no checkpoint at or after it; ``status`` says ``nan``; a
  rerun with a sane lr resumes from the last good checkpoint and finishes with finite losses.
* ``training.nan_policy=skip``: +inf put into a gradient at chosen iterations (the runtime's test-only
  ``ORCHESTRATOR_TEST_NONFINITE_GRAD_AT``): skipped updates leave the checkpointed weights and Adam
  moments unchanged, training continues, one skip too many in a row stops the job with a NaN end.
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
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, losses_by_iteration, mounted_tmpfs, read_metrics, run_cli

from orchestrator.ckpt import attempts, history
from orchestrator.config.compose import compose_config
from orchestrator.config.spike import proposed_lr
from orchestrator.errors import DiskFullError, NonFiniteLossError
from orchestrator.runtime.faults import guard as guard_mod
from orchestrator.runtime.faults.watchdog import HANG_EXIT_CODE, JobWatch, Watchdog, hang_path, stacks_path

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
    items = attempts.attempts(records)
    assert [(a.attempt, a.cause, a.iteration, a.start_iteration, a.host) for a in items] == [
        (0, "timeout", 131, 0, "n1"),
        (1, "hang", 150, 131, "n2"),
        (2, None, 150, 150, "n2"),
    ]
    assert items[0].requeued and items[1].end is not None and items[2].end is None
    assert attempts.count_ended(records, "7", history.TIMEOUT_CAUSES) == 1
    assert attempts.count_ended(records, "7", history.FAILURE_CAUSES) == 1
    # the manifest of the final save: the running attempt reports that iteration and "completed"
    final = attempts.history_for_manifest(run, 200, 200)
    assert [(a["cause"], a["iteration"]) for a in final] == [("timeout", 131), ("hang", 150), ("completed", 200)]
    assert attempts.history_for_manifest(run, 180, 200)[-1]["cause"] is None
    lines = attempts.format_attempts(items)
    assert "timeout (requeued)  iteration 131" in lines[0] and lines[0].endswith("  time limit")
    assert lines[1].endswith("hang  iteration 150 (from 131)  rank 3") and lines[1].count("hang") == 1, lines[1]
    assert " since " in lines[2] and lines[2].count("running") == 1, lines[2]  # each state said once
    # a later local job that got the same (process) id is a new attempt, not a second end of the old one
    history.record_attempt_ended(run, "7", 2, "completed", iteration=200)
    assert history.claim_attempt_end(run, "7", 0) is False  # the old job's marker ...
    history.clear_attempt_markers(run, "7", 0)  # ... cleared by the new job's rank 0
    history.record_submission(run, "7", "local", {}, num_tasks=1)
    history.record_attempt_started(run, "7", 0, iteration=200, host="n3")
    history.record_attempt_ended(run, "7", 0, "completed", iteration=210)
    items = attempts.attempts(history.read_records(run))
    assert [(a.attempt, a.cause, a.iteration) for a in items] == [
        (0, "timeout", 131),
        (1, "hang", 150),
        (2, "completed", 200),
        (0, "completed", 210),
    ]


def test_a_stop_proposes_the_configs_own_lr_naming_its_source_when_the_command_line_raised_it_else_a_tenth():
    own = compose_config(["+experiment=gpt_pp2_dp2"])
    assert own.training.spike.suggest_lr is None  # nothing overridden: nothing to remember
    raised = compose_config(["+experiment=gpt_pp2_dp2", "optimizer.lr=1000"])
    spike = raised.training.spike
    assert raised.optimizer.lr == 1000 and spike.suggest_lr == own.optimizer.lr
    # gpt_pp2_dp2 sets no lr: 0.001 is the adam preset's, not the experiment's
    assert proposed_lr(raised.optimizer.lr, spike.suggest_lr, spike.suggest_lr_from) == (
        own.optimizer.lr,
        "the optimizer=adam preset's default",
    )
    bare = compose_config(["model=gpt_tiny", "parallelism=none", "optimizer.lr=1e30"]).training.spike
    assert (bare.suggest_lr, bare.suggest_lr_from) == (0.001, "the optimizer=adam preset's default")
    llama = compose_config(["+experiment=llama3_8b_a100x32", "optimizer.lr=1"]).training.spike
    assert (llama.suggest_lr, llama.suggest_lr_from) == (3e-4, "the experiment's own")  # its optimizer.lr: 3.0e-4
    lowered = compose_config(["+experiment=gpt_pp2_dp2", f"optimizer.lr={own.optimizer.lr / 2}"])
    assert lowered.training.spike.suggest_lr is None  # already below the config's: a tenth of it
    assert proposed_lr(lowered.optimizer.lr, None) == (lowered.optimizer.lr / 10, "a tenth")
    mine = compose_config(["optimizer.lr=1000", "training.spike.suggest_lr=0.5"])
    assert mine.training.spike.suggest_lr == 0.5  # a user's own choice is kept
    assert proposed_lr(1000, 0.5, mine.training.spike.suggest_lr_from) == (0.5, "training.spike.suggest_lr")


# ---- NaN guard (no process group: every decision is local) --------------------------------------


def _cfg(tmp_path, **training):
    from orchestrator.config.schema import JobConfig

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
    # tighter clipping is a *smaller* clip_grad: never suggest raising it
    assert msg.endswith(
        "fix: lower optimizer.lr=0.001 -> optimizer.lr=0.0001, a tenth (or raise optimizer.lr_warmup_iters=0 -> "
        "optimizer.lr_warmup_iters=10, or clip harder with optimizer.clip_grad below 1) and rerun to resume"
    ), msg
    try:
        raise info.value
    except NonFiniteLossError:
        g.close()  # from a `finally`: the NaN end is already recorded
    events = [r["event"] for r in history.read_records(tmp_path)]
    assert events == ["attempt_started", "nan", "attempt_ended"]
    (a,) = attempts.attempts(history.read_records(tmp_path))
    assert (a.cause, a.iteration, a.message) == ("nan", 7, msg)


def test_a_nan_before_any_save_never_says_rerun_to_resume(tmp_path, clean_env):
    g = guard_mod.Guard(_cfg(tmp_path, train_iters=10), tmp_path, 0, "hostA", start_iteration=0)
    with pytest.raises(NonFiniteLossError) as info:
        g.check(2, float("inf"), float("nan"))
    g.close()
    msg = str(info.value)
    assert "no checkpoint was saved before it" in msg and "resume" not in msg, msg
    assert msg.endswith("and rerun (nothing was saved: it starts again from iteration 0)"), msg


@pytest.mark.mcore_lines
def test_a_nan_stays_a_nan_when_its_attribution_raises_and_is_never_requeued(tmp_path, monkeypatch):
    """megatron-core 0.19 renamed the optimizer call the attribution uses: the AttributeError ended the
    attempt as ``crashed`` and, on SLURM with cluster.max_failures left, requeued it. Whatever raises on
    the NaN path, the attempt ends as ``nan``, in one line, and no requeue is decided."""
    for key, value in (("SLURM_JOB_ID", "4242"), ("SLURM_PROCID", "0"), ("SLURM_RESTART_COUNT", "0")):
        monkeypatch.setenv(key, value)
    cfg = _cfg(tmp_path, train_iters=10)
    cfg.cluster.max_failures = 2
    g = guard_mod.Guard(cfg, tmp_path, 0, "hostA", start_iteration=0)
    g._optimizer = object()  # no get_(main_)grads_for_grad_norm: what 0.16's spelling met under 0.19
    with pytest.raises(NonFiniteLossError) as info:
        try:
            g.check(3, float("nan"), float("nan"))
        finally:
            g.close()
    msg = str(info.value)
    assert msg.startswith("non-finite gradient norm nan at iteration 3; ranks not attributed (AttributeError: ")
    assert "fix: lower optimizer.lr" in msg and "\n" not in msg
    records = history.read_records(tmp_path)
    assert [r["event"] for r in records] == ["attempt_started", "nan", "attempt_ended"]
    (a,) = attempts.attempts(records)
    assert (a.cause, a.iteration, a.message, a.requeued) == ("nan", 3, msg, False)


def test_completed_and_exited_attempts(tmp_path, clean_env):
    for iters, cause in ((8, "completed"), (20, "exited")):
        run = tmp_path / cause
        g = guard_mod.Guard(_cfg(run, train_iters=iters), run, 0, None)
        g.beat(8)
        assert guard_mod.last_iteration() == 8
        g.close()
        assert guard_mod.last_iteration() is None
        (a,) = attempts.attempts(history.read_records(run))
        assert (a.cause, a.iteration) == (cause, 8)


def test_skip_policy_without_guard_step_refuses_to_pretend(tmp_path, clean_env):
    """optimizer.step() already applied the update: skipping would be a lie, so it stops, saying so."""
    g = guard_mod.Guard(_cfg(tmp_path, nan_policy="skip", max_skipped_steps=3), tmp_path, 0, None)
    with pytest.raises(NonFiniteLossError, match="needs the loop to step through Guard.step"):
        g.check(3, None, float("inf"))


def test_a_host_whose_every_rank_is_gone_is_a_node_failure_one_rank_a_crash(tmp_path, clean_env):
    """The survivors of a failed collective say so (rank_alive); every rank of one host silent while
    the other host's answered is a lost node; one silent rank, or a one-host job, is a crash."""
    from orchestrator.runtime.faults import lost
    from orchestrator.runtime.faults.watchdog import heartbeat_path, write_heartbeat

    assert lost.lost_hosts({0, 1}, {0: "node1", 1: "node1", 2: "node2", 3: "node2"}) == {"node2": [2, 3]}
    assert lost.lost_hosts({0, 1, 2}, {0: "node1", 1: "node1", 2: "node2", 3: "node2"}) == {}
    assert lost.lost_hosts(set(), {0: "node1", 1: "node2"}) == {}  # nobody answered: nothing to compare
    for rank, host in enumerate(["node1", "node1", "node2", "node2"]):
        path = heartbeat_path(tmp_path, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_heartbeat(path, {"rank": rank, "host": host, "job_id": "7", "attempt": 0})
    lost.report_alive(str(tmp_path), "7", 0, 1)
    lost.report_alive(str(tmp_path), "7", 0, 0)
    t0 = time.monotonic()
    assert lost.crash_cause(str(tmp_path), "7", 0, 4, "rank 0 (node1) crashed", wait_s=0.5) == (
        "node failure",
        "node node2 lost (ranks 2,3): rank 0 (node1) crashed",
    )
    assert time.monotonic() - t0 >= 0.5  # it waited for the others
    lost.report_alive(str(tmp_path), "7", 0, 3)
    assert lost.crash_cause(str(tmp_path), "7", 0, 4, "x", wait_s=0.1) == ("crashed", "x")  # node2 still had rank 3
    assert lost.crash_cause(str(tmp_path), "8", 0, 4, "x", wait_s=0.1) == ("crashed", "x")  # another job's heartbeats


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


def test_a_checkpoint_exception_without_errno_on_a_full_filesystem_is_disk_full(tmp_path):
    """torch's CheckpointException whose failing writer was another process carries no errno and no text of its
    cause ("ranks:dict_keys([])"): on a filesystem that is out of space it is the disk (recorded as disk full, not
    as a crash); with room left it stays unexplained."""
    from torch.distributed.checkpoint.api import CheckpointException

    exc = CheckpointException("save", {})
    assert guard_mod.explain_save_failure(exc, tmp_path / "checkpoints" / "iter_0000004") is None
    mounted = mounted_tmpfs(tmp_path / "full", 2)
    mnt = next(mounted)  # held: the generator unmounts when it is closed
    try:
        assert os.statvfs(mnt).f_blocks * os.statvfs(mnt).f_frsize <= 4 * 2**20  # the tmpfs, not the disk under it
        with open(mnt / "filler", "wb") as f:  # fill it, as someone else's job would (at most its 2 MiB)
            try:
                for _ in range(64):
                    f.write(b"\0" * 2**16)
                    f.flush()
            except OSError:
                pass
        err = guard_mod.explain_save_failure(exc, mnt / "checkpoints" / "iter_0000004")
        assert isinstance(err, DiskFullError) and str(err).startswith("no space left on device (ENOSPC) saving")
    finally:
        mounted.close()


def test_enospc_outside_a_save_is_a_full_disk_in_the_line_and_the_history(tmp_path):
    """A metrics append that ran out of space (``OSError`` ENOSPC, no file name: a flush) was recorded as a
    generic crash, and the launcher's fallback said "saving checkpoint <run>/checkpoints" with no save under way.
    Now it names the file (else the run directory) and the free space; a launcher's crash record that says disk
    full is recorded as cause ``disk full``."""
    from orchestrator.runtime.faults.diskspace import explain_write_failure
    from orchestrator.submit import outcome

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("flushing metrics")  # noqa: B904 - the implicit context, as a handler's raise
    except RuntimeError as exc:
        err = explain_write_failure(exc, run_dir)
    assert isinstance(err, DiskFullError)
    assert str(err).startswith(f"no space left on device (ENOSPC) writing {run_dir}: ") and " free of " in str(err)
    assert "no complete checkpoint yet; fix: free space there (or set run.root" in str(err)
    named = explain_write_failure(
        OSError(errno.ENOSPC, "No space left on device", str(run_dir / "metrics.jsonl")), run_dir
    )
    assert str(named).startswith(f"no space left on device (ENOSPC) writing {run_dir / 'metrics.jsonl'}: ")
    assert explain_write_failure(OSError(errno.EACCES, "Permission denied"), run_dir) is None
    history.record_attempt_started(str(run_dir), "9", 0, host="h", world_size=1, iteration=0, train_iters=4)
    outcome.record_end(str(run_dir), "9", "crashed", str(err))
    (ended,) = attempts.attempts(history.read_records(str(run_dir)))
    assert (ended.cause, ended.message) == ("disk full", str(err))


# ---- hang watchdog (two ranks as two watchdogs in this process) ---------------------------------


class _Exit(SystemExit):
    pass


def _watchdogs(run_dir: Path, iterations, timeout_s=1.0, on_hang=None):
    exits = {}

    def exit_for(rank):
        def _exit(code):
            exits[rank] = code
            raise _Exit(code)  # ends the watchdog thread like os._exit ends the process

        return _exit

    dogs = [
        Watchdog(
            run_dir, r, len(iterations), f"host{r}", "job9", 0, timeout_s, on_hang=on_hang, poll_s=0.1, exit=exit_for(r)
        )
        for r in range(len(iterations))
    ]
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
    seen = []

    def on_hang(message):  # what the SLURM requeue sees: this hang already counts as a failure
        seen.append(attempts.count_ended(history.read_records(tmp_path), "job9", history.FAILURE_CAUSES))
        return True, "requeued SLURM job job9 (failure 1 of at most 1 retried)"

    dogs, exits = _watchdogs(tmp_path, [3, 3], on_hang=on_hang)
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
    (a,) = attempts.attempts(history.read_records(tmp_path))
    assert (a.cause, a.iteration, a.message, a.requeued) == ("hang", 3, hang["message"], True)
    assert seen == [1] and hang["requeued"] and hang["detail"].startswith("requeued SLURM job job9")
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
    # hang_timeout_s 3 s: a loaded CI machine stalled this process's heartbeat threads for 2 s at 0.6 s (a false hang)
    dogs, exits = _watchdogs(tmp_path, [1, 1], timeout_s=3.0)
    with dogs[0].phase_of("save", 10.0), dogs[1].phase_of("save", 10.0):
        time.sleep(3.5)  # longer than hang_timeout_s, inside a save
    for it in range(2, 12):
        time.sleep(0.2)
        for dog in dogs:
            dog.progress(it)
    for dog in dogs:
        dog.stop()
    assert exits == {} and not hang_path(tmp_path, "job9", 0).exists()


def test_a_stopped_rank_is_named_within_hang_timeout_while_its_peers_save_or_load(tmp_path):
    """A peer whose heartbeat thread stopped (SIGSTOP, frozen) is named after ``hang_timeout_s`` whatever
    the phase: inside a save allowed 60 s, and during the checkpoint load before the first iteration
    (where a peer that has not written yet is not counted)."""
    dogs, exits = _watchdogs(tmp_path / "save", [3, 3], timeout_s=1.0)
    t0 = time.monotonic()
    with dogs[0].phase_of("save", 60.0):
        dogs[1].stop()
        assert _wait(lambda: 0 in exits, 10), "rank 0 never declared the hang inside the save"
    elapsed = time.monotonic() - t0
    hang = json.loads(hang_path(tmp_path / "save", "job9", 0).read_text())
    assert (
        hang["stalled"] == [1] and "not responding" in hang["message"] and "after iteration 3 (save)" in hang["message"]
    )
    assert 1.0 <= elapsed < 4.0, elapsed  # hang_timeout_s (1 s) + polls, not the save's 60 s

    run_dir = tmp_path / "load"
    exits.clear()

    def exit_0(code):
        exits[0] = code
        raise _Exit(code)

    dogs = [
        Watchdog(run_dir, r, 3, f"host{r}", "job9", 0, 1.0, poll_s=0.1, exit=exit_0) for r in range(2)
    ]  # rank 2 never starts its watchdog
    for dog in dogs:
        dog.start()
    with dogs[0].phase_of("load", 1.0):
        time.sleep(0.5)
        dogs[1].stop()
        assert _wait(lambda: 0 in exits, 10), "rank 0 never declared the hang during the load"
    hang = json.loads(hang_path(run_dir, "job9", 0).read_text())
    assert hang["stalled"] == [1] and "after the start of the attempt (load)" in hang["message"], hang
    dogs[0].stop()


def test_ranks_restarted_in_place_do_not_follow_the_hang_of_their_previous_start(tmp_path):
    """Ranks restarted in place keep the job id and attempt, and their watchdog starts before the model build,
    seconds after the hang that restarted them was declared: that hang's file (restart 0) must not stop them
    (a CI run under load: both restarted ranks followed it and exited 79 before training). A hang of their own
    start (restart 1) still does."""
    exits = {}

    def exit_1(code):
        exits[1] = code
        raise _Exit(code)

    path = hang_path(tmp_path, "job9", 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"stalled": [1], "reporter": 0, "done": True, "time": time.time(), "restart": 0}))
    dog = Watchdog(tmp_path, 1, 2, "host1", "job9", 0, 30.0, poll_s=0.05, exit=exit_1, restart=1).start()
    time.sleep(0.5)
    assert exits == {}, "a restarted rank followed the hang of the start before it"
    path.write_text(json.dumps({"stalled": [0], "reporter": 0, "done": True, "time": time.time(), "restart": 1}))
    assert _wait(lambda: exits.get(1) == HANG_EXIT_CODE, 10), exits
    dog.stop()


def test_launcher_backstop_sees_every_rank_silent(tmp_path):
    dogs, exits = _watchdogs(tmp_path, [2, 2], timeout_s=30)
    watch = JobWatch(tmp_path, "job9", 2, timeout_s=0.3, grace_s=0.0, every_s=0.05)
    assert _wait(lambda: watch.silent_for() is not None, 2)
    assert watch.hung() is None  # the ranks' threads are writing
    for dog in dogs:
        dog.stop()
    assert _wait(lambda: watch.hung() is not None, 5)
    assert "no rank of job job9 (hosts host0,host1) wrote its heartbeat" in watch.hung()


# ---- end to end: real local jobs through the CLI -------------------------------------------------


def _error_lines(stderr: str):
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def _manifest_list(run_dir: Path) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "manifest", "list", str(run_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _listed_iterations(listing: str):
    return [int(line.split()[0]) for line in listing.splitlines() if line.split() and line.split()[0].isdigit()]


def _status(root: Path):
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "status", str(root), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return {Path(d["run_dir"]).name: d for d in map(json.loads, out.stdout.splitlines())}


@pytest.mark.slow
@pytest.mark.mcore_lines
def test_nan_stops_before_saving_and_a_sane_rerun_resumes(tmp_path, cache_dir):
    """A sane run saves iteration 4; rerun with optimizer.lr=1e30 (a user's typo), the first non-finite gradient
    norm stops the job with one line; the checkpoints it would have written at and after that iteration do not
    exist; status says nan; the same command with the sane lr again resumes from the last good checkpoint and
    finishes. (lr 1e30 blows the weights up at the first step with a non-zero lr, so the forward after it is
    non-finite and no blown-up checkpoint is saved: with lr=1000 the loss grew for ~9 iterations before it overflowed,
    and where it overflowed depended on the data, so the last "good" checkpoint held weights no lr could rescue.)"""
    run_dir = tmp_path / "nan"
    # the spike stop (test_a_loss_spike_stops_...) would end it first, and the rerun from its blown-up
    # checkpoint: opted out, the NaN guard's turn
    common = SMALL + [
        "parallelism=none",
        f"run.root={tmp_path}",
        "run.name=nan",
        "training.train_iters=14",
        "checkpoint.save_interval=4",
        "training.spike.factor=null",
    ]
    sane = ["optimizer.lr=1e-4", "optimizer.min_lr=1e-5"]
    run_cli(
        [a for a in common if not a.startswith("training.train_iters")] + sane + ["training.train_iters=4"],
        cache=cache_dir,
        timeout=900,
    )
    proc = run_cli(common + ["optimizer.lr=1e30"], cache=cache_dir, check=False, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = _error_lines(proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    import re

    # one rank: the loss or (a step later in the blow-up) only the gradients name rank 0
    m = re.search(
        r"non-finite gradient norm (nan|inf) at iteration (\d+); (lm loss|gradients) non-finite on rank\(s\) 0", line
    )
    assert m, line
    bad = int(m.group(2))
    good = {r["iteration"]: r["lm_loss"] for r in read_metrics(run_dir)}
    assert sorted(good) == list(range(1, bad)) and all(math.isfinite(v) for v in good.values())  # the first one
    listed = _listed_iterations(_manifest_list(run_dir))
    assert listed and max(listed) < bad and listed == [i for i in range(4, bad, 4)], (listed, bad)
    assert f"the latest checkpoint stays iter_{max(listed):07d}" in line
    assert not [p for p in (run_dir / "checkpoints").iterdir() if int(p.name[5:12]) >= bad]  # not even torn
    row = _status(tmp_path)["nan"]
    assert (row["state"], row["job"]["cause"]) == ("failed", "nan") and row["attempts"][-1]["iteration"] == bad

    resumed = run_cli(common + sane, cache=cache_dir, timeout=900)
    assert f"resume from {run_dir / 'checkpoints' / f'iter_{max(listed):07d}'}" in resumed.stdout
    losses = losses_by_iteration(run_dir)
    assert sorted(losses) == list(range(1, 15)) and all(math.isfinite(losses[i]) for i in range(max(listed) + 1, 15))
    attempts = _status(tmp_path)["nan"]["attempts"]
    assert [a["cause"] for a in attempts] == ["completed", "nan", "completed"], attempts
    final = json.loads((run_dir / "checkpoints" / "iter_0000014" / "manifest.json").read_text())
    history = [(a["cause"], a["iteration"]) for a in final["history"]]
    assert history == [("completed", 4), ("nan", bad), ("completed", 14)], history


@pytest.mark.slow
def test_at_the_shipped_log_interval_a_spike_within_the_first_interval_is_caught_against_the_first_iteration(
    tmp_path, cache_dir
):
    """At the shipped training.log_interval (10) the loss is read at the attempt's first iteration (as Megatron-LM
    logs its first) and every 10th: optimizer.lr=5 blows gpt_tiny's loss up within the first 10 iterations, and the
    guard stops at iteration 10 against iteration 1's loss, nothing saved (exit 1; without the first iteration's
    read the run completed and saved the blown-up weights: iteration 10 had no reference)."""
    run_dir = tmp_path / "spike10"
    args = [a for a in SMALL if not a.startswith("training.log_interval")] + [
        "parallelism=none",
        f"run.root={tmp_path}",
        "run.name=spike10",
        "training.train_iters=12",
        "optimizer.lr=5.0",
    ]
    proc = run_cli(args, cache=cache_dir, check=False, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = _error_lines(proc.stderr)
    m = re.search(
        r"lm loss spike at iteration 10: (\S+) > training.spike.factor=10 x median (\S+) of the last 1 ", line
    )
    assert m, line
    records = {r["iteration"]: r["lm_loss"] for r in read_metrics(run_dir)}
    assert sorted(records) == [1] and float(m.group(2)) == pytest.approx(records[1], rel=1e-5)
    assert float(m.group(1)) > 10 * records[1] and not (run_dir / "checkpoints").exists()


def test_a_loss_spike_stops_before_the_spiked_iteration_is_saved(tmp_path, cache_dir):
    """optimizer.lr=1000 with the default training.spike.factor=10, a checkpoint every iteration: the job
    stops (exit 1, one line naming the iteration, the value and the median, and a lower lr) at the first
    iteration whose loss exceeds 10 x the median of the earlier ones, long before any NaN; no checkpoint
    at or after it exists; the attempt ends as ``spike``. The same command again (issue 39) resumes from the last
    checkpoint, and the spike is now the first iteration of the attempt: caught again, the same value against the
    same reference (the window rebuilt from the run's records); with an empty window it passed, and was saved."""
    run_dir = tmp_path / "spike"
    args = SMALL + [
        "parallelism=none",
        f"run.root={tmp_path}",
        "run.name=spike",
        "training.train_iters=8",
        "checkpoint.save_interval=1",
        "checkpoint.keep_last=null",
        "optimizer.lr=1000",
    ]
    proc = run_cli(args, cache=cache_dir, check=False, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = _error_lines(proc.stderr)
    assert "Traceback" not in proc.stderr
    m = re.search(
        r"(lm loss|grad norm) spike at iteration (\d+): (\S+) > training.spike.factor=10 x "
        r"(median|max) (\S+) ",
        line,
    )
    assert m, line
    spiked, value, reference = int(m.group(2)), float(m.group(3)), float(m.group(5))
    own = compose_config(SMALL).optimizer.lr  # the command line raised the lr: the fix proposes the config's own
    assert f"optimizer.lr=1000 -> optimizer.lr={own:g}, the optimizer=adam preset's default" in line, line
    assert "training.spike.factor=null" in line
    records = {r["iteration"]: r for r in read_metrics(run_dir)}
    assert sorted(records) == list(range(1, spiked))  # nothing of the spiked iteration was recorded
    key, summary = ("lm_loss", statistics.median) if m.group(1) == "lm loss" else ("grad_norm", max)
    assert m.group(4) == ("median" if key == "lm_loss" else "max")
    assert reference == pytest.approx(summary([records[i][key] for i in range(1, spiked)]), rel=1e-5)
    assert value > 10 * reference
    assert all(math.isfinite(r["lm_loss"]) for r in records.values()) and math.isfinite(value)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"iter_{i:07d}" for i in range(1, spiked)]
    (a,) = attempts.attempts(history.read_records(run_dir))
    assert (a.cause, a.iteration) == ("spike", spiked)

    rerun = run_cli(args, cache=cache_dir, check=False, timeout=900)  # resumes: the spike is its first iteration
    assert spiked >= 2 and f"resume from {run_dir / 'checkpoints' / f'iter_{spiked - 1:07d}'}" in rerun.stdout
    assert rerun.returncode == 1, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    (again,) = _error_lines(rerun.stderr)
    m2 = re.search(r"(lm loss|grad norm) spike at iteration (\d+): (\S+) > .* (median|max) (\S+) ", again)
    assert m2 and m2.group(1, 2, 4) == m.group(1, 2, 4), (line, again)
    assert float(m2.group(3)) == pytest.approx(value, rel=1e-4) and float(m2.group(5)) == pytest.approx(reference)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"iter_{i:07d}" for i in range(1, spiked)]
    assert [(x.cause, x.iteration) for x in attempts.attempts(history.read_records(run_dir))] == [("spike", spiked)] * 2


def test_spike_watch_compares_with_the_recent_median():
    """The rule itself: a loss above factor x the median of the window, a grad norm above factor x its
    max, is a spike (not added), from the second value on; non-finite values are the NaN guard's; factor
    None never fires."""
    from orchestrator.runtime.faults.spike import SpikeWatch

    w = SpikeWatch(10.0, window=3)
    assert [w.spike("lm loss", v) for v in (5.0, 4.0, 40.0, 6.0)] == [None] * 4  # 40 <= 10 x 4.5
    assert w.spike("lm loss", 61.0) == (61.0, 6.0)  # window (4, 40, 6): median 6
    assert w.spike("lm loss", float("nan")) is None and w.spike("grad norm", float("inf")) is None
    assert [w.spike("grad norm", v) for v in (1.0, 3.0, 1.0)] == [None] * 3  # 3 > 10 x median 1 would not be
    assert w.spike("grad norm", 29.0) is None and w.spike("grad norm", 291.0) == (291.0, 29.0)  # the max
    off = SpikeWatch(None)
    assert off.spike("lm loss", 1.0) is None and off.spike("lm loss", 1e9) is None


def test_a_resumed_attempt_is_guarded_from_its_first_iteration(tmp_path):
    """issue 39: the spike window is rebuilt from the run's records up to the checkpoint it resumed from (the
    iterations redone after it are not counted), so a spike in an attempt's first iteration is caught, not saved;
    an empty window (the old behaviour) accepted any first value."""
    import json

    from orchestrator.runtime.faults.spike import SpikeWatch

    records = [{"iteration": i, "lm_loss": 5.0 + 0.01 * i, "grad_norm": 1.0} for i in range(1, 31)]
    records += [{"event": "saved", "iteration": 20}, {"iteration": 21, "lm_loss": 900.0, "grad_norm": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    watch = SpikeWatch(10.0, window=20)
    assert watch.seed(tmp_path, start_iteration=20) == 20  # iterations 1..20, the last record of 21 ignored
    assert max(watch.recent["lm loss"]) < 6.0
    assert watch.spike("lm loss", 80.0) == (80.0, statistics.median(5.0 + 0.01 * i for i in range(1, 21)))
    assert SpikeWatch(10.0).spike("lm loss", 80.0) is None  # without the seed: the first value passes
    assert SpikeWatch(10.0).seed(tmp_path / "missing", 0) == 0


def _checkpoint_tensors(path: Path, into: Path) -> dict:
    """Every tensor of a torch_dist checkpoint (model and optimizer state), read back with torch's own
    ``dcp_to_torch_save``."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = into / f"{path.name}.pt"
    dcp_to_torch_save(str(path), str(out))
    flat = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            flat[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)

    walk("", torch.load(out, weights_only=False))
    return flat


@pytest.mark.slow
def test_skip_policy_leaves_updates_unapplied_continues_and_stops_after_too_many_in_a_row(tmp_path, cache_dir):
    """training.nan_policy=skip in a real job: +inf put into a gradient at iterations 3, 5, 6 and 7
    (the runtime's test-only NONFINITE_GRAD_ENV) with max_skipped_steps=2. Iteration 3 is skipped (its
    checkpoint's weights and optimizer moments equal iteration 2's; the LR schedule does not advance),
    4 trains again (weights change), 5 and 6 are skipped (2 in a row), 7 is the third in a row: the job
    stops with one NaN line (exit 1), saving nothing of 7; each skip is counted in jobs.jsonl."""
    import torch

    from orchestrator.runtime.training.loop import NONFINITE_GRAD_ENV

    run_dir = tmp_path / "skip"
    proc = run_cli(
        SMALL
        + [
            "parallelism=none",
            f"run.root={tmp_path}",
            "run.name=skip",
            "training.train_iters=10",
            "checkpoint.save_interval=1",
            "checkpoint.keep_last=null",
            "training.nan_policy=skip",
            "training.max_skipped_steps=2",
            "optimizer.lr_warmup_iters=0",
        ],
        cache=cache_dir,
        check=False,
        timeout=900,
        env={NONFINITE_GRAD_ENV: "3,5,6,7"},
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = _error_lines(proc.stderr)
    assert re.match(r"error: job \S+: non-finite gradient norm inf at iteration 7; ", line), line
    assert "Traceback" not in proc.stderr
    assert "training.nan_policy=skip: 2 step(s) skipped in a row already" in line, line
    records = {r["iteration"]: r for r in read_metrics(run_dir)}
    assert sorted(records) == [1, 2, 3, 4, 5, 6], sorted(records)
    assert [i for i, r in records.items() if r["skipped"]] == [3, 5, 6]
    assert all(math.isfinite(r["lm_loss"]) for r in records.values())
    assert records[3]["grad_norm"] == math.inf and math.isfinite(records[4]["grad_norm"])
    # the schedule does not advance on a skipped step: iteration 4 applies the lr iteration 3 would have
    assert records[4]["lr"] == records[3]["lr"] != records[2]["lr"], [records[i]["lr"] for i in (2, 3, 4)]
    skipped = [(r["iteration"], r["value"]) for r in history.read_records(run_dir) if r["event"] == "nan_skipped"]
    assert skipped == [(3, "inf"), (5, "inf"), (6, "inf")], skipped
    (a,) = attempts.attempts(history.read_records(run_dir))
    assert (a.cause, a.iteration) == ("nan", 7)
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [f"iter_{i:07d}" for i in range(1, 7)]
    state = {i: _checkpoint_tensors(ckpts / f"iter_{i:07d}", tmp_path) for i in (2, 3, 4, 6)}
    weights = [k for k in state[2] if not k.startswith("/optimizer.")]
    moments = [k for k in state[2] if k.startswith("/optimizer.state.exp_avg")]
    assert weights and moments, sorted(state[2])[:20]
    for keys in (weights, moments):
        assert all(torch.equal(state[2][k], state[3][k]) for k in keys)  # step 3 was not applied
        assert not all(torch.equal(state[3][k], state[4][k]) for k in keys)  # step 4 was
        assert all(torch.equal(state[4][k], state[6][k]) for k in keys)  # 5 and 6 were not either


def _iterations_done(run_dir: Path) -> int:
    try:
        return max((r["iteration"] for r in read_metrics(run_dir)), default=0)
    except (OSError, ValueError):  # not there yet, or a line being written
        return 0


@pytest.mark.slow
def test_sigstopped_rank_is_named_restarted_in_place_then_ends_the_job(tmp_path, cache_dir):
    """A 2-rank job that saves every iteration (a stop lands mostly inside or just before a save, whose allowance
    is checkpoint.save_timeout_s + 60 s = 660 s), cluster.max_restarts=1. SIGSTOP of rank 1 at iteration 3:
    within hang_timeout_s + 30 s the hang is declared naming rank 1 and, a restart being left, every rank
    restarts in place from the last checkpoint and trains on. SIGSTOP of the new rank 1: named again; the
    restarts are used up, so the launcher exits 1 naming rank 1; rank 0's stacks (its main thread inside a
    collective) are in stacks/, and no process of the job is left."""
    import psutil
    from conftest import agent_worker

    timeout_s = 10
    run_dir = tmp_path / "hang"
    args = SMALL + [
        "parallelism=none",
        "parallelism.data_parallel_size=2",
        f"run.root={tmp_path}",
        "run.name=hang",
        "training.train_iters=2000",
        f"training.hang_timeout_s={timeout_s}",
        "checkpoint.save_interval=1",
        "checkpoint.keep_last=2",
        "cluster.max_restarts=1",
    ]
    env = dict(os.environ, ORCHESTRATOR_CACHE=str(cache_dir), PYTHONUNBUFFERED="1")
    with open(tmp_path / "out.txt", "w") as out, open(tmp_path / "err.txt", "w") as err:
        cli = subprocess.Popen([sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env, stdout=out, stderr=err)
    victims, named_after = [], []

    def stop_rank_1_after(iteration: int) -> None:
        deadline = time.monotonic() + 300
        while _iterations_done(run_dir) < iteration or agent_worker(run_dir, 1) in victims:
            assert cli.poll() is None and time.monotonic() < deadline, (tmp_path / "err.txt").read_text()[-3000:]
            time.sleep(0.2)
        victims.append(agent_worker(run_dir, 1))
        victims[-1].send_signal(signal.SIGSTOP)

    def hangs() -> list:
        return [r for r in history.read_records(run_dir) if r["event"] == "hang"]

    try:
        stop_rank_1_after(3)
        t0 = time.monotonic()
        while not hangs():
            assert cli.poll() is None and time.monotonic() - t0 < timeout_s + 30, (tmp_path / "err.txt").read_text()[
                -3000:
            ]
            time.sleep(0.2)
        named_after.append(time.monotonic() - t0)
        resumed_at = [r for r in history.read_records(run_dir) if r["event"] == "attempt_started"]
        stop_rank_1_after(max(_iterations_done(run_dir), 3) + 2)  # the restarted ranks trained on
        t1 = time.monotonic()
        code = cli.wait(timeout=timeout_s + 90)
        named_after.append(round(time.monotonic() - t1, 1))
    finally:
        if cli.poll() is None:
            cli.kill()
        for victim in victims:
            try:
                victim.send_signal(signal.SIGCONT)
                victim.kill()
            except psutil.NoSuchProcess:
                pass
    stdout, stderr = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
    print(
        f"hang declared {named_after[0]:.1f} s after the first SIGSTOP (hang_timeout_s={timeout_s}); "
        f"launcher ended {named_after[1]} s after the second"
    )
    assert named_after[0] <= timeout_s + 30 and len(resumed_at) >= 1
    assert "restarting all ranks in place: restart 1 of cluster.max_restarts=1" in stdout + stderr, stdout[-3000:]
    assert [h["stalled"] for h in hangs()] == [[1], [1]], hangs()
    assert code == 1, (code, stderr[-3000:])
    (line,) = _error_lines(stderr)
    assert "hang: rank(s) 1 on host(s) " in line and "not responding" in line, line
    stacks = (run_dir / "stacks" / "rank_0.txt").read_text()
    assert "orchestrator/runtime/training/loop.py" in stacks  # the main thread's stack, not only the watchdog's
    row = _status(tmp_path)["hang"]
    assert (row["state"], row["job"]["cause"]) == ("failed", "hang"), row
    assert all(not psutil.pid_exists(v.pid) or psutil.Process(v.pid).status() == psutil.STATUS_ZOMBIE for v in victims)


@pytest.mark.slow
def test_a_rank_frozen_during_start_up_is_named_by_the_hang_watchdog(tmp_path, cache_dir):
    """issue 39: the hang watchdog covers the start-up, not only from the checkpoint load on. Rank 1 of a 2-rank job
    stops itself (a real SIGSTOP: guard.STARTUP_FREEZE_ENV) before its model build, while rank 0 waits for it in
    the rendezvous (the first collective). Within hang_timeout_s + 60 s rank 0 names it and the launcher exits 1;
    before, the watchdog started after the start-up and rank 0 waited training.distributed_timeout_minutes."""
    import psutil

    timeout_s = 6
    args = SMALL + [
        "parallelism=none",
        "parallelism.data_parallel_size=2",
        f"run.root={tmp_path}",
        "run.name=frozen",
        "training.train_iters=2",
        f"training.hang_timeout_s={timeout_s}",
    ]
    env = dict(os.environ, ORCHESTRATOR_CACHE=str(cache_dir), PYTHONUNBUFFERED="1")
    env[guard_mod.STARTUP_FREEZE_ENV] = "1"
    cli = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    seen = set()
    try:
        deadline = time.monotonic() + 240  # the start-up under load, then hang_timeout_s + polls
        while cli.poll() is None and time.monotonic() < deadline:
            try:
                seen.update(psutil.Process(cli.pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.5)
        assert cli.poll() is not None, "the launcher still waits on a rank frozen during the start-up"
    finally:
        if cli.poll() is None:
            cli.kill()
        stdout, stderr = (x.decode(errors="replace") for x in cli.communicate())
        for p in seen:  # the frozen rank, should the launcher have left it
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    assert cli.returncode == 1, (cli.returncode, stderr[-3000:])
    (line,) = _error_lines(stderr)
    assert "hang: rank(s) 1 on host(s) " in line and "after the start of the attempt (start)" in line, line
    assert "not responding" in line, line
    (hang,) = [r for r in history.read_records(tmp_path / "frozen") if r["event"] == "hang"]
    assert hang["stalled"] == [1], hang


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 16 MiB tmpfs (one gpt_tiny checkpoint with Adam state is ~11 MiB); unmounted afterwards."""
    yield from mounted_tmpfs(tmp_path / "tmpfs", 16)


@pytest.mark.slow
def test_disk_full_during_a_save_names_enospc_and_the_previous_checkpoint_resumes(small_tmpfs, cache_dir):
    run_dir = small_tmpfs / "full"
    common = SMALL + [
        "parallelism=none",
        f"run.root={small_tmpfs}",
        "run.name=full",
        "training.train_iters=4",
        "checkpoint.save_interval=2",
        "checkpoint.space_check=false",
    ]  # the ENOSPC fallback
    proc = run_cli(common, cache=cache_dir, check=False, timeout=900)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = _error_lines(proc.stderr)
    torn = run_dir / "checkpoints" / "iter_0000004"
    assert f"no space left on device (ENOSPC) saving checkpoint {torn}: " in line, line
    assert f"free of 16.0 MiB on {small_tmpfs}" in line and "latest complete checkpoint is iter_0000002" in line
    assert "Traceback" not in proc.stderr and not (torn / "manifest.json").exists()
    ended = attempts.attempts(history.read_records(str(run_dir)))[-1]  # the save's CheckpointException: recorded
    assert (
        ended.cause == "disk full" and ended.message == line[len(f"error: job {ended.job_id}: ") :].split(" (logs:")[0]
    )
    assert (_status(small_tmpfs)["full"]["state"], _status(small_tmpfs)["full"]["job"]["cause"]) == (
        "failed",
        "disk full",
    )
    subprocess.run(["mount", "-o", "remount,size=64M", str(small_tmpfs)], check=True)
    resumed = run_cli(common, cache=cache_dir, timeout=900)
    assert f"skipping torn checkpoint {torn}" in resumed.stdout + resumed.stderr
    assert f"resume from {run_dir / 'checkpoints' / 'iter_0000002'}" in resumed.stdout
    assert json.loads((torn / "manifest.json").read_text())["iteration"] == 4
    assert sorted(losses_by_iteration(run_dir)) == [1, 2, 3, 4]
