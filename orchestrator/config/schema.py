"""Typed configuration schema.

Hydra composes ``conf/`` against these dataclasses (registered in Hydra's
ConfigStore as ``orchestrator_schema``), so a misspelt key or a wrong type is
refused by OmegaConf at composition time. Past the entry point only these
dataclasses travel: :func:`to_job_config` turns the composed ``DictConfig``
into a :class:`JobConfig` and nothing inward sees OmegaConf.

Megatron's own names are used for every parallel and batch concept. Derived
values (``data_parallel_size`` when not stated, ``num_microbatches``, layers per
stage) are computed by :mod:`orchestrator.layout`, never typed twice.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from orchestrator.config.cluster import ClusterConfig
from orchestrator.config.keys import check_keys, omegaconf_error
from orchestrator.config.slowness import StragglerConfig
from orchestrator.config.spike import SpikeConfig
from orchestrator.errors import ConfigError


@dataclass
class ParallelismConfig:
    """Parallel degrees. ``data_parallel_size`` is derived from the world size when null."""

    name: str = "none"
    tensor_model_parallel_size: int = 1
    """TP: each layer's weight matrices are split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: the layer stack is split into this many stages."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """VPP: model chunks per pipeline rank (interleaved 1F1B); null = plain 1F1B."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Megatron-LM's way to say VPP: transformer layers per model chunk. Set, it derives
    VPP = num_layers / (PP x this), refused unless it divides (and unless a stated VPP agrees)."""
    context_parallel_size: int = 1
    """CP: the sequence is split over this many ranks (attention only)."""
    expert_model_parallel_size: int = 1
    """EP: MoE experts are split over this many ranks (needs model.num_moe_experts)."""
    data_parallel_size: Optional[int] = None
    """DP. Null: derived as world_size / (TP x PP x CP). Stated: must agree with the world size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1)."""
    distributed_backend: str = "auto"
    """torch.distributed backend: auto (nccl on GPU, gloo on CPU), nccl or gloo."""
    overlap_grad_reduce: Optional[bool] = None
    """Overlap DP gradient reduction with the backward pass (megatron DDP). Null: on for a GPU job with
    DP > 1 (as NVIDIA's recipes), off on CPU (orchestrator/config/megatron_fields.py)."""
    overlap_param_gather: Optional[bool] = None
    """Overlap the distributed optimizer's parameter all-gather with the forward pass. Null: on for a GPU
    job with DP > 1 and optimizer.use_distributed_optimizer, else off."""


@dataclass
class ModelConfig:
    """GPT model shape (Megatron TransformerConfig names)."""

    name: str = "gpt_tiny"
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    """Grouped-query attention groups; null = num_attention_heads (multi-head attention)."""
    ffn_hidden_size: Optional[int] = None
    """MLP width; null = 4 x hidden_size."""
    seq_length: int = 128
    max_position_embeddings: int = 128
    position_embedding_type: str = "learned_absolute"
    """learned_absolute or rope."""
    normalization: str = "LayerNorm"
    """LayerNorm or RMSNorm."""
    activation: str = "gelu"
    """gelu or swiglu."""
    add_bias_linear: bool = True
    untie_embeddings_and_output_weights: bool = False
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this x TP (Megatron's rule)."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2  # experts a token is routed to (MoELayer, alltoall dispatcher; Mixtral: 2 of 8)
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss coefficient (Megatron-LM's Mixtral recipe: 1e-2)
    vocab_size: Optional[int] = None
    """Published tokenizer vocabulary (Llama-3: 128256), used while the data names none (tokenizer.py)."""
    recompute_granularity: Optional[str] = None
    """null, full or selective activation recomputation."""
    recompute_method: Optional[str] = None
    """uniform or block (with recompute_granularity=full)."""
    recompute_num_layers: Optional[int] = None
    transformer_impl: str = "auto"
    """auto (Transformer Engine on GPU when installed, else local), local or transformer_engine."""


@dataclass
class OptimizerConfig:
    """Megatron optimizer and learning-rate schedule."""

    name: str = "adam"
    """adam (AdamW-style decoupled weight decay, Megatron's default) or sgd."""
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    """Global gradient-norm clipping threshold; 0 disables clipping."""
    lr_decay_style: str = "cosine"
    """cosine, linear or constant."""
    lr_warmup_iters: int = 0
    lr_decay_iters: Optional[int] = None
    """Null = training.train_iters."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over DP (ZeRO-1). GPU only in megatron-core 0.16.1."""


@dataclass
class DataConfig:
    """Training data and tokenizer."""

    name: str = "stdlib"
    kind: str = "stdlib"
    """stdlib (the Python standard library's sources, offline), jsonl, indexed or mock."""
    paths: List[str] = field(default_factory=list)
    """jsonl: .jsonl files; indexed: Megatron dataset prefixes (path without .bin/.idx)."""
    weights: Optional[List[float]] = None
    """Blend weights, one per path; null = equal weights."""
    json_key: str = "text"
    tokenizer: str = "byte"
    """byte (UTF-8 bytes, 256 ids + eod + pad, no download); a Megatron-LM --tokenizer-type:
    GPT2BPETokenizer (vocab_file + merge_file), HuggingFaceTokenizer or SentencePieceTokenizer
    (tokenizer_model), NullTokenizer (vocab_size); or the path of a HuggingFace tokenizer.json or its
    directory. Built with megatron-core's tokenizer classes (orchestrator/config/tokenizer.py)."""
    vocab_file: Optional[str] = None
    """GPT2BPETokenizer's vocab.json (Megatron-LM --vocab-file)."""
    merge_file: Optional[str] = None
    """GPT2BPETokenizer's merges.txt (Megatron-LM --merge-file)."""
    tokenizer_model: Optional[str] = None
    """SentencePieceTokenizer's .model file, or HuggingFaceTokenizer's tokenizer.json / directory
    (Megatron-LM --tokenizer-model)."""
    vocab_size: Optional[int] = None
    """Token ids the data may hold (eod included), before Megatron's padding. Null: read from the
    tokenizer's files. Needed by NullTokenizer (pre-tokenized data without a tokenizer, e.g. 50257 for
    GPT-2 ids); with another tokenizer it must agree with its files."""
    eod_id: Optional[int] = None
    """The end-of-document id appended after every document. Null: the tokenizer's (GPT-2: 50256, a
    HuggingFace tokenizer's eos_token); set it for a tokenizer that defines none."""
    cache_dir: str = "${oc.env:ORCHESTRATOR_CACHE,'~/.cache/orchestrator'}"
    """Where prepared .bin/.idx files and dataset indices are cached."""
    split: str = "98,2,0"
    """Train/valid/test split weights of each dataset's documents (Megatron's rule); the validation
    part is held out for training.eval_iters."""
    stdlib_max_mb: float = 8.0
    """stdlib: how many MB of source text to take (sorted, deterministic)."""
    workers: Optional[int] = None
    """Processes that tokenize (Megatron-LM preprocess_data.py's --workers). Null: one per core
    (one for less than 4 MB of text)."""


@dataclass
class TrainingConfig:
    """Batch arithmetic, iterations, precision and logging."""

    name: str = "default"
    micro_batch_size: int = 4
    global_batch_size: int = 16
    train_iters: int = 200
    """Optimizer steps to train in total (0: build, initialise and save the iteration-0 checkpoint)."""
    seed: int = 1234
    log_interval: int = 1
    precision: str = "fp32"
    """fp32, bf16 or fp16 (bf16/fp16 need a GPU)."""
    device: str = "auto"
    """auto (cuda when the job sees a GPU, else cpu), cpu or cuda."""
    timing_warmup_iters: int = 3
    """Iterations excluded from step-time statistics (sweeps, benchmarks)."""
    exit_after_iters: Optional[int] = None
    """Stop (saving a checkpoint) after this many iterations in this job; for tests and sweeps."""
    distributed_timeout_minutes: int = 10
    hang_timeout_s: Optional[float] = 300.0
    """Hang watchdog: a rank that makes no progress (no finished iteration) for this long, counted from
    its first iteration (a checkpoint save is allowed checkpoint.save_timeout_s), stops the job with
    every live rank's Python stacks in <run.dir>/stacks/; null disables it. Keep it below
    distributed_timeout_minutes x 60, or the collective timeout ends the job first, without stacks."""
    nan_policy: str = "stop"
    """A non-finite gradient norm (or loss): stop (the job ends at that iteration, nothing of it saved)
    or skip (that optimizer update is not applied, up to max_skipped_steps in a row, then stop)."""
    max_skipped_steps: int = 3
    """nan_policy=skip: how many consecutive non-finite steps are skipped before the job stops."""
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    """Slow-rank detection (orchestrator/runtime/faults/straggler.py)."""
    eval_interval: Optional[int] = 100
    """Evaluate the validation lm loss every N iterations (and after the last); null = only after the last."""
    eval_iters: int = 10
    """Validation batches (of global_batch_size samples each, the same batches every time) per
    evaluation; 0 disables evaluation. Needs a validation weight in data.split."""
    trace_iteration: Optional[int] = None
    """Record iteration N's pipeline schedule on every rank (forward, backward, send/recv waits) into
    <run.dir>/schedule.json, schedule_trace.json (Chrome trace) and schedule.png, with the measured bubble
    per stage next to (p-1)/(v m); null (default) records nothing."""
    breakdown_interval: int = 10
    """Every N iterations (and at the last) the logging rank says and records (metrics.jsonl ``breakdown``)
    each pipeline stage's step by share: compute, pipeline bubble, DP communication, optimizer, data, other
    (and MFU on a GPU); the summary has it over the timed iterations. 0: not measured."""

    def __post_init__(self) -> None:  # from_dict / a pickled job: plain dicts travel
        self.spike = SpikeConfig(**self.spike) if isinstance(self.spike, dict) else self.spike
        if isinstance(self.straggler, dict):
            self.straggler = StragglerConfig(**self.straggler)


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

    save_interval: Optional[int] = None
    """Save every N iterations; null = only at the end."""
    save_at_end: bool = True
    auto_resume: bool = True
    """Resume from the latest complete checkpoint of this run directory."""
    allow_reshard: bool = False
    """Allow resuming with a different TP/PP/DP (torch_dist reshards model weights)."""
    init_from: Optional[str] = None
    """Load model weights only from this checkpoint directory (no optimizer, iteration 0)."""
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
    gpu: str = "A100-80GB"
    """GPU preset used by the planner for memory fit and step-time estimates."""
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
    from orchestrator.config.layout import virtual_stages

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
