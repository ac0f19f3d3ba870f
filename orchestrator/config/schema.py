"""Typed configuration schema.

Hydra composes ``conf/`` against these dataclasses (registered in Hydra's
ConfigStore as ``orchestrator_schema``), so a misspelt key or a wrong type is
refused by OmegaConf at composition time. Past the entry point only these
dataclasses travel: :func:`to_job_config` turns the composed ``DictConfig``
into a :class:`JobConfig` and nothing inward sees OmegaConf.

Megatron's own names are used for every parallel and batch concept. Derived
values (``data_parallel_size`` when not stated, ``num_microbatches``, layers per
stage) are computed by :mod:`orchestrator.config.layout`, never typed twice.

The sections live by concept: the network and its split in :mod:`~orchestrator.config.model_schema`,
how it is trained in :mod:`~orchestrator.config.training_schema`, what a run keeps and where in
:mod:`~orchestrator.config.run_schema`, the cluster in :mod:`~orchestrator.config.cluster`. This module
is the whole (:class:`JobConfig`) and its conversions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from orchestrator.config.cluster import ClusterConfig
from orchestrator.config.keys import check_keys, omegaconf_error
from orchestrator.config.model_schema import ModelConfig, ParallelismConfig
from orchestrator.config.run_schema import CheckpointConfig, LoggingConfig, RunConfig, SweepConfig, WandbConfig
from orchestrator.config.training_schema import DataConfig, OptimizerConfig, TrainingConfig
from orchestrator.errors import ConfigError

__all__ = [  # the sections live in their own modules (by concept); every reader may take them from here
    "CheckpointConfig",
    "ClusterConfig",
    "DataConfig",
    "JobConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelismConfig",
    "RunConfig",
    "SweepConfig",
    "TrainingConfig",
    "WandbConfig",
    "from_dict",
    "register_configs",
    "to_dict",
    "to_job_config",
]


@dataclass
class JobConfig:
    """The whole composed run; the only config object that travels past the entry point."""

    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    plan: bool = False
    """Print the plan (layout, memory, bubble, FLOPs) and stop."""
    dry_run: bool = False
    """Validate, print the plan and the submission (sbatch script) and stop."""
    gpu: Optional[str] = None
    """The planner's device preset for memory fit and step-time estimates (``plan.inputs.GPU_PRESETS`` or ``cpu``);
    null: the device the job runs on, i.e. this machine's CPU for CPU ranks, else ``A100-80GB``
    (:func:`orchestrator.plan.profile.planned_device`)."""
    plan_picture: Optional[str] = None
    """With plan=true: also draw the predicted schedule (Gantt chart per pipeline rank) and the memory per
    stage into this PNG file; null draws nothing."""
    plan_headroom: float = 0.85
    """Share of device memory a plan's estimate may reach and still say "fits"; above it "tight", with
    suggestions (the estimate leaves out the allocator's cache and fragmentation)."""


def register_configs() -> None:
    """Register the schema with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="orchestrator_schema", node=JobConfig)


def to_job_config(cfg: Any) -> JobConfig:
    """Resolve a composed ``DictConfig`` into a :class:`JobConfig` (raises ConfigError, one line).

    Values are checked by :func:`orchestrator.config.checks.validate`, not here.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    check_keys({k: v for k, v in OmegaConf.to_container(cfg, resolve=False).items() if k != "hydra"}, JobConfig)
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:  # interpolation, type or missing-value errors
        raise omegaconf_error(exc, JobConfig) from None
    if not isinstance(obj, JobConfig):
        raise ConfigError(
            "config: the composed config is not an orchestrator JobConfig; "
            "fix: keep `orchestrator_schema` first in conf/config.yaml's defaults"
        )
    from orchestrator.config.vpp import virtual_stages

    p = obj.parallelism  # Megatron-LM's name for VPP resolved here, so every reader sees VPP
    p.virtual_pipeline_model_parallel_size = virtual_stages(
        obj.model.num_layers,
        p.pipeline_model_parallel_size,
        p.virtual_pipeline_model_parallel_size,
        p.num_layers_per_virtual_pipeline_stage,
    )
    return obj


def to_dict(cfg: JobConfig) -> Dict[str, Any]:
    """Plain nested dict of the config (for manifests, logs and pickling into jobs)."""
    return dataclasses.asdict(cfg)


def from_dict(d: Dict[str, Any]) -> JobConfig:
    """Inverse of :func:`to_dict` (unknown keys raise ConfigError)."""
    kwargs = {}
    for f in dataclasses.fields(JobConfig):
        if f.name not in d:
            continue
        value = d[f.name]
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        if dataclasses.is_dataclass(sub):
            try:
                value = type(sub)(**value)
            except TypeError as exc:
                raise ConfigError(f"config section {f.name!r}: {exc}") from None
        kwargs[f.name] = value
    return JobConfig(**kwargs)
