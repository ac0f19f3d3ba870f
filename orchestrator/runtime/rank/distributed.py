"""torch.distributed setup from the job environment (submitit local, SLURM, or torchrun-style).

Every rank calls :func:`init_distributed` first thing. Three decisions, each a pure function of
the environment so it can be tested on recorded SLURM environments without a GPU:

1. **Rendezvous** (:func:`rendezvous_from_env`): rank, world size, local rank and the store
   address. On SLURM, ``MASTER_ADDR`` is the first host of the step's node list resolved to its
   address (rank 0 runs there with the default block distribution); the port is ``MASTER_PORT``
   when ``cluster.env`` sets one (the sbatch script unsets the submitter's), otherwise derived from
   the job id and restart count below the Linux ephemeral range. A **local** run never takes
   ``MASTER_ADDR``/``MASTER_PORT`` from the caller's shell: the launcher reserves a free port
   (:func:`local_rendezvous_env`, bound then parked in TIME_WAIT so no other ``bind(0)`` gets it)
   and passes it as ``ORCHESTRATOR_MASTER_PORT``; the store listens on 127.0.0.1.
2. **Device binding** (:func:`choose_binding`): ``CUDA_VISIBLE_DEVICES`` is never written (SLURM's
   ``--gpus-per-task``/``--gpu-bind`` binding stands). A task that sees exactly one GPU uses
   ``cuda:0``; a task that sees all of the node's GPUs uses ``cuda:<local rank>``; anything else
   (e.g. ``--gpu-bind=closest`` showing 4 of 8) is an error, as is a job that asked for GPUs on a
   rank that sees none (no silent fallback to CPU + gloo).
3. **Agreement** (:func:`check_agreement`): before any process group exists, every rank publishes
   ``(host, device, backend, GPU, CUDA_VISIBLE_DEVICES)`` through the rendezvous store and reads
   everyone's (one exchange; a process group with mixed nccl/gloo members would hang instead of
   failing). Ranks that differ in device or backend, or two ranks on one GPU, stop the job with an
   error naming them. The exchange also gives every rank's host (:attr:`RankInfo.hosts`).

This module imports torch only inside the functions that need it (the launcher calls
:func:`local_rendezvous_env` without it).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from orchestrator.config.schema import JobConfig
from orchestrator.errors import BackendError, ConfigError
from orchestrator.runtime.rank.rendezvous import (  # noqa: F401 - re-exported: the rendezvous is part of init
    LOCAL_PORT_VAR,
    Rendezvous,
    local_rendezvous_env,
    rendezvous_from_env,
    reserve_local_port,
)

_BINDING_KEY = "orchestrator/binding/{rank}"


# ---- 1. rendezvous ------------------------------------------------------------------------------


# ---- 2. device binding ----------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceBinding:
    """This rank's device: ``cpu``, or ``cuda`` with the index among the GPUs the task sees."""

    device: str  # "cpu" or "cuda"
    index: Optional[int]
    backend: str  # "gloo" or "nccl"
    gpu: Optional[str]
    """The physical GPU as the environment names it (a CUDA_VISIBLE_DEVICES entry), None on CPU."""
    visible: Optional[str]
    """CUDA_VISIBLE_DEVICES as this task got it (None: unset)."""

    @property
    def torch_device(self) -> str:
        return f"cuda:{self.index}" if self.device == "cuda" else "cpu"


def _gpu_env(environ: Mapping[str, str]) -> str:
    keys = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_GPUS_ON_NODE")
    shown = [f"{k}={environ[k]!r}" for k in keys if k in environ]
    return ", ".join(shown) or "no CUDA_VISIBLE_DEVICES/SLURM GPU variables"


def choose_binding(
    environ: Mapping[str, str],
    *,
    want: str,
    backend: str,
    device_count: int,
    gpus_per_node: int = 0,
    local_rank: int = 0,
    rank: int = 0,
) -> DeviceBinding:
    """Pick this rank's device and backend; never changes ``CUDA_VISIBLE_DEVICES``.

    ``want``: ``training.device`` (auto/cpu/cuda); ``backend``: ``parallelism.distributed_backend``
    (auto/nccl/gloo); ``device_count``: ``torch.cuda.device_count()`` of this task;
    ``gpus_per_node``: ``cluster.gpus_per_node`` (the node's GPU count when SLURM does not say,
    ``SLURM_GPUS_ON_NODE``). Raises :class:`BackendError` (no usable GPU, ambiguous binding) or
    :class:`ConfigError` (nccl without GPUs).
    """
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    node_gpus = int(environ.get("SLURM_GPUS_ON_NODE") or 0) or gpus_per_node or device_count
    who = f"rank {rank} (local rank {local_rank}) on {socket.gethostname()}"
    if device_count == 0 and want == "cuda":
        raise BackendError(
            f"training.device=cuda but {who} sees no GPU ({_gpu_env(environ)}); "
            "fix: request GPUs (cluster.gpus_per_node) or set training.device=cpu"
        )
    if device_count == 0 and want == "auto" and (gpus_per_node or int(environ.get("SLURM_GPUS_ON_NODE") or 0)):
        raise BackendError(
            f"the job asked for GPUs but {who} sees none ({_gpu_env(environ)}); it would run on "
            "CPU + gloo while other ranks use GPUs; fix: check the GPU binding "
            "(cluster.additional_parameters.gpu_bind), or set cluster.gpus_per_node=0 and "
            "training.device=cpu"
        )
    if want == "cpu" or device_count == 0:
        if backend == "nccl":
            raise ConfigError(
                "parallelism.distributed_backend=nccl needs GPUs but this job runs on CPU; "
                "fix: parallelism.distributed_backend=gloo or auto"
            )
        return DeviceBinding("cpu", None, "gloo", None, visible)
    if device_count == 1:
        index = 0
    elif device_count == node_gpus and local_rank < device_count:
        index = local_rank
    elif device_count == node_gpus:
        raise BackendError(
            f"{who} has no GPU of its own: this node's {device_count} GPUs are fewer than its "
            f"tasks; fix: cluster.tasks_per_node <= cluster.gpus_per_node ({_gpu_env(environ)})"
        )
    else:
        raise BackendError(
            f"{who} sees {device_count} of the node's {node_gpus} GPUs ({_gpu_env(environ)}) and "
            "cannot tell which is its own; fix: bind one GPU per task "
            "(cluster.additional_parameters.gpu_bind=single:1) or let every task see all of the "
            "node's GPUs (no gpu_bind)"
        )
    entries = [e.strip() for e in visible.split(",")] if visible else []
    gpu = entries[index] if index < len(entries) else str(index)
    return DeviceBinding("cuda", index, "nccl" if backend == "auto" else backend, gpu, visible)


# ---- 3. agreement -------------------------------------------------------------------------------------
def _ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0-2,5``."""
    out: List[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0]
    for r in ordered[1:] + [None]:  # type: ignore[list-item]
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def check_agreement(records: Sequence[Mapping[str, object]]) -> None:
    """Raise :class:`BackendError` unless every rank has the same device and backend, each on its own GPU.

    ``records[r]``: rank r's ``{"host", "device", "backend", "gpu", "visible"}``. The message names
    the ranks (and hosts) of every group.
    """
    groups: Dict[Tuple[object, object], List[int]] = {}
    for rank, rec in enumerate(records):
        groups.setdefault((rec["device"], rec["backend"]), []).append(rank)
    if len(groups) > 1:
        parts = []
        for (device, backend), ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
            hosts = sorted({str(records[r]["host"]) for r in ranks})
            visible = sorted({str(records[r].get("visible")) for r in ranks})
            parts.append(
                f"{device}/{backend} on rank(s) {_ranks(ranks)} (host {','.join(hosts)}; "
                f"CUDA_VISIBLE_DEVICES {'|'.join(visible)})"
            )
        raise BackendError(
            "ranks disagree on device/backend: "
            + "; ".join(parts)
            + "; fix: give every task a GPU (check cluster.gpus_per_node / cluster.additional_parameters.gpu_bind) or run all on CPU"
        )
    shared: Dict[Tuple[object, object], List[int]] = {}
    for rank, rec in enumerate(records):
        if rec["device"] == "cuda":
            shared.setdefault((rec["host"], rec["gpu"]), []).append(rank)
    clashes = [f"rank(s) {_ranks(r)} on {host} all use GPU {gpu}" for (host, gpu), r in shared.items() if len(r) > 1]
    if clashes:
        raise BackendError(
            "several ranks bound to one GPU: "
            + "; ".join(clashes)
            + "; fix: one task per GPU (cluster.tasks_per_node = cluster.gpus_per_node)"
        )


# ---- init -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"
    hosts: Tuple[str, ...] = ()
    """Every rank's host name, by rank (recorded as ``hosts`` in the summary and manifest)."""
    gpu: Optional[str] = None


def _exchange(store, rv: Rendezvous, record: Dict[str, object], timeout: datetime.timedelta) -> List[dict]:
    """Publish this rank's record in ``store`` and read every rank's (the one start-up exchange)."""
    store.set(_BINDING_KEY.format(rank=rv.rank), json.dumps(record))
    keys = [_BINDING_KEY.format(rank=r) for r in range(rv.world_size)]
    store.wait(keys, timeout)
    return [json.loads(store.get(key)) for key in keys]


def open_store(rv: Rendezvous, timeout: datetime.timedelta):
    """The TCP rendezvous store (rank 0 hosts it, or torchrun's agent). Raises :class:`BackendError` naming address and port."""
    import torch.distributed as dist

    # torchrun's agent hosts the store already (TORCHELASTIC_USE_AGENT_STORE): every rank is its client
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    try:
        return dist.TCPStore(
            rv.master_addr, rv.master_port, rv.world_size, rv.rank == 0 and not agent, timeout, wait_for_workers=False
        )
    except (RuntimeError, OSError) as exc:
        raise BackendError(
            f"rank {rv.rank}: rendezvous store {rv.master_addr}:{rv.master_port} "
            f"({rv.source}) failed: {str(exc).splitlines()[0] if str(exc) else exc}"
        ) from None


def init_distributed(cfg: JobConfig) -> RankInfo:
    """Rendezvous, bind the device, agree with every rank, start the default process group.

    Raises :class:`BackendError` / :class:`ConfigError` (binding, disagreement, store failure).
    """
    import torch

    rv = rendezvous_from_env(os.environ)
    os.environ.update(rv.as_env())
    device_count = torch.cuda.device_count() if cfg.training.device != "cpu" else 0
    binding = choose_binding(
        os.environ,
        want=cfg.training.device,
        backend=cfg.parallelism.distributed_backend,
        device_count=device_count,
        gpus_per_node=cfg.cluster.gpus_per_node,
        local_rank=rv.local_rank,
        rank=rv.rank,
    )
    if binding.device == "cuda":
        torch.cuda.set_device(binding.index)
    timeout = datetime.timedelta(minutes=cfg.training.distributed_timeout_minutes)
    if torch.distributed.is_initialized() and _STARTED.get("info") is not None:  # a warm rank's next trial
        return _STARTED["info"]
    if torch.distributed.is_initialized():  # a caller (test, notebook) made the group already
        return RankInfo(
            rv.rank,
            rv.world_size,
            rv.local_rank,
            binding.device,
            binding.backend,
            (socket.gethostname(),) * rv.world_size,
            binding.gpu,
        )
    store = open_store(rv, timeout)
    gpu_id = binding.gpu
    if binding.device == "cuda":
        uuid = getattr(torch.cuda.get_device_properties(binding.index), "uuid", None)
        gpu_id = str(uuid) if uuid is not None else binding.gpu
    record = {
        "host": socket.gethostname(),
        "device": binding.device,
        "backend": binding.backend,
        "gpu": gpu_id,
        "visible": binding.visible,
    }
    records = _exchange(store, rv, record, timeout)
    check_agreement(records)
    torch.distributed.init_process_group(
        backend=binding.backend, store=store, rank=rv.rank, world_size=rv.world_size, timeout=timeout
    )
    _STARTED["info"] = RankInfo(
        rv.rank,
        rv.world_size,
        rv.local_rank,
        binding.device,
        binding.backend,
        tuple(str(r["host"]) for r in records),
        binding.gpu,
    )
    return _STARTED["info"]


_STARTED: Dict[str, Optional[RankInfo]] = {"info": None}
"""The RankInfo of the process group this process started (a warm rank's later trials reuse it)."""


def teardown_parallel_state() -> None:
    """Destroy megatron's model-parallel state (its groups, global buffers, RNG tracker), keep the
    default process group: between the trials of a warm rank."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def shutdown() -> None:
    """Destroy megatron's model-parallel groups and the default process group (idempotent)."""
    import torch

    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:  # pragma: no cover - best effort at teardown
        pass
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    _STARTED["info"] = None
