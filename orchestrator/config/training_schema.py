"""How the network is trained: ``optimizer``, ``data`` and ``training`` (a part of the typed
configuration; :mod:`orchestrator.config.schema` composes every section into ``JobConfig``).

Megatron's own names for the optimizer, the learning-rate schedule and the batch arithmetic
(``num_microbatches`` is derived by :mod:`orchestrator.config.layout`, never typed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from orchestrator.config.slowness import StragglerConfig
from orchestrator.config.spike import SpikeConfig


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
    megatron: Dict[str, Any] = field(default_factory=dict)
    """Any field of megatron-core's OptimizerConfig the schema does not name, applied last (:mod:`orchestrator.config.megatron_passthrough`)."""


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
    num_workers: Optional[int] = None
    """DataLoader worker processes per rank that read training micro-batches ahead, each prefetching 2, into
    pinned memory on a GPU (Megatron-LM's --num-workers). Null: 2 on a GPU (Megatron-LM's default), 0 on a CPU
    rank (reads in the rank's process: the cores are the ranks'). Not math: a resume may change it."""


@dataclass
class TrainingConfig:
    """Batch arithmetic, iterations, precision and logging."""

    name: str = "default"
    micro_batch_size: int = 4
    global_batch_size: int = 16
    rampup_batch_size: Optional[List[int]] = None
    """Batch-size ramp-up ``[start, increment, samples]`` (Megatron-LM --rampup-batch-size): the global batch
    starts at ``start`` and grows by ``increment`` over ``samples`` consumed samples to global_batch_size, each
    iteration's batch from megatron-core's num-microbatches calculator. Unlike Megatron-LM (which allows it only
    with --train-samples) training stays iteration-based: train_iters counts iterations, the ramp's fewer samples
    included; the LR schedule then runs in samples (iters x GBS), as Megatron-LM's. start and increment multiples
    of MBS x DP, (GBS - start) a multiple of increment. Null: no ramp."""
    train_iters: int = 200
    """Optimizer steps to train in total (0: build, initialise and save the iteration-0 checkpoint)."""
    seed: int = 1234
    log_interval: int = 10
    """Iterations between the loss's host read, metrics.jsonl record, log line and TensorBoard point (10, as
    Megatron-Bridge's recipes; Megatron-LM's --log-interval defaults to 100). The last iteration, a save's and a
    stop's, an exit's and an attempt's first (as Megatron-LM's) are always logged. 1 logs (and reads the
    loss) every iteration."""
    precision: str = "fp32"
    """fp32, bf16 or fp16 (bf16/fp16 need a GPU)."""
    fp8: Optional[str] = None
    """FP8 GEMMs through Transformer Engine (GPU only, with training.precision=bf16 or fp16): null (off), hybrid
    (e4m3 forward, e5m2 gradients) or e4m3 (Megatron-LM --fp8-format; megatron-core TransformerConfig.fp8). A
    resume may switch it on or off (said in one line)."""
    fp8_recipe: str = "delayed"
    """The scaling recipe with training.fp8: delayed, tensorwise, mxfp8 (Blackwell) or blockwise (Megatron-LM
    --fp8-recipe; its default)."""
    fp8_amax_history_len: int = 1
    """Delayed scaling: amax values kept per FP8 tensor (Megatron-LM --fp8-amax-history-len; its default 1)."""
    fp8_amax_compute_algo: str = "most_recent"
    """Delayed scaling: most_recent or max of the amax history (Megatron-LM --fp8-amax-compute-algo; its default)."""
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
