"""Against a real SLURM: the single-node dev cluster of launch/ (`launch/slurm-dev-up.sh`, as root).

Skipped, with the reason, when `sinfo` does not answer. Every wait is bounded. Jobs use the
`slurm_dev` preset (partition dev, 4 tasks on one node) through submitit, as the product does.

End-to-end training on SLURM (losses equal to the local run, timeout -> save -> requeue -> resume)
lives with the runtime's tests; here: 4 ranks really run, the rendered script is the submitted one,
scancel is noticed within 60 s, an injection attempt creates no file, and the requeue contract of
orchestrator.runtime.preempt works with submitit's result files.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import cloudpickle
import pytest

from conftest import slurm_unavailable_reason
from orchestrator.ckpt import history
from orchestrator.submit import jobs, sbatch, status
from orchestrator.spec.schema import JobConfig, register_configs, to_job_config

ROOT = Path(__file__).resolve().parents[1]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # job functions below travel by value




_REASON = slurm_unavailable_reason()
pytestmark = [pytest.mark.slurm,
              pytest.mark.skipif(bool(_REASON), reason=f"SLURM dev cluster not reachable: {_REASON}")]


def dev_cfg(run_dir: Path, **cluster) -> JobConfig:
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = to_job_config(compose("config", overrides=["+experiment=gpt_pp2_dp2", "cluster=slurm_dev",
                                                         f"run.dir={run_dir}"]))
    for key, value in cluster.items():
        setattr(cfg.cluster, key, value)
    return cfg


def submit(cfg: JobConfig, folder: Path, fn, *args):
    import submitit

    executor = submitit.AutoExecutor(folder=folder, cluster="slurm", **sbatch.executor_init_kwargs(cfg))
    executor.update_parameters(**sbatch.executor_parameters(cfg, 4))
    job = executor.submit(fn, *args)
    history.record_submission(cfg.run.dir, job.job_id, cfg.cluster,
                             {"stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr)}, num_tasks=4)
    return job


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def scancel(*args: str) -> None:
    subprocess.run(["scancel", *args], check=True, timeout=30)


# ---- job functions (run in the SLURM tasks) ------------------------------------------------------

def _rank_report():
    """Every rank joins a gloo group (so all 4 ran at the same time) and reports its environment."""
    import os
    import socket

    import submitit
    import torch
    import torch.distributed as dist

    dist_env = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    dist.init_process_group("gloo")
    t = torch.tensor([dist_env.rank], dtype=torch.int64)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"rank": dist_env.rank, "world": dist_env.world_size, "sum": int(t.item()),
            "slurm_procid": os.environ["SLURM_PROCID"], "host": socket.gethostname(),
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "job_name": os.environ.get("SLURM_JOB_NAME")}


def _sleep(seconds: float):
    import time

    time.sleep(seconds)
    return "slept"


def _train_like(state_dir: str, total: int, step_s: float, max_requeues: int, run_dir: str,
                resume_step_s: float = 0.01):
    """A stand-in for the training loop with the preempt contract: resume from the "checkpoint"
    (a file), step with a collective, stop on request: save, requeue or exit."""
    import os
    import time
    from pathlib import Path

    import submitit
    import torch
    import torch.distributed as dist

    from orchestrator.runtime.preempt import StopRequest, restart_count

    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stop = StopRequest(max_requeues=max_requeues, run_dir=run_dir).install()
    ckpt = Path(state_dir) / "checkpoint"
    start = int(ckpt.read_text()) if ckpt.exists() else 0
    iteration = start
    if restart_count():
        step_s = resume_step_s  # the resumed run finishes quickly (before another early signal)
    while iteration < total:
        t = torch.ones(1)
        dist.all_reduce(t)
        time.sleep(step_s)
        iteration += 1
        if rank == 0:
            (Path(state_dir) / f"progress_{restart_count()}").write_text(str(iteration))
        if stop.requested():
            dist.barrier()
            if rank == 0:
                tmp = ckpt.with_suffix(".tmp")
                tmp.write_text(str(iteration))
                os.replace(tmp, ckpt)
            stop.requeue_or_exit("test stop")
    dist.destroy_process_group()
    return {"rank": rank, "start": start, "end": iteration, "restarts": restart_count(),
            "signal": stop.signal_name}


# ---- tests ---------------------------------------------------------------------------------------

def test_four_ranks_run_and_script_is_the_rendered_one(tmp_path):
    cfg = dev_cfg(tmp_path / "run")
    folder = tmp_path / "run" / "submitit"
    job = submit(cfg, folder, _rank_report)
    st = status.wait_for_job(job, timeout_s=180, poll_s=1)
    assert st.state == "completed", (st, job.stderr())
    results = job.results()
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert {r["world"] for r in results} == {4} and {r["sum"] for r in results} == {6}
    assert [r["slurm_procid"] for r in results] == ["0", "1", "2", "3"]
    assert {r["gloo_ifname"] for r in results} == {"lo"}  # cluster.env reached every rank
    assert Path(job.paths.submission_file).read_text() == sbatch.render_sbatch(cfg, 4, folder)
    run = status.run_status(tmp_path / "run")
    assert run.state == "completed" and run.job.job_id == job.job_id


def test_scancel_is_reported_within_60_s(tmp_path):
    cfg = dev_cfg(tmp_path / "run")
    job = submit(cfg, tmp_path / "run" / "submitit", _sleep, 600)
    wait_until(lambda: jobs.slurm_job_status(job.job_id).state == "running", 120, "the job to run")
    time.sleep(2)
    t0 = time.monotonic()
    scancel(job.job_id)
    st = status.wait_for_job(job, timeout_s=60, poll_s=1)
    elapsed = time.monotonic() - t0
    assert st.state == "cancelled" and elapsed < 60, (st, elapsed)
    assert status.run_status(tmp_path / "run").state == "cancelled"


def test_injection_in_job_name_creates_no_file(tmp_path):
    marker = tmp_path / "markers"
    marker.mkdir()
    cfg = dev_cfg(tmp_path / "run", env={"GLOO_SOCKET_IFNAME": "lo", "EVIL": f"$(touch {marker}/pwned2)"})
    cfg.run.name = f'x"; touch {marker}/pwned; echo "'
    job = submit(cfg, tmp_path / "run" / "submitit", _rank_report)
    st = status.wait_for_job(job, timeout_s=180, poll_s=1)
    assert st.state == "completed", (st, job.stderr())
    assert list(marker.iterdir()) == []
    assert {r["job_name"] for r in job.results()} == {cfg.run.name}  # the name arrived intact, as data


def test_usr2_saves_requeues_and_resumes(tmp_path):
    """The preemption path of the contract: USR2 to every task (as `--signal` does near the time
    limit) -> collective stop -> save -> scontrol requeue -> SLURM restarts the job -> it resumes
    from the saved iteration and completes; no result file in between."""
    state = tmp_path / "state"
    state.mkdir()
    run = tmp_path / "run"
    cfg = dev_cfg(run)
    job = submit(cfg, run / "submitit", _train_like, str(state), 60, 0.2, 1, str(run))
    wait_until(lambda: (state / "progress_0").exists() and int((state / "progress_0").read_text() or 0) >= 5,
               120, "5 iterations of the first run")
    scancel("--signal=USR2", job.job_id)
    seen = []
    st = status.wait_for_job(job, timeout_s=240, poll_s=1, on_change=lambda s: seen.append(s.state))
    assert st.state == "completed", (st, seen, job.stderr())
    assert "requeued" in seen and st.restarts == 1
    results = job.results()
    saved = int((state / "progress_0").read_text())
    assert {r["start"] for r in results} == {saved} and {r["end"] for r in results} == {60}
    assert {r["restarts"] for r in results} == {1}
    events = [r for r in history.read_records(run) if r["event"] == "requeued"]
    assert len(events) == 1 and events[0]["signal"] == "SIGUSR2" and events[0]["restart_count"] == 0
    log = Path(job.paths.stderr).read_text()
    assert "requeued SLURM job" in log and "requeue 1 of at most 1" in log


def test_cancelled_job_is_not_requeued(tmp_path):
    """scancel sends SIGTERM, which also means "stop"; scontrol would requeue even a cancelled
    job, so the contract must check the state first."""
    state = tmp_path / "state"
    state.mkdir()
    run = tmp_path / "run"
    cfg = dev_cfg(run)
    job = submit(cfg, run / "submitit", _train_like, str(state), 10_000, 0.2, 3, str(run))
    wait_until(lambda: (state / "progress_0").exists(), 120, "the job to run")
    scancel(job.job_id)
    st = status.wait_for_job(job, timeout_s=60, poll_s=1)
    assert st.state == "cancelled"
    time.sleep(5)
    again = jobs.slurm_job_status(job.job_id)
    assert again.state == "cancelled" and again.restarts == 0, again
    assert not list((run / "submitit").glob("*_result.pkl"))
