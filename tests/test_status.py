"""Job records and run status without SLURM: records, result files, metrics, CLI, scontrol parsing."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import cloudpickle
import pytest

from orchestrator.ckpt import history
from orchestrator.submit import jobs, status

ROOT = Path(__file__).resolve().parents[1]


def write_result(folder: Path, job_id: str, rank: int, outcome: str, value) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{job_id}_{rank}_result.pkl", "wb") as f:
        cloudpickle.dump((outcome, value), f)


def make_run(tmp_path: Path, name: str, job_id: str, cluster: str = "slurm", tasks: int = 2,
             metrics=((1, 5.5), (2, 5.25))) -> Path:
    run = tmp_path / "runs" / name
    folder = run / "submitit"
    folder.mkdir(parents=True)
    history.record_submission(run, job_id, cluster, {"stdout": str(folder / f"{job_id}_0_log.out"),
                                                    "stderr": str(folder / f"{job_id}_0_log.err")}, num_tasks=tasks)
    with open(run / "metrics.jsonl", "w") as f:
        for it, loss in metrics:
            f.write(json.dumps({"iteration": it, "lm_loss": loss, "lr": 1e-3}) + "\n")
        f.write(json.dumps({"event": "checkpoint", "iteration": metrics[-1][0]}) + "\n")
    return run


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


def test_completed_and_failed_from_result_files(tmp_path, monkeypatch):
    monkeypatch.setattr(status, "slurm_job_status", lambda job_id: None)  # SLURM forgot the jobs
    ok = make_run(tmp_path, "ok", "11")
    for r in range(2):
        write_result(ok / "submitit", "11", r, "success", {"status": "completed"})
    bad = make_run(tmp_path, "bad", "12", metrics=((1, 6.0),))
    write_result(bad / "submitit", "12", 0, "success", {})
    write_result(bad / "submitit", "12", 1, "error", "Traceback (most recent call last):\n  File x\nValueError: boom")
    s_ok, s_bad = status.run_status(ok), status.run_status(bad)
    assert (s_ok.state, s_ok.iteration, s_ok.lm_loss) == ("completed", 2, 5.25)
    assert s_bad.state == "failed" and s_bad.failure[0] == 1 and s_bad.failure[1][-1] == "ValueError: boom"


def test_failure_from_stderr_when_no_result(tmp_path, monkeypatch):
    monkeypatch.setattr(status, "slurm_job_status",
                        lambda job_id: jobs.JobStatus(state="failed", job_id=job_id, slurm_state="OUT_OF_MEMORY"))
    run = make_run(tmp_path, "oom", "13")
    (run / "submitit" / "13_0_log.err").write_text("fine\n")
    (run / "submitit" / "13_1_log.err").write_text("step 1\nslurmstepd: error: Detected 1 oom-kill event(s)\n")
    s = status.run_status(run)
    assert s.state == "failed" and s.job.slurm_state == "OUT_OF_MEMORY"
    assert s.failure == (1, ["step 1", "slurmstepd: error: Detected 1 oom-kill event(s)"])


def test_stopped_and_requeued_events(tmp_path, monkeypatch):
    run = make_run(tmp_path, "stop", "14")
    history.record_event(run, "requeued", job_id="14", restart_count=0)
    history.record_event(run, "stopped", job_id="14", restart_count=1)
    monkeypatch.setattr(status, "slurm_job_status",
                        lambda job_id: jobs.JobStatus(state="failed", job_id=job_id, slurm_state="FAILED", restarts=1))
    s = status.run_status(run)
    assert s.state == "stopped" and s.job.restarts == 1


def test_parse_scontrol_ignores_fake_fields_in_job_name():
    text = ('JobId=7 JobName=x JobState=COMPLETED Restarts=9 \n'
            '   UserId=root(0) GroupId=root(0) MCS_label=N/A\n'
            '   JobState=PENDING Reason=BeginTime Dependency=(null)\n'
            '   Requeue=1 Restarts=1 BatchFlag=1 Reboot=0 ExitCode=0:0\n')
    fields = jobs.parse_scontrol_job(text)
    assert fields["JobId"] == "7" and fields["JobState"] == "PENDING" and fields["Restarts"] == "1"


@pytest.mark.parametrize("raw,restarts,state", [
    ("PENDING", 0, "pending"), ("PENDING", 1, "requeued"), ("REQUEUED", 1, "requeued"), ("RUNNING", 0, "running"),
    ("COMPLETING", 0, "running"), ("COMPLETED", 0, "completed"), ("CANCELLED", 0, "cancelled"),
    ("TIMEOUT", 0, "failed"), ("NODE_FAIL", 2, "failed"),
])
def test_slurm_state_mapping(monkeypatch, raw, restarts, state):
    out = subprocess.CompletedProcess([], 0, stdout=f"JobId=5 JobName=j\n   JobState={raw} Reason=None\n"
                                                     f"   Restarts={restarts} ExitCode=0:0\n", stderr="")
    monkeypatch.setattr(status, "_run", lambda cmd: out)
    st = jobs.slurm_job_status("5")
    assert (st.state, st.restarts, st.slurm_state) == (state, restarts, raw)


def test_cli_lists_runs(tmp_path, monkeypatch):
    run = make_run(tmp_path, "local_ok", "999999", cluster="local")
    for r in range(2):
        write_result(run / "submitit", "999999", r, "success", {})
    out = subprocess.run([sys.executable, "-m", "orchestrator", "status", str(tmp_path / "runs")],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[:2]
    assert header.split() == ["RUN", "STATE", "JOB", "CLUSTER", "REQUEUES", "ITER", "LOSS"]
    assert row.split() == ["local_ok", "completed", "999999", "local", "0", "2", "5.2500"]


def test_status_module_is_torch_free():
    code = "import sys, orchestrator.submit.status; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def _sleep_then(value, seconds):
    import time

    time.sleep(seconds)
    return value


cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_wait_for_local_job(tmp_path):
    import submitit

    executor = submitit.LocalExecutor(folder=tmp_path / "submitit")
    executor.update_parameters(timeout_min=2, tasks_per_node=2)
    job = executor.submit(_sleep_then, 7, 0.5)
    seen = []
    st = status.wait_for_job(job, timeout_s=120, poll_s=0.2, on_change=lambda s: seen.append(s.state))
    assert st.state == "completed" and st.results == {0: "success", 1: "success"}, st
    assert seen[-1] == "completed"

    job = executor.submit(_sleep_then, 7, 30)
    with pytest.raises(status.SubmissionError, match="still running"):
        status.wait_for_job(job, timeout_s=1, poll_s=0.2)
    job.cancel()
    st = status.wait_for_job(job, timeout_s=60, poll_s=0.2)
    assert st.state == "failed"
