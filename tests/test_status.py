"""Job records and run status: records, result files, metrics, the status CLI, scontrol's output.

No mocks: `status` reads the files a real 2-iteration run wrote; the other local jobs are real
submitit jobs submitted by the production executor and waited on with its production wait; SLURM
states come from recorded ``scontrol show job`` text for the states a test cannot provoke cheaply
(TIMEOUT, NODE_FAIL ...). Real SLURM runs' status (completed after requeues, cancelled, a killed
rank, preempted, nan) is asserted by tests/test_slurm_train.py on the runs it makes anyway.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import cloudpickle
import pytest
from conftest import losses_by_iteration, run_cli, submit_like_launcher

from orchestrator.ckpt import history
from orchestrator.config.compose import compose_config
from orchestrator.errors import JobFailedError
from orchestrator.submit import executor, jobs, status

ROOT = Path(__file__).resolve().parents[1]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # job functions below travel by value


def cfg_for(run: Path, *cluster: str, tasks: int = 2):
    return compose_config([f"parallelism.data_parallel_size={tasks}", f"run.dir={run}", "data=mock", *cluster])


# ---- job functions (run in the tasks) ------------------------------------------------------------
def _rank() -> int:
    import submitit

    return submitit.JobEnvironment().global_rank


def _ok():
    return {"status": "completed", "rank": _rank()}


def _raise_on(rank: int):
    if _rank() == rank:
        raise ValueError("boom")
    return {"rank": _rank()}


def _killed_on(rank: int):
    import os
    import signal
    import sys
    import time

    if _rank() == rank:
        print("step 1", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
    time.sleep(10)  # the other rank is still working when its peer dies
    return {"rank": _rank()}


def _killed_then_peers_fail(rank: int, marker: str):
    """Rank ``rank`` dies of SIGKILL; its peers then fail as gloo's broken collectives do (after the death,
    whatever the machine's load: they wait for the marker the dying rank writes)."""
    import time
    from pathlib import Path

    if _rank() != rank:
        deadline = time.time() + 120
        while not Path(marker).exists() and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(1)
        raise ConnectionResetError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer")
    Path(marker).touch()
    _killed_on(rank)


def _stop(run_dir: str):
    from orchestrator.runtime.faults.preempt import StopRequest

    stop = StopRequest(max_requeues=0, run_dir=run_dir).install()
    stop.trigger("test")
    if stop.requested():
        stop.requeue_or_exit("test stop")  # a local run cannot be requeued: Stopped, no result file
    return "not stopped"


def _stop_at_time_limit(run_dir: str):
    """Wait for the controller's time-limit USR2, then stop as a rank does after its save."""
    import time

    from orchestrator.ckpt import history as h
    from orchestrator.runtime.faults.preempt import StopRequest

    stop = StopRequest(max_requeues=0, run_dir=run_dir).install()
    h.record_attempt_started(run_dir, str(_submitit_job_id()), 0, iteration=0)
    while not stop.local_flag:
        time.sleep(0.1)
    stop.requeue_or_exit("signal", iteration=7)  # local: Stopped, no result file


def _submitit_job_id():
    import submitit

    return submitit.JobEnvironment().job_id


# ---- records -------------------------------------------------------------------------------------
def test_records_append_atomically_and_concurrently(tmp_path):
    run = tmp_path / "run"
    threads = [threading.Thread(target=history.record_event, args=(run, "tick"), kwargs={"n": i}) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = history.read_records(run)
    assert sorted(r["n"] for r in records) == list(range(20))
    assert not [p for p in run.iterdir() if p.name.startswith(".jobs.jsonl.")]  # no temp files left


def test_record_submission_fields(tmp_path):
    rec = history.record_submission(tmp_path, 42, "slurm", {"stdout": "/x/sub/42_0_log.out"}, num_tasks=4)
    assert rec["job_id"] == "42" and rec["folder"] == "/x/sub" and rec["num_tasks"] == 4
    assert history.read_records(tmp_path) == [rec]


# ---- local jobs ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def local_runs(tmp_path_factory, cache_dir):
    """Real local jobs: a 2-iteration gpt_tiny run through the CLI (its own metrics.jsonl and
    jobs.jsonl), and a job through the production executor and wait that has a rank raise."""
    root = tmp_path_factory.mktemp("runs")
    ok, bad = root / "local_ok", root / "local_bad"
    run_cli(
        [
            "data.stdlib_max_mb=2",
            "training.train_iters=2",
            "training.eval_iters=0",
            "training.log_interval=1",
            f"run.root={root}",
            "run.name=local_ok",
        ],
        cache=cache_dir,
    )
    job_ok = next(r["job_id"] for r in history.read_records(ok) if r["event"] == "submitted")
    cfg_bad = cfg_for(bad)
    job_bad = submit_like_launcher(cfg_bad, _raise_on, 1, world_size=2)
    with pytest.raises(JobFailedError, match="boom"):
        executor.wait(job_bad, cfg_bad, 2)
    return root, {"ok": (ok, str(job_ok)), "bad": (bad, str(job_bad.job_id))}


@pytest.mark.slow
def test_completed_and_failed_local_jobs(local_runs):
    _, runs = local_runs
    s_ok, s_bad = status.run_status(runs["ok"][0]), status.run_status(runs["bad"][0])
    loss = losses_by_iteration(runs["ok"][0])[2]  # what the run wrote
    assert (s_ok.state, s_ok.job.job_id, s_ok.iteration, s_ok.lm_loss) == ("completed", runs["ok"][1], 2, loss)
    assert s_ok.job.results == {0: "success"} and s_ok.job.cause == "completed"
    assert s_bad.state == "failed" and s_bad.job.message == "rank 1 failed: ValueError: boom", s_bad


@pytest.mark.slow
def test_cli_lists_runs(local_runs):
    root, runs = local_runs
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator", "status", str(root)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["RUN", "STATE"])
    assert header.split() == ["RUN", "STATE", "JOB", "CLUSTER", "REQUEUES", "ITER", "LOSS", "TOK/S", "ETA"]
    row = next(line for line in lines if line.split()[:1] == ["local_ok"])
    loss = losses_by_iteration(runs["ok"][0])[2]
    cells = row.split()
    assert cells[:7] == ["local_ok", "completed", runs["ok"][1], "local", "0", "2/2", f"{loss:.4f}"], cells
    assert float(cells[7].replace(",", "")) > 0 and cells[8] == "-", cells  # tokens/s measured; no ETA once done
    assert next(line for line in lines if line.split()[:1] == ["local_bad"]).split()[1] == "failed"
    js = subprocess.run(
        [sys.executable, "-m", "orchestrator", "status", str(root), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert js.returncode == 0, js.stderr
    rows = {Path(d["run_dir"]).name: d for d in map(json.loads, js.stdout.splitlines())}
    assert (rows["local_ok"]["state"], rows["local_ok"]["iteration"], rows["local_ok"]["lm_loss"]) == (
        "completed",
        2,
        loss,
    )
    assert [(a["cause"], a["iteration"]) for a in rows["local_ok"]["attempts"]] == [("completed", 2)]


def test_local_rank_killed_without_a_result(tmp_path):
    run = tmp_path / "run"
    cfg = cfg_for(run)
    job = submit_like_launcher(cfg, _killed_on, 1, world_size=2)
    with pytest.raises(JobFailedError, match=r"rank\(s\) \[1\] died without a result"):
        executor.wait(job, cfg, 2)  # noticed while rank 0 still works, which is then stopped
    assert status.run_status(run).state == "failed"
    assert jobs.result_outcomes(run / "submitit", job.job_id) == {}


def test_status_names_the_killed_rank_not_its_peers(tmp_path):
    """Rank 1 SIGKILLed, ranks 0 and 2 then fail with "Connection reset by peer" before the launcher sees
    the death: the launcher's line, the recorded end and ``status`` name rank 1 first."""
    run = tmp_path / "run"
    cfg = cfg_for(run, tasks=3)
    job = submit_like_launcher(cfg, _killed_then_peers_fail, 1, str(tmp_path / "killed"), world_size=3)
    with pytest.raises(JobFailedError, match=r"rank\(s\) \[1\] died without a result .*; then rank [02] failed"):
        executor.wait(job, cfg, 3)
    st = status.run_status(run)
    assert st.state == "failed" and st.job.cause == "crashed", st
    assert st.job.message.startswith("rank(s) [1] died without a result"), st.job.message
    assert st.job.describe() == ("failed (crashed) - rank(s) [1] died without a result (killed? out of memory?)"), (
        st.job.describe()
    )


def test_a_peer_that_recorded_its_broken_connection_first_is_amended_by_the_killed_rank(tmp_path):
    """A surviving rank's guard records the crash within milliseconds ("Connection closed by peer"), before the
    launcher sees rank 1 died by a signal: the launcher's account amends it (cause first, the peer's error
    after), once; a NaN (or any end not a crash) is never amended."""
    from orchestrator.ckpt import attempts, history
    from orchestrator.errors import ranks_died
    from orchestrator.submit import outcome

    run = tmp_path / "run"
    run.mkdir()
    peer = "rank 0 (vm) crashed at iteration 7: RuntimeError: Connection closed by peer [127.0.0.1]:7049"
    for job_id, cause in (("5", "crashed"), ("6", "nan")):
        history.record_attempt_started(str(run), job_id, 0, host="vm", iteration=0, world_size=2, train_iters=9)
        history.record_attempt_ended(str(run), job_id, 0, cause, iteration=7, message=peer)
        for _ in range(2):
            outcome.record_end(str(run), job_id, "crashed", ranks_died([1], "exit by signal 9, SIGKILL"))
    ended = {a.job_id: a for a in attempts.attempts(history.read_records(str(run)))}
    assert (ended["5"].cause, ended["5"].message) == (
        "crashed",
        "rank(s) [1] died without a result (exit by signal "
        f"9, SIGKILL: killed? out of memory?); its peers' errors followed: {peer}",
    )
    assert (ended["6"].cause, ended["6"].message) == ("nan", peer)
    assert sum(1 for r in history.read_records(str(run)) if r.get("amends")) == 1


def test_a_job_that_stopped_at_its_time_limit_says_so_plainly(tmp_path):
    """A job stopped by its time limit after a save (on SLURM: with its requeues used up) writes no result:
    the launcher's line says what stopped it and the checkpoint a rerun resumes from, not "ended without
    results" and a log tail. A local job's limit: the controller's USR2 ``signal_delay_s`` before it."""
    run = tmp_path / "run"
    (run / "checkpoints" / "iter_0000007").mkdir(parents=True)
    (run / "checkpoints" / "iter_0000007" / "manifest.json").write_text("{}")
    cfg = cfg_for(run, "cluster.timeout_min=1", "cluster.signal_delay_s=55", tasks=1)
    job = submit_like_launcher(cfg, _stop_at_time_limit, str(run), world_size=1)
    with pytest.raises(JobFailedError) as err:
        executor.wait(job, cfg, 1)
    line = str(err.value)
    assert line.startswith(
        f"job {job.job_id}: reached its time limit (cluster.timeout_min=1) and stopped after "
        f"saving iteration 7; local runs are not requeued; rerun the same command to resume from "
        f"{run}/checkpoints/iter_0000007 (logs: "
    ), line
    assert "\n" not in line and "without results" not in line


@pytest.mark.parametrize(
    "used, max_num_timeout, says",
    [
        (
            0,
            3,
            "not requeued (0 of cluster.max_num_timeout=3 used): job 89 is COMPLETING (cancelled, or its time "
            "limit passed before this stop was done: start-up and save took longer than cluster.signal_delay_s), "
            "not requeued;",
        ),
        (1, 1, "its requeues are used up (1 of cluster.max_num_timeout=1);"),
    ],
)
def test_a_slurm_time_limit_stop_names_why_it_was_not_requeued(tmp_path, used, max_num_timeout, says):
    """The records a SLURM job writes when its time limit stopped it and it did not requeue: with requeues
    left, the job's own reason (seen on the dev cluster: the ranks' start-up outlasted the 2-minute limit,
    so the limit passed during the save and the job was COMPLETING); with none left, "used up". (The line
    said "used up (0 of 3)" for both.)"""
    from orchestrator.submit.outcome import stopped_itself

    run = tmp_path / "run"
    (run / "checkpoints" / "iter_0000002").mkdir(parents=True)
    (run / "checkpoints" / "iter_0000002" / "manifest.json").write_text("{}")
    cfg = cfg_for(run, "cluster=slurm_dev", f"cluster.max_num_timeout={max_num_timeout}")
    for attempt in range(used):
        history.record_attempt_started(run, "89", attempt, iteration=0)
        history.record_attempt_ended(run, "89", attempt, "timeout", iteration=1, requeued=True)
    history.record_attempt_started(run, "89", used, iteration=0)
    detail = (
        "job 89 is COMPLETING (cancelled, or its time limit passed before this stop was done: start-up and "
        "save took longer than cluster.signal_delay_s), not requeued"
        if used < max_num_timeout
        else f"requeues used up: {used} timeout/preemption requeue(s) >= cluster.max_num_timeout={max_num_timeout}"
    )
    history.record_event(run, "stopped", job_id="89", reason="signal (SIGUSR2)", detail=detail)
    history.record_attempt_ended(run, "89", used, "timeout", iteration=2, requeued=False)
    line = stopped_itself(str(run), "89", cfg.cluster)
    assert line == (
        f"reached its time limit (cluster.timeout_min={cfg.cluster.timeout_min}) and stopped after "
        f"saving iteration 2; {says} rerun the same command to resume from {run}/checkpoints/iter_0000002"
    )


def test_local_stop_is_reported_as_stopped(tmp_path):
    run = tmp_path / "run"
    cfg = cfg_for(run, tasks=1)
    submit_like_launcher(cfg, _stop, str(run), world_size=1)
    deadline = time.monotonic() + 90
    while status.run_status(run).state != "stopped" and time.monotonic() < deadline:
        time.sleep(0.5)  # the local controller exits some seconds after its task
    assert [r["event"] for r in history.read_records(run) if r["event"] == "stopped"] == ["stopped"]
    st = status.run_status(run)
    assert st.state == "stopped" and st.job.results == {}, st  # no result file: it did not finish


# ---- scontrol output -------------------------------------------------------------------------------
def test_parse_scontrol_ignores_fake_fields_in_job_name():
    text = (
        "JobId=7 JobName=x JobState=COMPLETED Restarts=9 \n"
        "   UserId=root(0) GroupId=root(0) MCS_label=N/A\n"
        "   JobState=PENDING Reason=BeginTime Dependency=(null)\n"
        "   Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0\n"
    )
    fields = jobs.parse_scontrol_job(text)
    assert fields["JobId"] == "7" and fields["JobState"] == "PENDING" and fields["Restarts"] == "1"


@pytest.mark.parametrize(
    "raw,restarts,state",
    [
        ("PENDING", 0, "pending"),
        ("PENDING", 1, "requeued"),
        ("REQUEUED", 1, "requeued"),
        ("RUNNING", 0, "running"),
        ("COMPLETING", 0, "running"),
        ("COMPLETED", 0, "completed"),
        ("CANCELLED", 0, "cancelled"),
        ("TIMEOUT", 0, "failed"),
        ("NODE_FAIL", 2, "failed"),
    ],
)
def test_slurm_state_mapping(raw, restarts, state):
    text = (
        f"JobId=5 JobName=j\n   JobState={raw} Reason=None Dependency=(null)\n"
        f"   Requeue=1 Restarts={restarts} BatchFlag=1 Reboot=0 ExitCode=0:0\n"
    )
    st = jobs.status_from_scontrol(text, "5")
    assert (st.state, st.restarts, st.slurm_state, st.reason) == (state, restarts, raw, None)


def test_status_module_is_torch_free():
    code = "import sys, orchestrator.submit.status; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_a_job_refused_the_lock_is_neither_an_attempt_nor_the_runs_job_even_under_a_recycled_id():
    """One reader (attempts.own_records) for history and status: a local job 5 completed, a later job that got
    the recycled id 5 was refused the lock (another run held the directory), and job 6 is running. The refused
    job is no attempt, and the run's latest job is 6; the completed job 5 stays."""
    from orchestrator.ckpt.attempts import attempts, own_records

    records = [
        {"event": "submitted", "job_id": "5", "time": 1.0},
        {"event": "attempt_started", "job_id": "5", "attempt": 0, "time": 2.0, "iteration": 0},
        {"event": "attempt_ended", "job_id": "5", "attempt": 0, "time": 3.0, "cause": "completed", "iteration": 4},
        {"event": "submitted", "job_id": "6", "time": 4.0},
        {"event": "submitted", "job_id": "5", "time": 5.0},
        {"event": "lock_refused", "job_id": "5", "attempt": 0, "time": 6.0, "holder": {"pid": 1}},
    ]
    kept = own_records(records)
    assert [(r["event"], r["job_id"]) for r in kept] == [
        ("submitted", "5"),
        ("attempt_started", "5"),
        ("attempt_ended", "5"),
        ("submitted", "6"),
    ]
    assert [(a.job_id, a.cause) for a in attempts(records)] == [("5", "completed"), ("6", None)]


def test_a_double_signal_to_a_local_launcher_is_reported_as_stopped_at_once_unsaved(tmp_path):
    """A deliberate double signal to the launcher of a local job (the first asks the ranks' stop, the second
    ends the job at once): the launcher records the end its wait records (WaitSignals.end_words) and ``status``
    says the job was stopped at once by the second signal, unsaved -- it said ``failed (interrupted) - the local
    job ended without result files``, while ``stop --now``, just as unsaved, says ``stopped (by request)``."""
    import os
    import signal

    from orchestrator.submit import outcome
    from orchestrator.submit.signals import WaitSignals

    run = tmp_path / "run"
    run.mkdir()
    cfg = cfg_for(run, tasks=1)
    gone = subprocess.Popen(["true"])
    gone.wait()
    job_id = str(gone.pid)  # a local job's id is its controller's pid: this one has ended
    history.record_attempt_started(str(run), job_id, 0, iteration=0)
    with WaitSignals(cfg, job_id) as signals:
        os.kill(os.getpid(), signal.SIGHUP)  # the first: the ranks are asked to save and stop (stop.json)
        assert (run / "stop.json").exists()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # the second: the wait ends the job at once
            time.sleep(5)
    outcome.record_end(str(run), job_id, "interrupted", signals.end_words())  # as the wait records it
    st = jobs.job_status(job_id, "local", run / "submitit", 1, history.read_records(str(run)))
    assert st.describe() == (
        "stopped (interrupted) - stopped at once by a second signal to the launcher (SIGINT), unsaved"
    ), st.describe()
