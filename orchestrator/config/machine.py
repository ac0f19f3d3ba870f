"""What this machine can run, for jobs that run on it (``cluster.kind=local``): its GPUs, torch-free.

A config that asks for GPUs (``cluster.gpus_per_node`` > 0, or ``training.device=cuda``) on a
machine without them used to start, import megatron-core and fail in rank 0 ("the job asked for
GPUs but rank 0 sees none"). :func:`check_local_gpus` refuses it in validate, in one line naming
the overrides that run it on this machine's CPU. A plan or a dry run describes the job, not this
machine (a GPU job is planned on a laptop), so they are not refused. SLURM jobs run elsewhere:
their nodes' GPUs are the scheduler's business; and inside a job (``SUBMITIT_EXECUTOR`` set) a
task sees only the GPUs bound to it, which the runtime checks.
"""

from __future__ import annotations

import glob
import os
from typing import List, Optional

from orchestrator.errors import ConfigError

GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")
"""NVIDIA GPUs (one file each), the ROCm driver, WSL's GPU bridge: where a GPU shows itself."""


def local_gpu_count() -> Optional[int]:
    """GPUs a job started here could use: 0 when none shows itself, the NVIDIA device count (less
    when ``CUDA_VISIBLE_DEVICES`` hides some), None when there are GPUs of unknown count (ROCm, WSL)."""
    nvidia = glob.glob(GPU_DEVICE_FILES[0])
    other = any(os.path.exists(p) for p in GPU_DEVICE_FILES[1:])
    if not nvidia:
        return None if other else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(nvidia)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    ids = ids[:ids.index("-1")] if "-1" in ids else ids  # CUDA stops at the first invalid id
    return min(len(ids), len(nvidia))


def cpu_overrides(cfg) -> List[str]:
    """The overrides that run ``cfg`` on this machine's CPU (what the CPU device checks would ask next)."""
    out = ["training.device=cpu"]
    if cfg.training.precision != "fp32":
        out.append("training.precision=fp32")
    if cfg.optimizer.use_distributed_optimizer:
        out.append("optimizer.use_distributed_optimizer=false")
    if cfg.parallelism.distributed_backend == "nccl":
        out.append("parallelism.distributed_backend=auto")
    if cfg.parallelism.context_parallel_size > 1:
        out.append("parallelism.context_parallel_size=1")
    if cfg.model.transformer_impl == "transformer_engine":
        out.append("model.transformer_impl=local")
    return out


def check_local_gpus(cfg) -> None:
    """Refuse a local job that asks for more GPUs than this machine has (ConfigError, one line)."""
    c, device = cfg.cluster, cfg.training.device
    if c.kind != "local" or cfg.plan or cfg.dry_run or device == "cpu" or os.environ.get("SUBMITIT_EXECUTOR"):
        return  # inside the job, the GPUs it sees are its binding (runtime/rank/distributed.py checks that)
    wanted = c.gpus_per_node or (1 if device == "cuda" else 0)
    have = local_gpu_count()
    if not wanted or have is None or have >= wanted:
        return
    key = f"cluster.gpus_per_node={c.gpus_per_node}" if c.gpus_per_node else "training.device=cuda"
    seen = "no GPU" if have == 0 else f"{have} GPU{'s' if have > 1 else ''}"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    why = f"CUDA_VISIBLE_DEVICES={visible}" if visible is not None and have else "no /dev/nvidia*"
    raise ConfigError(f"{key}: cluster={c.name} runs the job on this machine, which has {seen} ({why}); "
                      f"fix: {' '.join(cpu_overrides(cfg))} to train on its CPU, or run it where the GPUs are "
                      "(cluster=slurm ...)")
