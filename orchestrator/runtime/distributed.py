"""torch.distributed setup from the job environment (submitit local or SLURM).

Every rank calls :func:`init_distributed` first thing. It exports MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK from submitit's job environment
(``TorchDistributedEnvironment``; ``overwrite=True`` because sbatch exports the
submitter's environment, which may already hold MASTER_ADDR), binds one GPU per
task on CUDA (submitit's trap: without it every task lands on GPU 0), and
starts the process group: nccl on GPU, gloo on CPU, unless
``parallelism.distributed_backend`` says otherwise.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from orchestrator.spec.schema import JobConfig
from orchestrator.errors import BackendError, ConfigError


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    device: str  # "cpu" or "cuda"
    backend: str  # "gloo" or "nccl"


def resolve_device(cfg: JobConfig) -> str:
    """``training.device`` resolved against what this process sees: "cuda" or "cpu"."""
    want = cfg.training.device
    has_cuda = torch.cuda.is_available()
    if want == "cuda" and not has_cuda:
        raise BackendError(
            "training.device=cuda but this job sees no GPU (torch.cuda.is_available() is False); "
            "fix: request GPUs (cluster.gpus_per_node) or set training.device=cpu"
        )
    if want == "auto":
        return "cuda" if has_cuda else "cpu"
    return want


def _from_job_environment(bind_gpu: bool) -> None:
    """Export torch.distributed env vars from submitit's job environment, when inside a submitit job."""
    if "SUBMITIT_EXECUTOR" not in os.environ and "SLURM_JOB_ID" not in os.environ and "SUBMITIT_LOCAL_JOB_ID" not in os.environ:
        # Plain `torchrun`/single process: take the environment as it is.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        return
    import submitit

    submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=bind_gpu, overwrite=True)


def init_distributed(cfg: JobConfig) -> RankInfo:
    """Start the default process group for this rank; returns who we are.

    Raises :class:`ConfigError` if the job's task count differs from the layout's world size.
    """
    # Decide GPU binding before CUDA is initialised (CUDA_VISIBLE_DEVICES is read once).
    bind_gpu = cfg.training.device != "cpu" and cfg.cluster.gpus_per_node > 0
    _from_job_environment(bind_gpu)
    device = resolve_device(cfg)
    backend = cfg.parallelism.distributed_backend
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl" and device != "cuda":
        raise ConfigError("parallelism.distributed_backend=nccl needs GPUs; fix: distributed_backend=gloo or auto")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device == "cuda":
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=cfg.training.distributed_timeout_minutes),
        )
    return RankInfo(rank=rank, world_size=world, local_rank=local_rank, device=device, backend=backend)


def shutdown() -> None:
    """Destroy megatron's model-parallel groups and the default process group (idempotent)."""
    try:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    except Exception:  # pragma: no cover - best effort at teardown
        pass
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
