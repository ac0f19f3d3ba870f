"""Rendezvous, GPU binding and start-up agreement, decided from recorded job environments (no GPU).

The SLURM environments below are what a task sees under each binding style (variables as SLURM
22.05+ sets them; the 2-node one recorded on the dev cluster of launch/). The binding decision is a
pure function of the environment and torch.cuda.device_count(), so each style is checked without
a GPU. The last test starts ten local jobs' rendezvous at once through the runtime's own path.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch  # imported once here: the forked ranks of the concurrency test inherit it

from orchestrator.errors import BackendError, ConfigError
from orchestrator.runtime.rank.distributed import check_agreement, choose_binding
from orchestrator.runtime.rank.rendezvous import (
    LOCAL_PORT_VAR,
    SLURM_PORT_RANGE,
    first_host,
    local_rendezvous_env,
    rendezvous_from_env,
)

# ---- recorded environments --------------------------------------------------------------------------
# srun -N2 -n4 --ntasks-per-node=2 on the dev cluster (launch/), rank 3 (node2, local rank 1).
SLURM_2X2_RANK3 = {
    "SUBMITIT_EXECUTOR": "slurm",
    "SLURM_JOB_ID": "28",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_TASKS_PER_NODE": "2(x2)",
    "MASTER_ADDR": "10.0.0.99",  # what a submitting shell may have left: never used on SLURM
}
DEV_HOSTS = {"node1": "10.77.0.11", "node2": "10.77.0.12"}

# 8 tasks per 8-GPU node; each env is the one of local rank 5 (global rank 13 on the second node).
_GPU_TASK = {
    "SUBMITIT_EXECUTOR": "slurm",
    "SLURM_PROCID": "13",
    "SLURM_LOCALID": "5",
    "SLURM_NODEID": "1",
    "SLURM_NTASKS": "16",
    "SLURM_STEP_NODELIST": "gpu[07-08]",
    "SLURM_STEP_TASKS_PER_NODE": "8(x2)",
}
GPUS_PER_TASK_1 = {
    **_GPU_TASK,
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_STEP_GPUS": "5",  # --gpus-per-task=1
    "CUDA_VISIBLE_DEVICES": "5",
    "GPU_DEVICE_ORDINAL": "5",
}
GPUS_PER_TASK_1_CGROUP = {
    **_GPU_TASK,
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_STEP_GPUS": "3",  # ConstrainDevices=yes
    "CUDA_VISIBLE_DEVICES": "0",
}
WHOLE_NODE = {
    **_GPU_TASK,
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_STEP_GPUS": "0,1,2,3,4,5,6,7",  # --gpus-per-node=8
    "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}
BIND_CLOSEST = {
    **_GPU_TASK,
    "SLURM_GPUS_ON_NODE": "8",
    "SLURM_STEP_GPUS": "0,1,2,3,4,5,6,7",  # --gpu-bind=closest
    "CUDA_VISIBLE_DEVICES": "4,5,6,7",
}  # the socket's 4 GPUs
PARTIAL_NODE = {
    **_GPU_TASK,
    "SLURM_LOCALID": "2",
    "SLURM_GPUS_ON_NODE": "4",  # --gpus-per-node=4 of 8
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
    "SLURM_STEP_GPUS": "4,5,6,7",
    "CUDA_VISIBLE_DEVICES": "4,5,6,7",
}
NO_GPUS = {**_GPU_TASK, "CUDA_VISIBLE_DEVICES": ""}


def bind(env, device_count, want="auto", backend="auto", gpus_per_node=8):
    return choose_binding(
        env,
        want=want,
        backend=backend,
        device_count=device_count,
        gpus_per_node=gpus_per_node,
        local_rank=int(env.get("SLURM_LOCALID", 0)),
        rank=int(env.get("SLURM_PROCID", 0)),
    )


# ---- binding ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env, count, index, gpu",
    [
        (GPUS_PER_TASK_1, 1, 0, "5"),  # one GPU bound: it is ours, whatever its number
        (GPUS_PER_TASK_1_CGROUP, 1, 0, "0"),
        (WHOLE_NODE, 8, 5, "5"),  # all 8 visible: pick by local rank
        (PARTIAL_NODE, 4, 2, "6"),  # the job's 4 GPUs of the node: local rank 2 -> 3rd of them
        ({**BIND_CLOSEST, "CUDA_VISIBLE_DEVICES": "5"}, 1, 0, "5"),  # closest + one GPU per task
    ],
)
def test_binding_follows_slurm_and_never_rewrites_cuda_visible_devices(env, count, index, gpu):
    before = dict(env)
    b = bind(env, count)
    assert (b.device, b.index, b.torch_device, b.backend, b.gpu) == ("cuda", index, f"cuda:{index}", "nccl", gpu)
    assert b.visible == env["CUDA_VISIBLE_DEVICES"] and env == before


def test_a_task_that_sees_some_of_the_nodes_gpus_is_refused():
    with pytest.raises(BackendError) as err:
        bind(BIND_CLOSEST, 4)
    msg = str(err.value)
    assert "rank 13 (local rank 5)" in msg and "sees 4 of the node's 8 GPUs" in msg and "'4,5,6,7'" in msg
    assert "cluster.additional_parameters.gpu_bind=single:1" in msg


def test_more_tasks_than_gpus_on_a_node_is_refused():
    with pytest.raises(BackendError, match="fewer than its tasks"):
        bind({**PARTIAL_NODE, "SLURM_LOCALID": "5"}, 4)


def test_no_gpus_runs_on_cpu_with_gloo_unless_gpus_were_asked_for():
    b = bind(NO_GPUS, 0, gpus_per_node=0)
    assert (b.device, b.index, b.backend, b.torch_device) == ("cpu", None, "gloo", "cpu")
    assert bind(WHOLE_NODE, 8, want="cpu").device == "cpu"  # training.device=cpu on a GPU node
    with pytest.raises(BackendError, match="training.device=cuda but rank 13 .* sees no GPU"):
        bind(NO_GPUS, 0, want="cuda", gpus_per_node=0)
    with pytest.raises(BackendError, match="asked for GPUs but rank 13"):  # no silent CPU fallback
        bind({**NO_GPUS, "SLURM_GPUS_ON_NODE": "8"}, 0, gpus_per_node=0)
    with pytest.raises(ConfigError, match="distributed_backend=nccl needs GPUs"):
        bind(NO_GPUS, 0, backend="nccl", gpus_per_node=0)


# ---- agreement ------------------------------------------------------------------------------------------
def _rec(host, device, gpu=None, visible=None):
    return {
        "host": host,
        "device": device,
        "backend": "nccl" if device == "cuda" else "gloo",
        "gpu": gpu,
        "visible": visible,
    }


def test_ranks_that_differ_in_device_or_share_a_gpu_are_named():
    good = [_rec("a", "cuda", str(i)) for i in range(4)] + [_rec("b", "cuda", str(i)) for i in range(4)]
    check_agreement(good)
    mixed = good[:7] + [_rec("b", "cpu", visible="")]
    with pytest.raises(BackendError) as err:
        check_agreement(mixed)
    assert "cuda/nccl on rank(s) 0-6 (host a,b" in str(err.value) and "cpu/gloo on rank(s) 7 (host b" in str(err.value)
    shared = [_rec("a", "cuda", "0"), _rec("a", "cuda", "0"), _rec("b", "cuda", "0"), _rec("a", "cuda", "1")]
    with pytest.raises(BackendError, match="rank\\(s\\) 0-1 on a all use GPU 0"):
        check_agreement(shared)


# ---- rendezvous -----------------------------------------------------------------------------------------
def test_slurm_rendezvous_is_the_first_node_of_the_step_resolved():
    rv = rendezvous_from_env(SLURM_2X2_RANK3, resolve=DEV_HOSTS.__getitem__)
    assert (rv.rank, rv.world_size, rv.local_rank, rv.local_world_size) == (3, 4, 1, 2)
    assert rv.master_addr == "10.77.0.11" and rv.source == "slurm"
    low, high = SLURM_PORT_RANGE
    assert low <= rv.master_port < high  # below the ephemeral range, unlike submitit's 20000-60000
    requeued = rendezvous_from_env({**SLURM_2X2_RANK3, "SLURM_RESTART_COUNT": "1"}, resolve=DEV_HOSTS.__getitem__)
    assert requeued.master_port != rv.master_port  # a requeue does not race its predecessor's TIME_WAIT
    assert rendezvous_from_env({**SLURM_2X2_RANK3, "MASTER_PORT": "29555"}, resolve=str).master_port == 29555
    assert first_host("gpu[07-08],login3") == "gpu07"


def test_local_rendezvous_ignores_the_callers_master_addr_and_port():
    env = {
        "SUBMITIT_EXECUTOR": "local",
        "SUBMITIT_LOCAL_NTASKS": "4",
        "SUBMITIT_LOCAL_GLOBALID": "2",
        "SUBMITIT_LOCAL_LOCALID": "2",
        "SUBMITIT_LOCAL_JOB_ID": "4242",
        "MASTER_ADDR": "10.9.9.9",
        "MASTER_PORT": "29500",
        **local_rendezvous_env(),
    }
    rv = rendezvous_from_env(env)
    assert (rv.rank, rv.world_size, rv.master_addr) == (2, 4, "127.0.0.1")
    assert rv.master_port == int(env[LOCAL_PORT_VAR]) != 29500


def _local_rank(job: int, rank: int, port: int, busy_port: int, out) -> None:
    """One rank of local job ``job``: the environment submitit's LocalExecutor and our launcher give it,
    plus a caller's MASTER_ADDR/MASTER_PORT pointing at a port that is taken."""
    os.environ.update(
        {
            "SUBMITIT_EXECUTOR": "local",
            "SUBMITIT_LOCAL_NTASKS": "2",
            "SUBMITIT_LOCAL_GLOBALID": str(rank),
            "SUBMITIT_LOCAL_LOCALID": str(rank),
            "SUBMITIT_LOCAL_JOB_ID": str(1000 + job),
            LOCAL_PORT_VAR: str(port),
            "MASTER_ADDR": "10.255.255.1",
            "MASTER_PORT": str(busy_port),
        }
    )
    from orchestrator.config.schema import JobConfig
    from orchestrator.runtime.rank.distributed import init_distributed

    cfg = JobConfig()
    cfg.training.distributed_timeout_minutes = 2
    try:
        info = init_distributed(cfg)
        t = torch.ones(1) * (job + 1)
        torch.distributed.all_reduce(t)
        out.put((job, rank, float(t[0]), info.hosts, os.environ["MASTER_PORT"]))
        torch.distributed.destroy_process_group()
    except BaseException as exc:  # reported to the parent, which fails the test
        out.put((job, rank, repr(exc), None, None))


def test_ten_local_runs_started_at_once_all_find_a_free_port():
    with socket.socket() as busy, ThreadPoolExecutor(10) as pool:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)  # the caller's MASTER_PORT is in use: a run that took it would fail
        ports = [int(e[LOCAL_PORT_VAR]) for e in pool.map(lambda _: local_rendezvous_env(), range(10))]
        assert len(set(ports)) == 10
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_local_rank, args=(job, rank, ports[job], busy.getsockname()[1], out))
            for job in range(10)
            for rank in range(2)
        ]
        for p in procs:
            p.start()
        results = [out.get(timeout=240) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    for job, rank, value, hosts, port in results:
        assert value == 2.0 * (job + 1), (job, rank, value)  # each pair reduced with its own partner only
        assert hosts == (socket.gethostname(),) * 2 and int(port) == ports[job]


def test_gpu_path_modules_do_not_import_the_cpu_layer():
    """runtime/rank/cpu.py (megatron-core 0.16.x only) is for CPU jobs: what a GPU rank needs never imports it."""
    code = (
        "import sys; import orchestrator.runtime.rank.distributed, orchestrator.runtime.rank.model, "
        "orchestrator.runtime.training.checkpoint, orchestrator.runtime.rank.cp; "
        "assert 'orchestrator.runtime.rank.cpu' not in sys.modules, 'cpu layer imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_a_local_jobs_thread_count_is_the_users_when_set_else_cores_per_rank(monkeypatch):
    """OMP_NUM_THREADS of a local job's ranks: cluster.env's, else the launcher's own environment's (as
    torchrun keeps a user's), else cores // ranks."""
    from orchestrator.config.compose import compose_config
    from orchestrator.submit.executor import job_environment

    cfg = compose_config(["+experiment=gpt_pp2_dp2", "run.dir=."])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert job_environment(cfg, 4)["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 4))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert "OMP_NUM_THREADS" not in job_environment(cfg, 4)  # the ranks inherit the launcher's 3
    cfg.cluster.env["OMP_NUM_THREADS"] = 5
    assert job_environment(cfg, 4)["OMP_NUM_THREADS"] == "5"
