"""The values of a config, each on its own: types, enumerations, integer and real ranges, and the few
rules between two values (``optimizer.min_lr`` <= ``optimizer.lr``, SLURM's signal delay, spare nodes,
``data.split``). The first checks :func:`orchestrator.config.checks.validate` runs; a new key with a
range or a set of values gets its line in :data:`CHOICES`, :data:`INTEGERS` or :data:`NUMBERS`.
"""

from __future__ import annotations

import math
from typing import Any, List, Tuple

from orchestrator.config.keys import is_section, schema_keys, type_words
from orchestrator.config.schema import JobConfig
from orchestrator.errors import ConfigError
from orchestrator.text import show

CHOICES = {
    "parallelism.distributed_backend": ("auto", "nccl", "gloo"),
    "model.position_embedding_type": ("learned_absolute", "rope"),
    "model.rope_scaling": (None, "llama3"),
    "model.normalization": ("LayerNorm", "RMSNorm"),
    "model.activation": ("gelu", "swiglu"),
    "model.recompute_granularity": (None, "full", "selective"),
    "model.recompute_method": (None, "uniform", "block"),
    "model.transformer_impl": ("auto", "local", "transformer_engine"),
    "optimizer.name": ("adam", "sgd"),
    "optimizer.lr_decay_style": ("cosine", "linear", "constant"),
    "data.kind": ("stdlib", "jsonl", "indexed", "mock"),
    "training.precision": ("fp32", "bf16", "fp16"),
    "training.fp8": (None, "hybrid", "e4m3"),
    "training.fp8_recipe": ("delayed", "tensorwise", "mxfp8", "blockwise"),
    "training.fp8_amax_compute_algo": ("most_recent", "max"),
    "training.device": ("auto", "cpu", "cuda"),
    "training.nan_policy": ("stop", "skip"),
    "cluster.link_check.action": ("warn", "refuse", "off"),
    "checkpoint.digest": ("size", "sha256"),
    "cluster.kind": ("local", "slurm", "hosts", "torchrun"),
    "logging.wandb.mode": (None, "online", "offline", "disabled"),
}
"""Enumerated string fields and their values (megatron-core's spelling where it has one)."""

INTEGERS: List[Tuple[str, int, bool]] = [
    # (key, minimum, null allowed)
    ("parallelism.tensor_model_parallel_size", 1, False),
    ("parallelism.pipeline_model_parallel_size", 1, False),
    ("parallelism.virtual_pipeline_model_parallel_size", 1, True),
    ("parallelism.context_parallel_size", 1, False),
    ("parallelism.num_layers_per_virtual_pipeline_stage", 1, True),
    ("data.vocab_size", 1, True),
    ("parallelism.expert_model_parallel_size", 1, False),
    ("parallelism.data_parallel_size", 1, True),
    ("data.eod_id", 0, True),
    ("data.workers", 1, True),
    ("data.num_workers", 0, True),
    ("model.num_layers", 1, False),
    ("model.hidden_size", 1, False),
    ("model.num_attention_heads", 1, False),
    ("model.num_query_groups", 1, True),
    ("model.ffn_hidden_size", 1, True),
    ("model.seq_length", 1, False),
    ("model.max_position_embeddings", 1, False),
    ("model.rotary_base", 1, False),
    ("model.make_vocab_size_divisible_by", 1, False),
    ("model.num_moe_experts", 2, True),
    ("model.recompute_num_layers", 1, True),
    ("optimizer.lr_warmup_iters", 0, False),
    ("optimizer.lr_decay_iters", 1, True),
    ("training.micro_batch_size", 1, False),
    ("training.global_batch_size", 1, False),
    ("training.train_iters", 0, False),
    ("training.seed", 0, False),
    ("training.log_interval", 1, False),
    ("training.fp8_amax_history_len", 1, False),
    ("training.timing_warmup_iters", 0, False),
    ("training.exit_after_iters", 1, True),
    ("training.distributed_timeout_minutes", 1, False),
    ("training.eval_interval", 1, True),
    ("training.eval_iters", 0, False),
    ("training.max_skipped_steps", 0, False),
    ("training.spike.window", 1, False),
    ("checkpoint.save_interval", 0, True),
    ("checkpoint.keep_last", 2, True),
    ("checkpoint.auto_min_interval", 1, False),
    ("checkpoint.auto_max_interval", 1, True),
    ("checkpoint.keep_every", 1, True),
    ("training.trace_iteration", 1, True),
    ("sweep.trace_iteration", 1, True),
    ("training.breakdown_interval", 0, False),
    ("cluster.nodes", 1, False),
    ("cluster.tasks_per_node", 1, True),
    ("cluster.gpus_per_node", 0, False),
    ("cluster.cpus_per_task", 1, True),
    ("cluster.timeout_min", 1, False),
    ("cluster.signal_delay_s", 0, False),
    ("cluster.max_num_timeout", 0, False),
    ("cluster.max_failures", 0, False),
    ("cluster.max_restarts", 0, False),
    ("cluster.spare_nodes", 0, False),
    ("cluster.ssh.port", 1, True),
    ("cluster.ssh.connect_timeout_s", 1, False),
    ("training.straggler.interval", 1, True),
    ("training.straggler.windows", 1, False),
]
"""Integer fields megatron-core / SLURM need in a range (``iteration % log_interval``, group sizes...)."""

NUMBERS: List[Tuple[str, float, bool, float, bool]] = [
    # (key, low, low included, high, high included)
    ("model.hidden_dropout", 0.0, True, 1.0, False),
    ("model.attention_dropout", 0.0, True, 1.0, False),
    ("model.init_method_std", 0.0, False, math.inf, False),
    ("model.norm_epsilon", 0.0, False, 1.0, False),
    ("model.rope_scaling_factor", 1.0, True, math.inf, False),
    ("optimizer.lr", 0.0, False, math.inf, False),
    ("cluster.mtbf_hours", 0.0, False, math.inf, False),
    ("optimizer.min_lr", 0.0, True, math.inf, False),
    ("optimizer.weight_decay", 0.0, True, math.inf, False),
    ("optimizer.adam_beta1", 0.0, True, 1.0, False),
    ("optimizer.adam_beta2", 0.0, True, 1.0, False),
    ("optimizer.adam_eps", 0.0, False, math.inf, False),
    ("optimizer.sgd_momentum", 0.0, True, 1.0, False),
    ("optimizer.clip_grad", 0.0, True, math.inf, False),
    ("data.stdlib_max_mb", 0.0, False, math.inf, False),
    ("checkpoint.save_timeout_s", 0.0, False, math.inf, False),
    ("plan_headroom", 0.0, False, 1.0, True),
    ("cluster.poll_interval_s", 0.0, False, math.inf, False),
    ("training.hang_timeout_s", 0.0, False, math.inf, False),
    ("training.spike.factor", 1.0, False, math.inf, False),
    ("training.straggler.threshold", 0.0, False, 10.0, False),
    ("cluster.link_check.min_fraction", 0.0, False, 1.0, True),
    ("cluster.link_check.min_gbps", 0.0, False, math.inf, False),
    ("cluster.link_check.megabytes", 0.0, False, 64.0, True),
]
"""Real-valued fields and their ranges (finite values only)."""
NULLABLE_NUMBERS = {
    "cluster.mtbf_hours",
    "training.hang_timeout_s",
    "training.spike.factor",
    "cluster.link_check.min_gbps",
}

SEED_MAX = 2**32 - 1
"""numpy's RandomState (megatron's dataset shuffling) takes seeds in [0, 2**32 - 1]."""


# ---------------------------------------------------------------- values
def value_of(cfg: Any, key: str) -> Tuple[bool, Any]:
    """(present, value) of a dotted key; absent when the schema has no such field (yet)."""
    node = cfg
    for part in key.split("."):
        if not hasattr(node, part):
            return False, None
        node = getattr(node, part)
    return True, node


def schema_default(key: str) -> Any:
    """The schema's default of a dotted key (for the fix of a bad value)."""
    node: Any = JobConfig()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def has_type(value: Any, annotation: str) -> bool:
    """Whether ``value`` fits a schema annotation (the strings ``from __future__`` annotations are)."""
    if annotation.startswith("Optional["):
        return value is None or has_type(value, annotation[len("Optional[") : -1])
    if annotation.startswith("List["):
        return isinstance(value, (list, tuple)) and all(has_type(v, annotation[5:-1]) for v in value)
    if annotation.startswith("Dict["):
        return isinstance(value, dict)
    simple = {
        "int": is_int,
        "float": lambda v: is_number(v) or (isinstance(v, float) and not math.isfinite(v)),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "Any": lambda v: True,
    }
    return simple.get(annotation, lambda v: True)(value)


def check_types(cfg: JobConfig) -> None:
    """Every field holds a value of its schema type (OmegaConf does this for composed configs;
    configs built in Python, for tests and tools, get the same one line)."""
    for key, f in schema_keys(JobConfig).items():
        present, value = value_of(cfg, key)
        if present and not is_section(f) and not has_type(value, str(f.type)):
            raise ConfigError(
                f"{key}={show(value)}: must be {type_words(f.type)}; "
                f"fix: {key}={show(schema_default(key))} (the schema's default)"
            )


def check_values(cfg: JobConfig) -> None:
    """Types, enumerations, integer and real ranges, and the few rules between two values (ConfigError)."""
    check_types(cfg)
    for key, allowed in CHOICES.items():
        present, value = value_of(cfg, key)
        if present and value not in allowed:
            names = ", ".join(show(a) for a in allowed)
            raise ConfigError(
                f"{key}={show(value)}: not one of {names}; fix: {key}={show(schema_default(key))} or another of {names}"
            )
    for key, minimum, nullable in INTEGERS:
        present, value = value_of(cfg, key)
        if not present or (value is None and nullable):
            continue
        if key == "checkpoint.save_interval" and not is_int(value):
            if value == "auto":
                continue
            raise ConfigError(
                f"{key}={show(value)}: must be an integer >= 0, auto or null; "
                f"fix: {key}=auto (Young–Daly's interval) or {key}=1000"
            )
        if not is_int(value) or value < minimum or (key == "training.seed" and value > SEED_MAX):
            need = {0: "an integer >= 0", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
            if key == "training.seed":
                need = f"an integer in [0, {SEED_MAX}]"
            if key == "checkpoint.save_interval":
                need += ", auto"
            raise ConfigError(
                f"{key}={show(value)}: must be {need}{' or null' if nullable else ''}; "
                f"fix: {key}={show(schema_default(key))} (the schema's default)"
            )
    for key, low, low_in, high, high_in in NUMBERS:
        present, value = value_of(cfg, key)
        if not present or (value is None and key in NULLABLE_NUMBERS):
            continue
        if (
            not is_number(value)
            or value < low
            or (value == low and not low_in)
            or value > high
            or (value == high and not high_in)
        ):
            span = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
            need = f"in {span}" if high < math.inf else (f">= {low:g}" if low_in else f"> {low:g}")
            raise ConfigError(
                f"{key}={show(value)}: must be a finite number {need}"
                f"{' or null' if key in NULLABLE_NUMBERS else ''}; "
                f"fix: {key}={show(schema_default(key))} (the schema's default)"
            )
    o = cfg.optimizer
    if o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr}: above optimizer.lr={o.lr}; fix: optimizer.min_lr <= {o.lr}")
    c = cfg.cluster
    if c.kind == "slurm" and c.signal_delay_s >= c.timeout_min * 60:
        raise ConfigError(
            f"cluster.signal_delay_s={c.signal_delay_s}: the save-and-requeue signal would come before "
            f"the job starts (cluster.timeout_min={c.timeout_min} = {c.timeout_min * 60} s); "
            f"fix: cluster.signal_delay_s < {c.timeout_min * 60}"
        )
    _check_spares(c)
    _check_split(cfg)
    ck = cfg.checkpoint
    if ck.save_interval == "auto" and ck.auto_max_interval is not None and ck.auto_max_interval < ck.auto_min_interval:
        raise ConfigError(
            f"checkpoint.auto_max_interval={ck.auto_max_interval}: below checkpoint.auto_min_interval="
            f"{ck.auto_min_interval}; fix: checkpoint.auto_max_interval >= {ck.auto_min_interval} (or null)"
        )


def _check_spares(c: Any) -> None:
    """``cluster.spare_nodes`` needs a SLURM job (SLURM allocates them) that restarts in place."""
    if c.spare_nodes and c.kind != "slurm":
        raise ConfigError(
            f"cluster.spare_nodes={c.spare_nodes}: spare nodes are extra nodes of a SLURM allocation, "
            f"and cluster.kind={c.kind} has none; fix: cluster.spare_nodes=0 (or cluster=slurm)"
        )
    if c.spare_nodes and not c.max_restarts:
        raise ConfigError(
            f"cluster.spare_nodes={c.spare_nodes}: a spare node only takes a failed node's place "
            f"when the job restarts in place, and cluster.max_restarts={c.max_restarts}; fix: "
            "cluster.max_restarts=1 (or more), or cluster.spare_nodes=0"
        )
    if c.max_restarts and c.kind in ("hosts", "torchrun"):
        raise ConfigError(
            f"cluster.max_restarts={c.max_restarts}: in-place restarts are for cluster.kind=local "
            f"and slurm, not cluster.kind={c.kind}; fix: cluster.max_restarts=0"
        )


def _check_split(cfg: JobConfig) -> None:
    """``data.split``: one to three non-negative weights (train, validation, test), train > 0."""
    split = cfg.data.split
    try:
        parts = [float(p) for p in str(split).split(",")]
    except ValueError:
        parts = []
    if not 1 <= len(parts) <= 3 or any(not math.isfinite(p) or p < 0 for p in parts) or parts[0] <= 0:
        raise ConfigError(
            f"data.split={show(split)}: must be 1 to 3 comma-separated weights >= 0 "
            f'(train, validation, test) with train > 0; fix: "data.split={show(schema_default("data.split"))}" (quoted: a bare comma list is a sweep)'
        )
    present, eval_iters = value_of(cfg, "training.eval_iters")
    if present and eval_iters and cfg.training.train_iters and (len(parts) < 2 or parts[1] <= 0):
        raise ConfigError(
            f"data.split={show(split)}: no validation part, but training.eval_iters={eval_iters} "
            f'evaluates on it; fix: "data.split={show(schema_default("data.split"))}" (quoted: a bare comma list is a sweep) or training.eval_iters=0'
        )
