"""The timeout/preemption contract without SLURM: flag, collective decision, exit without a result.

The SLURM half (scontrol requeue, restart count, requeue limits per cause, a preemption, cancelled
jobs not requeued) runs on the dev cluster: tests/test_slurm_train.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.runtime.faults import preempt
from orchestrator.runtime.faults.preempt import REQUEUE_EXIT_CODE, STOP_EXIT_CODE, Requeued, Stopped, StopRequest

ROOT = Path(__file__).resolve().parents[1]

# Job functions below run in submitit tasks, which cannot import this test module: ship them by value.
import cloudpickle  # noqa: E402

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def clean_env(monkeypatch):
    for key in ("SUBMITIT_EXECUTOR", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(key, raising=False)


def test_signal_only_sets_a_flag_and_local_run_stops(clean_env, tmp_path):
    before = signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)
    stop = StopRequest(max_requeues=3, run_dir=str(tmp_path)).install()
    try:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.local_flag and stop.requested() and stop.signal_name == "SIGUSR2"
        with pytest.raises(Stopped) as info:
            stop.requeue_or_exit("time limit")
        assert info.value.code == STOP_EXIT_CODE
        assert "local run" in info.value.reason
        assert not isinstance(info.value, Exception)  # submitit's `except Exception` must not catch it
    finally:
        stop.uninstall()
    assert (signal.getsignal(signal.SIGUSR2), signal.getsignal(signal.SIGTERM)) == before
    from orchestrator.submit.status import read_records

    events = read_records(tmp_path)
    assert [e["event"] for e in events] == ["stopped", "attempt_ended"] and events[0]["signal"] == "SIGUSR2"
    # a local time-limit stop is not requeued: the attempt ends "timeout", not requeued
    assert (events[1]["cause"], events[1]["requeued"]) == ("timeout", False)


def test_sigterm_is_caught_too(clean_env):
    stop = StopRequest().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() and stop.signal_name == "SIGTERM"
    finally:
        stop.uninstall()


def test_exit_codes_and_types():
    assert issubclass(Requeued, SystemExit) and issubclass(Stopped, SystemExit)
    assert Requeued("x").code == REQUEUE_EXIT_CODE != Stopped("x").code == STOP_EXIT_CODE
    # submitit's LocalExecutor restarts tasks that exit with 144; ours must differ
    from submitit.local.local import LOCAL_REQUEUE_RETURN_CODE

    assert LOCAL_REQUEUE_RETURN_CODE not in (REQUEUE_EXIT_CODE, STOP_EXIT_CODE)


def test_a_local_job_inside_an_allocation_is_not_slurms(monkeypatch):
    """A local (submitit LocalExecutor) job started inside a SLURM allocation is never requeued with
    ``scontrol``. (The SLURM decisions themselves — requeue while RUNNING, requeues used up, a
    cancelled job not requeued, failures against cluster.max_failures, a preemption — run on the dev
    cluster: tests/test_slurm_train.py.)"""
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    assert preempt.on_slurm()
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "local")
    assert not preempt.on_slurm()
    assert preempt.requeue_for_failure("/nonexistent", 5) == (False, "not requeued (a local run)")


_WORKER = textwrap.dedent("""
    import os, signal, sys, torch, torch.distributed as dist
    from orchestrator.runtime.faults.preempt import StopRequest
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method=sys.argv[2], rank=rank, world_size=2)
    stop = StopRequest(max_requeues=3).install()
    for it in range(1, 50):
        if rank == 1 and it == 3:
            os.kill(os.getpid(), signal.SIGUSR2)   # only rank 1 gets the signal
        t = torch.ones(1); dist.all_reduce(t)       # "training"
        if stop.requested():
            print(f"rank {rank} stops after iteration {it} local={stop.signal_name}", flush=True)
            try:
                stop.requeue_or_exit("test")
            finally:  # outside submitit nothing tears gloo down: a group alive at exit can abort (-6)
                dist.barrier(); dist.destroy_process_group()
    print("never stopped", flush=True)
""")


def _two_ranks(tmp_path: Path, source: str, *args: str):
    """Run ``source`` as 2 gloo ranks (argv: rank, init method, ``args``); (return codes, outputs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(source)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), f"tcp://127.0.0.1:{port}", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    return [p.returncode for p in procs], outs


def test_all_ranks_stop_at_the_same_iteration(clean_env, tmp_path):
    codes, outs = _two_ranks(tmp_path, _WORKER)
    assert codes == [STOP_EXIT_CODE, STOP_EXIT_CODE], outs
    assert "rank 0 stops after iteration 3 local=peer" in outs[0]
    assert "rank 1 stops after iteration 3 local=SIGUSR2" in outs[1]


_POLL_WORKER = textwrap.dedent("""
    import os, signal, sys, time, torch, torch.distributed as dist
    from orchestrator.runtime.faults.preempt import StopRequest
    from orchestrator.runtime.training.stop_poll import StopPoll
    rank, log_every, step_s = int(sys.argv[1]), int(sys.argv[3]), float(sys.argv[4])
    dist.init_process_group("gloo", init_method=sys.argv[2], rank=rank, world_size=2)
    stop = StopRequest(max_requeues=3).install()
    StopPoll.POLL_S = 2.0                       # the rule at a 2 s pace (shipped: 5 s) keeps the test short
    poll, reduces = StopPoll(stop), 0
    for it in range(1, 40):
        if rank == 1 and it == 3:
            os.kill(os.getpid(), signal.SIGUSR2)   # only rank 1 gets the signal
        time.sleep(step_s)                          # "training"
        if log_every and it % log_every == 0:      # the loop's logging all-reduce carries the poll
            total = torch.tensor([0.0, 0.0, *poll.share()], dtype=torch.float64)
            dist.all_reduce(total); reduces += 1
            stopping = poll.merged(total[2].item(), total[3].item() / 2)
        else:
            stopping = poll.requested()
        if stopping:
            print(f"rank {rank} stops after iteration {it} local={stop.signal_name} every={poll.every}", flush=True)
            break
    poll.close(); dist.barrier(); dist.destroy_process_group()
""")


@pytest.mark.parametrize(
    "log_every,step_s,first,last",
    [
        (5, 0.0, 5, 5),  # short steps: the poll rides on the logging all-reduce of iteration 5, no poll of its own
        # no logging all-reduce, steps of >= 0.5 s: a poll at most every 2 s / 0.5 s = 4 iterations; the first
        # after the signal carries it, the next reads it: after iteration 4 at the earliest, 3 + 2 x 4 at the latest
        (0, 0.5, 4, 11),
    ],
)
def test_the_stop_poll_agrees_on_one_iteration_on_the_logging_all_reduce_or_within_two_polls(
    clean_env, tmp_path, log_every, step_s, first, last
):
    """Two gloo ranks, rank 1 signalled at iteration 3: both stop after the same iteration, within the bounds
    of the poll's rule (runtime/training/stop_poll.py), whichever path carried the poll."""
    import re

    codes, outs = _two_ranks(tmp_path, _POLL_WORKER, str(log_every), str(step_s))
    assert codes == [0, 0], outs
    found = [re.search(r"rank (\d) stops after iteration (\d+) local=(\S+)", out) for out in outs]
    assert all(found), outs
    (at,) = {int(m.group(2)) for m in found}  # the same iteration on both ranks
    assert first <= at <= last and [m.group(3) for m in found] == ["peer", "SIGUSR2"], outs


def _job_gets_usr2():
    """Runs inside a submitit task: our handler must replace submitit's (which would requeue)."""
    import os
    import signal
    import time

    from orchestrator.runtime.faults.preempt import StopRequest

    stop = StopRequest().install()
    os.kill(os.getpid(), signal.SIGUSR2)
    for _ in range(100):
        if stop.local_flag:
            break
        time.sleep(0.01)
    return ("ok", stop.signal_name, os.environ.get("SUBMITIT_EXECUTOR"))


def _job_stops():
    from orchestrator.runtime.faults.preempt import StopRequest

    stop = StopRequest()
    stop.trigger("test")
    stop.requeue_or_exit("test")


def test_submitit_handler_replaced_and_stop_leaves_no_result(clean_env, tmp_path):
    import submitit

    executor = submitit.LocalExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(timeout_min=2)
    job = executor.submit(_job_gets_usr2)
    assert job.result() == ("ok", "SIGUSR2", "local")

    job = executor.submit(_job_stops)
    job.wait()  # LocalJob: bounded by the process' life
    assert not Path(job.paths.result_pickle).exists()  # neither "success" nor "error"
    assert "stopped" in Path(job.paths.stderr).read_text()


# ---- a dead launcher (runtime/faults/launcher.py) ---------------------------------------------------
def test_a_dead_launcher_asks_the_graceful_stop_then_ends_the_process(clean_env):
    """A real process as the launcher: alive while it runs; killed and not yet reaped (a zombie), it reads
    as dead; the watch asks the stop (naming its pid), then, the process still running after the grace,
    ends it with the stop's exit status. Another host's launcher is never judged from here."""
    import threading
    import time

    import psutil

    from orchestrator.runtime.faults import launcher

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    owner = {**launcher.launcher_identity(), "pid": proc.pid, "pid_created": psutil.Process(proc.pid).create_time()}
    asked, ended = [], threading.Event()
    codes = []
    try:
        assert launcher.launcher_alive(owner)
        assert launcher.launcher_alive({**owner, "host": "elsewhere"})
        assert not launcher.launcher_alive({**owner, "pid_created": owner["pid_created"] - 60})  # pid reused since
        watch = launcher.watch_launcher(
            owner, asked.append, poll_s=0.05, grace_s=0.5, exit=lambda code: (codes.append(code), ended.set())
        )
        time.sleep(0.3)
        assert asked == [] and watch.is_alive()
        proc.kill()  # not reaped: a zombie until proc.wait()
        killed = time.monotonic()
        assert ended.wait(5), "the watch never ended the process"
        assert asked == [f"the launcher (pid {proc.pid}) died"] and codes == [STOP_EXIT_CODE]
        assert 0.5 <= time.monotonic() - killed < 3
    finally:
        proc.kill()
        proc.wait()
    assert launcher.watch_launcher(None, asked.append) is None  # a detached job watches nothing


def test_a_stop_asked_before_the_request_is_installed_is_kept(clean_env):
    """The launcher may die while the job still starts up: the stop asked then is the first thing the
    StopRequest installed later knows (the first iteration boundary saves and stops)."""
    try:
        preempt.request_stop("the launcher (pid 1) died")
        stop = StopRequest().install()
        assert stop.local_flag and stop.signal_name == "the launcher (pid 1) died"
        stop.uninstall()
    finally:
        preempt._REQUESTED.clear()


# ---- a stop asked on purpose (ckpt/stop.py: `orchestrator stop`, a signal to the waiting launcher) ------
def test_a_stop_request_reaches_only_its_job_and_is_never_requeued(clean_env, monkeypatch, tmp_path):
    """The stop watch of rank 0 ignores a request for another job, asks the graceful stop once the
    request names its job (who asked, the cause), and a stop asked so is never requeued, even on SLURM
    with requeues left: the attempt ends with the request's cause."""
    import threading

    from orchestrator.ckpt import stop as stop_file
    from orchestrator.runtime.faults import launcher

    asked, seen = [], threading.Event()
    stop_file.request(tmp_path, "other", by="orchestrator stop", cause=stop_file.BY_REQUEST)
    launcher.watch_stop(str(tmp_path), "7", lambda who, cause: (asked.append((who, cause)), seen.set()), poll_s=0.05)
    assert not seen.wait(0.4) and asked == []
    stop_file.request(tmp_path, "7", by="orchestrator stop", cause=stop_file.BY_REQUEST)
    assert seen.wait(5) and asked == [("orchestrator stop", "by request")]
    try:
        preempt.request_stop(*asked[0])
        request = StopRequest(max_requeues=3).install()
        monkeypatch.setenv("SLURM_JOB_ID", "7")  # a SLURM job with every requeue left
        assert request.local_flag and request.asked_cause == "by request"
        assert request._decide() == (False, "asked on purpose: not requeued")
        request.uninstall()
    finally:
        preempt._REQUESTED.clear()
    stop_file.clear(tmp_path)
    assert stop_file.read(tmp_path) is None
