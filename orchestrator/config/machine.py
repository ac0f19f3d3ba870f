"""What the job's device and this machine can run: the device checks of validate, torch-free.

:func:`check_device`: what a CPU job cannot run (bf16, the distributed optimizer, nccl, CP,
Transformer Engine) and packages the config needs. :func:`check_local_gpus`: the GPUs of this
machine, for jobs that run on it (``cluster.kind=local``).

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
import importlib.util
import os
from typing import List, Optional

from orchestrator.config.fp8 import problem as fp8_problem
from orchestrator.config.schema import JobConfig
from orchestrator.errors import ConfigError


def runs_on_cpu(cfg: JobConfig) -> bool:
    """True when the job's ranks see no GPU: ``training.device=cpu`` or ``cluster.gpus_per_node=0``
    (submitit hides the GPUs of a local job that asks for none)."""
    return cfg.training.device == "cpu" or not cfg.cluster.gpus_per_node


def check_cpu_device(cfg: JobConfig) -> None:
    """What a CPU job cannot run (ConfigError naming the key, why and the fix): see :func:`check_device`."""
    t, m = cfg.training, cfg.model
    where = (
        "training.device=cpu"
        if t.device == "cpu"
        else f"cluster={cfg.cluster.name} without cluster.gpus_per_node runs on CPU"
    )
    gpus = "cluster.gpus_per_node=<n>"
    if t.device == "cuda":
        raise ConfigError(f"training.device=cuda: no GPU ({where}); fix: {gpus} or training.device=auto")
    if t.fp8:
        raise ConfigError(fp8_problem(cfg, "cpu", m.transformer_impl).replace("this job runs on CPU", where))
    if t.precision != "fp32":
        raise ConfigError(
            f"training.precision={t.precision}: needs a GPU ({where}); fix: training.precision=fp32, or {gpus}"
        )
    if m.moe_grouped_gemm:
        raise ConfigError(
            f"model.moe_grouped_gemm=true: megatron-core's grouped-GEMM experts run GPU kernels only (grouped_gemm, "
            f"Transformer Engine) ({where}); fix: model.moe_grouped_gemm=false"
        )
    if cfg.parallelism.context_parallel_size > 1:
        raise ConfigError(
            f"parallelism.context_parallel_size={cfg.parallelism.context_parallel_size}: needs "
            f"Transformer Engine attention on GPUs ({where}); "
            "fix: parallelism.context_parallel_size=1"
        )
    if cfg.parallelism.distributed_backend == "nccl":
        raise ConfigError(
            f"parallelism.distributed_backend=nccl: needs GPUs ({where}); "
            "fix: parallelism.distributed_backend=auto (gloo on CPU)"
        )
    if m.transformer_impl == "transformer_engine":
        raise ConfigError(
            f"model.transformer_impl=transformer_engine: Transformer Engine runs on GPUs only "
            f"({where}); fix: model.transformer_impl=local (or auto)"
        )
    if cfg.parallelism.sequence_parallel:
        raise ConfigError(
            f"parallelism.sequence_parallel=true: megatron-core's sequence-parallel layers need "
            f"GPUs ({where}: torch's LayerNorm has no sequence_parallel); "
            "fix: parallelism.sequence_parallel=false"
        )


def check_device(cfg: JobConfig) -> None:
    """Refuse, before submission, what the job's device and installed packages cannot run (ConfigError).

    On CPU (no ``cluster.gpus_per_node``, or ``training.device=cpu``): bf16/fp16, ``training.device=cuda``, the nccl
    backend, context parallelism (Transformer Engine attention) and Transformer Engine layers
    cannot run, nor sequence parallelism, nor FP8. ``model.transformer_impl=transformer_engine`` and
    ``training.fp8`` also need the package installed, checked for local jobs only (SLURM nodes have their
    own Python); FP8 on the local layer spec is refused everywhere (:mod:`orchestrator.config.fp8`).
    """
    m = cfg.model
    if runs_on_cpu(cfg):
        check_cpu_device(cfg)
    p = cfg.parallelism
    if p.overlap_param_gather and not cfg.optimizer.use_distributed_optimizer:
        raise ConfigError(
            "parallelism.overlap_param_gather=true: only the distributed optimizer gathers parameters "
            "(megatron DDP); fix: optimizer.use_distributed_optimizer=true or "
            "parallelism.overlap_param_gather=null"
        )
    # The launcher's Python is not the compute nodes': only a local job runs where this check looks.
    if not runs_on_cpu(cfg) and cfg.cluster.kind == "local" and m.transformer_impl != "local":
        problem = transformer_engine_problem()
        if problem:
            raise ConfigError(
                f"model.transformer_impl={m.transformer_impl}: Transformer Engine is installed but its "
                f"import fails ({problem}); fix: repair it (pip install --force-reinstall "
                "transformer-engine[pytorch]) or model.transformer_impl=local"
            )
    here = cfg.cluster.kind == "local" and not (cfg.plan or cfg.dry_run)  # a plan describes the job, not this machine
    te_missing = here and importlib.util.find_spec("transformer_engine") is None
    if not runs_on_cpu(cfg) and fp8_problem(cfg, "cuda", "local" if te_missing else m.transformer_impl):
        raise ConfigError(fp8_problem(cfg, "cuda", "local" if te_missing else m.transformer_impl))
    if (
        m.transformer_impl == "transformer_engine"
        and cfg.cluster.kind == "local"
        and importlib.util.find_spec("transformer_engine") is None
    ):
        raise ConfigError(
            "model.transformer_impl=transformer_engine: the transformer_engine package is not "
            "installed here; fix: pip install transformer-engine, or model.transformer_impl=auto"
        )


def transformer_engine_problem() -> Optional[str]:
    """None when Transformer Engine is absent or imports; else the first line of what its import raised
    (any exception), asked of a child Python so that this process stays torch-free (a few seconds, only
    for a local GPU job that may use TE)."""
    import subprocess
    import sys

    if importlib.util.find_spec("transformer_engine") is None:
        return None
    probe = (
        "import sys\ntry:\n    import transformer_engine\nexcept Exception as e:\n"
        "    print(type(e).__name__ + ': ' + ((str(e).strip().splitlines() or [''])[0])); sys.exit(1)"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    return (proc.stdout.strip().splitlines() or proc.stderr.strip().splitlines() or ["import failed"])[-1]


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
    ids = ids[: ids.index("-1")] if "-1" in ids else ids  # CUDA stops at the first invalid id
    return min(len(ids), len(nvidia))


def cpu_overrides(cfg: JobConfig) -> List[str]:
    """The overrides that run ``cfg`` on this machine's CPU (what the CPU device checks would ask next)."""
    out = ["training.device=cpu"] + (["training.fp8=null"] if cfg.training.fp8 else [])
    if cfg.training.precision != "fp32":
        out.append("training.precision=fp32")
    if cfg.parallelism.distributed_backend == "nccl":
        out.append("parallelism.distributed_backend=auto")
    if cfg.parallelism.context_parallel_size > 1:
        out.append("parallelism.context_parallel_size=1")
    if cfg.model.transformer_impl == "transformer_engine":
        out.append("model.transformer_impl=local")
    return out


def check_local_gpus(cfg: JobConfig) -> None:
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
    raise ConfigError(
        f"{key}: cluster={c.name} runs the job on this machine, which has {seen} ({why}); "
        f"fix: {' '.join(cpu_overrides(cfg))} to train on its CPU, or run it where the GPUs are "
        "(cluster=slurm ...)"
    )
