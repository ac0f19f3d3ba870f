"""Against a real SLURM: the dev cluster of launch/ (`launch/slurm-dev-up.sh`, as root).

Skipped, with the reason, when `sinfo` does not answer. Every wait is bounded. Jobs are submitted
exactly as `cluster=slurm` submits them — :func:`orchestrator.submit.executor.make_executor` with
the `slurm_dev` preset, the submission recorded as the launcher records it — and waited on with the
launcher's own :func:`orchestrator.submit.executor.wait`; or through the CLI itself.

End-to-end training on SLURM (losses equal to the local run, timeout -> save -> requeue -> resume
with the production wait reporting the requeue, a preemption, requeues used up, a NaN never
requeued, scancel while the launcher waits) lives in test_slurm_train.py; here: 4 ranks really run,
the rendered script is the submitted one and an injection attempt creates no file; two detached
submissions to one run directory: one trains, the other exits naming the holder of the run lock.
(The USR2 stand-in job that was here repeated test_slurm_train's real time-limit run.)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List

import cloudpickle
import pytest
from conftest import REPO, read_metrics, slurm_unavailable_reason, submit_like_launcher, wait_until

from orchestrator.ckpt import history
from orchestrator.ckpt.lock import RunLock, decision_path
from orchestrator.config.checks import validate
from orchestrator.config.compose import compose_config
from orchestrator.config.schema import JobConfig
from orchestrator.data.prepare import prepare
from orchestrator.errors import RunLockedError
from orchestrator.submit import executor, jobs, sbatch, status

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # job functions below travel by value

_REASON = slurm_unavailable_reason()
pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(bool(_REASON), reason=f"SLURM dev cluster not reachable: {_REASON}"),
]


def dev_cfg(run_dir: Path, **cluster) -> JobConfig:
    cfg = compose_config(["+experiment=gpt_pp2_dp2", "cluster=slurm_dev", f"run.dir={run_dir}"])
    for key, value in cluster.items():
        setattr(cfg.cluster, key, value)
    return cfg


def submit(cfg: JobConfig, fn, *args, world_size: int = 4):
    return submit_like_launcher(cfg, fn, *args, world_size=world_size)


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
    return {
        "rank": dist_env.rank,
        "world": dist_env.world_size,
        "sum": int(t.item()),
        "slurm_procid": os.environ["SLURM_PROCID"],
        "host": socket.gethostname(),
        "nccl_ib_disable": os.environ.get("NCCL_IB_DISABLE"),
        "job_name": os.environ.get("SLURM_JOB_NAME"),
    }


# ---- tests ---------------------------------------------------------------------------------------


def test_four_ranks_run_the_rendered_script_and_injection_creates_no_file(tmp_path, monkeypatch):
    """One job: 4 ranks join one gloo group; the script sbatch ran is render_sbatch's; a run name and
    an env value built to break out of the script arrive as data (sbatch runs in ``cwd``: no file)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    run = tmp_path / "run"
    cfg = dev_cfg(run)
    cfg.cluster.env = {**cfg.cluster.env, "EVIL": "$(touch pwned_env)`touch pwned_tick`"}
    cfg.run.name = 'x"; touch pwned_name; echo "'
    job = submit(cfg, _rank_report)
    results = executor.wait(job, cfg, 4)
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert {r["world"] for r in results} == {4} and {r["sum"] for r in results} == {6}
    assert [r["slurm_procid"] for r in results] == ["0", "1", "2", "3"]
    assert {r["nccl_ib_disable"] for r in results} == {cfg.cluster.env["NCCL_IB_DISABLE"]}  # cluster.env arrived
    assert {r["job_name"] for r in results} == {cfg.run.name}  # the name arrived intact, as data
    assert Path(job.paths.submission_file).read_text() == sbatch.render_sbatch(cfg, 4, run / "submitit")
    assert sorted(p.name for p in cwd.iterdir()) == []
    st = status.run_status(run)
    assert st.state == "completed" and st.job.job_id == str(job.job_id)


def _cli(args: List[str], cache: Path) -> subprocess.Popen:
    env = dict(os.environ, ORCHESTRATOR_CACHE=str(cache), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_detached_submissions_one_trains_the_other_names_the_holder(tmp_path, cache_dir):
    """Issue 9's acceptance: two `cluster.wait=false` submissions to one run directory. The first is
    submitted held (`--hold`): pending in the queue, it holds no lock yet, and a second launch of the same
    command is refused up front (one line naming the queued job, exit 2, nothing recorded). A second job that
    slipped past the launcher (a genuine race: submitted here past its check) is released together with the
    first, so both start while neither sees a lock: the jobs' rank 0s decide. One trains; the other stops on
    every rank with the error naming the holder (its host, pid and SLURM job id), trains nothing, and is not
    the run's status."""
    run = tmp_path / "run"
    args = [
        "parallelism.data_parallel_size=2",
        "cluster=slurm_dev",
        "cluster.tasks_per_node=2",
        "cluster.wait=false",
        "+cluster.additional_parameters.hold=true",
        f"run.dir={run}",
        "data.stdlib_max_mb=1",
        "training.train_iters=2",
        "training.eval_iters=0",
        "training.log_interval=1",
    ]
    first = _cli(args, cache_dir)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, out + err
    ids = [out.split("submitted job ")[1].split()[0]]
    records = (run / "jobs.jsonl").read_bytes()
    second = _cli(args, cache_dir)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 2 and "submitted job" not in out, out + err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: run.dir: {run} is in use by another run (job {ids[0]}, queued in SLURM"), line
    assert (run / "jobs.jsonl").read_bytes() == records  # nothing recorded, nothing queued
    cfg = compose_config([*args, f"data.cache_dir={cache_dir}"])
    ids.append(str(executor.submit(cfg, validate(cfg), prepare(cfg.data)).job_id))  # slipped past the check
    subprocess.run(["scontrol", "release", *ids], check=True, timeout=30)
    # the first rank 0 to take the lock is held (SIGSTOP; the dev nodes share this machine's pids) until the
    # other job's rank 0 has decided: under load the winner's 2 iterations had ended and freed the lock before
    # the other's rank 0 had imported torch, and both trained (a CI run beside two busy processes)
    holder = wait_until(lambda: RunLock(run).holder(), 300, "a job's lock", poll_s=0.02)
    (other,) = [j for j in ids if j != str(holder["job_id"])]
    os.kill(holder["pid"], signal.SIGSTOP)
    try:
        wait_until(lambda: decision_path(run, other).exists(), 300, f"job {other}'s decision on the lock")
    finally:
        os.kill(holder["pid"], signal.SIGCONT)
    outcomes = {}
    for job_id in ids:
        job = executor.make_executor(cfg, 2).job_class(run / "submitit", job_id, tasks=(0, 1))
        try:
            outcomes[job_id] = executor.wait(job, cfg, 2)
        except RunLockedError as exc:  # a user error (exit 2), not a failed job
            outcomes[job_id] = exc
    refused = [j for j, o in outcomes.items() if isinstance(o, RunLockedError)]
    assert len(refused) == 1, outcomes
    (loser,) = refused
    (winner,) = [j for j in ids if j != loser]
    holder = {r["job_id"]: r for r in history.read_records(run) if r["event"] == "lock_refused"}[loser]["holder"]
    assert holder["job_id"] == winner
    message = str(outcomes[loser])
    assert "is in use by another run" in message and f"SLURM job {winner}" in message
    assert f"pid {holder['pid']} on host {holder['host']}" in message
    assert any(s.get("status") == "completed" and s.get("iteration") == 2 for s in outcomes[winner])
    assert [r["iteration"] for r in read_metrics(run)] == [1, 2]  # trained once, by the winner
    log = (run / "submitit" / f"{loser}_0_log.err").read_text()
    assert "RunLockedError" in log and f"SLURM job {winner}" in log
    # Its other rank followed rank 0's decision (or srun's --kill-on-bad-exit ended it first): no success.
    assert "success" not in jobs.result_outcomes(run / "submitit", loser).values()
    assert not (run / RunLock.NAME).exists()  # released when the winner finished
    assert json.loads((run / "submitit" / f"{loser}_lock.json").read_text())["ok"] is False
    st = status.run_status(run)  # the loser is neither the run's latest job nor its failure
    assert (st.state, st.job.job_id, [a["job_id"] for a in st.attempts]) == ("completed", winner, [winner]), st


def test_a_job_the_partition_cannot_hold_is_one_line_before_anything_is_queued(tmp_path):
    """More nodes than the partition has (sbatch would accept it and it would pend forever: PartitionNodeLimit),
    spares included, and a partition that does not exist: one `error:` line from sinfo's answer, exit 2, no
    data prepared, no run directory, nothing queued."""
    nodes = int(
        subprocess.run(
            ["sinfo", "-h", "-p", "dev", "-o", "%D"], capture_output=True, text=True, timeout=30
        ).stdout.split()[0]
    )
    cases = [
        (
            [f"cluster.nodes={nodes + 1}", "cluster.tasks_per_node=1"],
            f"error: cluster.nodes={nodes + 1}: partition dev has {nodes} node(s) (sinfo), so the job would wait forever",
        ),
        (
            [f"cluster.nodes={nodes}", "cluster.tasks_per_node=1", "cluster.max_restarts=1", "cluster.spare_nodes=1"],
            f"error: cluster.nodes={nodes} + cluster.spare_nodes=1: partition dev has {nodes} node(s)",
        ),
        (
            ["cluster.nodes=1", "cluster.tasks_per_node=1", "cluster.partition=nosuch"],
            "error: cluster.partition=nosuch: no such partition (sinfo lists dev",
        ),
    ]

    def job_ids() -> set:  # the queue's jobs (not their TIME column, which runs on for any job already there)
        return set(
            subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout.split()
        )

    queued = job_ids()
    for extra, expected in cases:
        args = [
            "+experiment=gpt_pp2_dp2",
            "parallelism=none",
            "parallelism.data_parallel_size=null",
            "training.micro_batch_size=1",
            "training.global_batch_size=240",  # any DP up to 6 divides it
            "cluster=slurm_dev",
            *extra,
            f"run.root={tmp_path}",
            "run.name=big",
        ]
        proc = subprocess.run(
            [sys.executable, "-m", "orchestrator", *args], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(expected), proc.stderr
        assert "preparing data" not in proc.stdout and not (tmp_path / "big").exists()
    assert job_ids() <= queued  # nothing queued by the refused submissions
