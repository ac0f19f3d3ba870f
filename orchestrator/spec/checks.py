"""The one validate: every rule a config must pass before anything is prepared or queued.

Plan, dry-run, run, every sweep point and the job itself call :func:`validate`. Pure Python, no
torch import. Errors are :class:`~orchestrator.errors.ConfigError` /
:class:`~orchestrator.errors.LayoutError` with one line naming the key, the values and the fix.
"""

from __future__ import annotations

from orchestrator.errors import ConfigError
from orchestrator.spec.layout import ParallelLayout, layout_from_config
from orchestrator.spec.schema import JobConfig


def validate(cfg: JobConfig) -> ParallelLayout:
    """The validated layout of ``cfg`` (raises LayoutError / ConfigError)."""
    layout = layout_from_config(cfg).validate()
    check_device(cfg)
    return layout


def check_device(cfg: JobConfig) -> None:
    """Refuse, before submission, what the job's device cannot run (raises ConfigError).

    A local job without ``cluster.gpus_per_node`` runs on CPU (submitit hides the GPUs): there
    bf16/fp16, the distributed optimizer (megatron-core 0.16.1's tensor-type checks),
    ``training.device=cuda`` and context parallelism (Transformer Engine attention) cannot run.
    """
    if not (cfg.cluster.kind == "local" and not cfg.cluster.gpus_per_node):
        return
    where = "cluster=local without cluster.gpus_per_node runs on CPU"
    if cfg.training.device == "cuda":
        raise ConfigError(f"training.device=cuda but {where}; fix: cluster.gpus_per_node=<n> or training.device=auto")
    if cfg.training.precision != "fp32":
        raise ConfigError(f"training.precision={cfg.training.precision} needs a GPU ({where}); "
                          "fix: training.precision=fp32, or cluster.gpus_per_node=<n>")
    if cfg.optimizer.use_distributed_optimizer:
        raise ConfigError(f"optimizer.use_distributed_optimizer=true is GPU-only in megatron-core 0.16.1 ({where}); "
                          "fix: optimizer.use_distributed_optimizer=false")
    if cfg.parallelism.context_parallel_size > 1:
        raise ConfigError(f"parallelism.context_parallel_size={cfg.parallelism.context_parallel_size} needs "
                          f"Transformer Engine attention on GPUs ({where}); fix: context_parallel_size=1")
