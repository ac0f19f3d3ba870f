"""What a run keeps and where: ``checkpoint``, ``logging``, ``sweep`` and ``run`` (a part of the typed
configuration; :mod:`orchestrator.config.schema` composes every section into ``JobConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class WandbConfig:
    """Weights & Biases (``pip install orchestrator[wandb]``); off while ``project`` is null."""

    project: Optional[str] = None
    entity: Optional[str] = None
    name: Optional[str] = None
    """Run name; null = run.name."""
    mode: Optional[str] = None
    """online, offline or disabled; null = wandb's own default (the WANDB_MODE variable)."""


@dataclass
class LoggingConfig:
    """Where the logging rank writes metrics besides ``<run.dir>/metrics.jsonl``."""

    tensorboard: bool = True
    """TensorBoard events under ``<run.dir>/tensorboard`` (Megatron-LM's tag names)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        if isinstance(self.wandb, dict):  # from_dict / a pickled job: plain dicts travel
            self.wandb = WandbConfig(**self.wandb)


@dataclass
class CheckpointConfig:
    """Saving and resuming. The save directory is ``<run.dir>/checkpoints``."""

    save_interval: Any = None
    """Save every N iterations; null = only at the end; ``auto``: every Young–Daly interval sqrt(2 C M)
    in iterations, C the measured blocking time of the last save (before the first: the planner's bytes at
    a stated write bandwidth), M the job's mean time between failures (``cluster.mtbf_hours``), re-chosen
    after each save within [``auto_min_interval``, ``auto_max_interval``] (runtime.training.save_schedule)."""
    auto_min_interval: int = 10
    """``save_interval=auto``: never save more often than every N iterations (also: the first interval is
    chosen once N iterations are timed)."""
    auto_max_interval: Optional[int] = None
    """``save_interval=auto``: never let more than N iterations pass between saves; null: no bound."""
    save_at_end: bool = True
    auto_resume: bool = True
    """Resume from the latest complete checkpoint of this run directory."""
    allow_reshard: bool = False
    """Allow resuming with a different TP/PP/DP (torch_dist reshards model weights)."""
    init_from: Optional[str] = None
    """Load model weights only from this checkpoint directory (no optimizer, iteration 0); ``hf:PATH``: from a
    Hugging Face directory (config.json + safetensors) at any layout (runtime.training.hf_start)."""
    hf_verify: bool = True
    """With ``init_from=hf:PATH``: compare the loaded model's logits with transformers' on a fixed batch before
    the first iteration and stop above the precision's tolerance (skipped when the model does not fit in memory)."""
    save_timeout_s: float = 600.0
    """A save that takes longer fails the job instead of hanging."""
    digest: str = "size"
    """What the manifest digests: ``size`` (file sizes + dist_checkpointing metadata hashed; cheap at any
    size) or ``sha256`` (every file, hashed by the ranks in parallel at save; ``manifest check --deep``)."""
    keep_last: Optional[int] = 3
    """Keep the newest K complete checkpoints (K >= 2: the newest may still be being written); older ones
    are removed once a newer manifest is written (:mod:`orchestrator.ckpt.retention`). null keeps all."""
    keep_every: Optional[int] = None
    """Checkpoints at multiples of N iterations are never removed (milestones for evaluation)."""
    async_save: bool = False
    """Write checkpoints in the background (megatron-core's asynchronous dist_checkpointing): training
    waits only while the state is staged; the manifest follows once every rank's write finished."""
    space_check: bool = True
    """Refuse a run whose run.root cannot hold keep_last + 1 predicted checkpoints, and stop a job before a
    save that no longer fits the free space; false leaves only the ENOSPC report of a failed save."""


@dataclass
class SweepConfig:
    """Multirun (``python -m orchestrator -m ...``) behaviour; single runs ignore it (orchestrator/sweep.py)."""

    run_predicted_oom: bool = False
    """Run points the planner predicts do not fit on ``gpu``; false records them as skipped_oom_predicted."""
    warm_pool: bool = True
    """Local sweeps: consecutive points with the same world size run on the same warm rank processes
    (orchestrator.submit.pool), paying the process start-up once; false: a fresh job per point."""
    trace_iteration: Optional[int] = None
    """Trace this iteration of every point (training.trace_iteration): the table's measured bubble column."""


@dataclass
class RunConfig:
    """Identity and location of a run."""

    name: str = "${model.name}_${parallelism.name}"
    root: str = "runs"
    dir: str = "${hydra:runtime.output_dir}"
    """Run directory: resolved config, logs, metrics.jsonl, checkpoints/."""
