"""The one validate: every rule a config must pass before anything is prepared or queued.

Plan, dry-run, run, every sweep point and the job itself call :func:`validate`. Pure Python, no
torch import (installed packages are looked up in their distribution metadata, never imported).
Every refusal is one :class:`~orchestrator.errors.ConfigError` (or
:class:`~orchestrator.errors.LayoutError`) whose message is a single line
``<key>=<value>: <what>; fix: <how>`` (the layout rules of :mod:`orchestrator.config.layout` read
``<key>=<value> <what> ...; fix: <how>``; several broken layout rules are joined with `` | ``).

Order, so that the first message is the one that makes sense: value types, enumerations and
ranges (``parallelism.data_parallel_size=-2`` is "must be a positive integer", never arithmetic
on -2) → ``run.name`` → the parallel layout and the model rules megatron-core checks in the
ranks (divisibility, recomputation, MoE) → what the device and the installed packages can run →
the data options (files exist, one weight per path).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, List, Tuple

from orchestrator.config.keys import is_section, schema_keys, type_words
from orchestrator.config.layout import ParallelLayout, layout_from_config
from orchestrator.config.machine import check_device, check_local_gpus, runs_on_cpu  # noqa: F401 (re-exported)
from orchestrator.config.model_rules import model_problems, recompute_problems  # noqa: F401 (re-exported)
from orchestrator.config.schema import JobConfig
from orchestrator.config.tokenizer import tokenizer_facts
from orchestrator.errors import ConfigError, LayoutError
from orchestrator.text import show

CHOICES = {
    "parallelism.distributed_backend": ("auto", "nccl", "gloo"),
    "model.position_embedding_type": ("learned_absolute", "rope"),
    "model.normalization": ("LayerNorm", "RMSNorm"),
    "model.activation": ("gelu", "swiglu"),
    "model.recompute_granularity": (None, "full", "selective"),
    "model.recompute_method": (None, "uniform", "block"),
    "model.transformer_impl": ("auto", "local", "transformer_engine"),
    "optimizer.name": ("adam", "sgd"),
    "optimizer.lr_decay_style": ("cosine", "linear", "constant"),
    "data.kind": ("stdlib", "jsonl", "indexed", "mock"),
    "training.precision": ("fp32", "bf16", "fp16"),
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
    ("model.num_layers", 1, False),
    ("model.hidden_size", 1, False),
    ("model.num_attention_heads", 1, False),
    ("model.num_query_groups", 1, True),
    ("model.ffn_hidden_size", 1, True),
    ("model.seq_length", 1, False),
    ("model.max_position_embeddings", 1, False),
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
    ("training.timing_warmup_iters", 0, False),
    ("training.exit_after_iters", 1, True),
    ("training.distributed_timeout_minutes", 1, False),
    ("training.eval_interval", 1, True),
    ("training.eval_iters", 0, False),
    ("training.max_skipped_steps", 0, False),
    ("training.spike.window", 1, False),
    ("checkpoint.save_interval", 0, True),
    ("checkpoint.keep_last", 2, True),
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
    ("optimizer.lr", 0.0, False, math.inf, False),
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
NULLABLE_NUMBERS = {"training.hang_timeout_s", "training.spike.factor", "cluster.link_check.min_gbps"}

SEED_MAX = 2**32 - 1
"""numpy's RandomState (megatron's dataset shuffling) takes seeds in [0, 2**32 - 1]."""


def validate(cfg: JobConfig) -> ParallelLayout:
    """The validated layout of ``cfg``; raises ConfigError / LayoutError (one line each)."""
    check_values(cfg)
    check_run(cfg)
    layout = layout_from_config(cfg)  # LayoutError (one line) for an under-specified allocation
    problems = layout.problems() + model_problems(cfg, layout)
    if problems:
        raise LayoutError(" | ".join(problems))
    check_device(cfg)
    check_local_gpus(cfg)  # a local job's GPUs are this machine's
    check_data(cfg)
    return layout


def validate_planned(cfg: JobConfig) -> Tuple[ParallelLayout, List[str]]:
    """(layout, warnings) for a plan: the one :func:`validate` with the data swapped for a stand-in
    (mock data, byte tokenizer), so that everything but the data refuses; then the data checks on the
    real config, as warnings: a cluster's data and tokenizer files are rarely on the machine that plans
    (the job checks them again where it runs)."""
    import dataclasses

    stand_in = dataclasses.replace(
        cfg.data, kind="mock", name="mock", paths=[], weights=None, tokenizer="byte", vocab_size=None, eod_id=None
    )
    layout = validate(dataclasses.replace(cfg, data=stand_in))
    try:
        check_data(cfg)
    except ConfigError as exc:
        return layout, [f"{exc} (data are checked again where the job runs)"]
    return layout, []


# ---------------------------------------------------------------- values
def _get(cfg: Any, key: str) -> Tuple[bool, Any]:
    """(present, value) of a dotted key; absent when the schema has no such field (yet)."""
    node = cfg
    for part in key.split("."):
        if not hasattr(node, part):
            return False, None
        node = getattr(node, part)
    return True, node


def _default(key: str) -> Any:
    """The schema's default of a dotted key (for the fix of a bad value)."""
    node: Any = JobConfig()
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _has_type(value: Any, annotation: str) -> bool:
    """Whether ``value`` fits a schema annotation (the strings ``from __future__`` annotations are)."""
    if annotation.startswith("Optional["):
        return value is None or _has_type(value, annotation[len("Optional[") : -1])
    if annotation.startswith("List["):
        return isinstance(value, (list, tuple)) and all(_has_type(v, annotation[5:-1]) for v in value)
    if annotation.startswith("Dict["):
        return isinstance(value, dict)
    simple = {
        "int": _is_int,
        "float": lambda v: _is_number(v) or (isinstance(v, float) and not math.isfinite(v)),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "Any": lambda v: True,
    }
    return simple.get(annotation, lambda v: True)(value)


def check_types(cfg: JobConfig) -> None:
    """Every field holds a value of its schema type (OmegaConf does this for composed configs;
    configs built in Python, for tests and tools, get the same one line)."""
    for key, f in schema_keys(JobConfig).items():
        present, value = _get(cfg, key)
        if present and not is_section(f) and not _has_type(value, str(f.type)):
            raise ConfigError(
                f"{key}={show(value)}: must be {type_words(f.type)}; "
                f"fix: {key}={show(_default(key))} (the schema's default)"
            )


def check_values(cfg: JobConfig) -> None:
    """Types, enumerations, integer and real ranges, and the few rules between two values (ConfigError)."""
    check_types(cfg)
    for key, allowed in CHOICES.items():
        present, value = _get(cfg, key)
        if present and value not in allowed:
            names = ", ".join(show(a) for a in allowed)
            raise ConfigError(
                f"{key}={show(value)}: not one of {names}; fix: {key}={show(_default(key))} or another of {names}"
            )
    for key, minimum, nullable in INTEGERS:
        present, value = _get(cfg, key)
        if not present or (value is None and nullable):
            continue
        if not _is_int(value) or value < minimum or (key == "training.seed" and value > SEED_MAX):
            need = {0: "an integer >= 0", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
            if key == "training.seed":
                need = f"an integer in [0, {SEED_MAX}]"
            raise ConfigError(
                f"{key}={show(value)}: must be {need}{' or null' if nullable else ''}; "
                f"fix: {key}={show(_default(key))} (the schema's default)"
            )
    for key, low, low_in, high, high_in in NUMBERS:
        present, value = _get(cfg, key)
        if not present or (value is None and key in NULLABLE_NUMBERS):
            continue
        if (
            not _is_number(value)
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
                f"fix: {key}={show(_default(key))} (the schema's default)"
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
            f'(train, validation, test) with train > 0; fix: "data.split={show(_default("data.split"))}" (quoted: a bare comma list is a sweep)'
        )
    present, eval_iters = _get(cfg, "training.eval_iters")
    if present and eval_iters and cfg.training.train_iters and (len(parts) < 2 or parts[1] <= 0):
        raise ConfigError(
            f"data.split={show(split)}: no validation part, but training.eval_iters={eval_iters} "
            f'evaluates on it; fix: "data.split={show(_default("data.split"))}" (quoted: a bare comma list is a sweep) or training.eval_iters=0'
        )


def check_run(cfg: JobConfig) -> None:
    """``run.name`` is one path component (the run directory is ``run.root/run.name``);
    ``checkpoint.init_from`` is a directory."""
    name = cfg.run.name
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(
            f"run.name={show(name)}: must be one directory name (no '/', not '.' or '..', not empty), "
            "so the run stays inside run.root; fix: run.name=<name>, and run.root=<dir> for "
            "another place"
        )
    if not isinstance(cfg.run.root, str) or not cfg.run.root:
        raise ConfigError(f"run.root={show(cfg.run.root)}: must be a directory path; fix: run.root=runs")
    picture = cfg.plan_picture
    if picture is not None and (
        not isinstance(picture, str) or Path(picture).suffix.lower() not in (".png", ".svg", ".pdf")
    ):
        raise ConfigError(
            f"plan_picture={show(picture)}: must be a file name ending in .png, .svg or .pdf (the "
            "picture's format); fix: plan_picture=plan.png"
        )
    if picture is not None and not cfg.plan:
        raise ConfigError(
            f"plan_picture={show(picture)}: drawn only by the plan, and plan=false runs the job "
            "instead; fix: add plan=true (a traced run draws its measured schedule with "
            "training.trace_iteration=N)"
        )
    init = cfg.checkpoint.init_from
    if init is not None and not Path(os.path.expanduser(init)).is_dir():
        raise ConfigError(
            f"checkpoint.init_from={show(init)}: no such directory; fix: the path of a checkpoint "
            "(<run dir>/checkpoints/iter_XXXXXXX), or checkpoint.init_from=null"
        )


# ---------------------------------------------------------------- data options
def check_data(cfg: JobConfig) -> None:
    """Paths exist, one positive weight per path, the tokenizer is usable (ConfigError, one line)."""
    d = cfg.data
    if d.kind in ("stdlib", "mock"):
        if d.paths or d.weights:
            key = "data.paths" if d.paths else "data.weights"
            raise ConfigError(
                f"{key}={show(list(d.paths) or list(d.weights or []))}: data={d.name} (kind {d.kind}) "
                "reads no files; fix: data=jsonl (or data=indexed) to train on files"
            )
    else:
        example = "/data/a.jsonl" if d.kind == "jsonl" else "/data/corpus_text_document"
        if not d.paths:
            raise ConfigError(
                f"data.paths=[]: data={d.name} needs at least one "
                f"{'JSONL file' if d.kind == 'jsonl' else '.bin/.idx prefix'}; "
                f"fix: data.paths=[{example}]"
            )
        for i, path in enumerate(d.paths):
            if not isinstance(path, str) or not path:
                raise ConfigError(f"data.paths[{i}]={show(path)}: not a path; fix: data.paths=[{example}]")
            full = Path(os.path.expanduser(path))
            if d.kind == "jsonl" and not full.is_file():
                raise ConfigError(
                    f"data.paths[{i}]={show(path)}: no such file (from {os.getcwd()}); "
                    "fix: the path of an existing .jsonl file"
                )
            if d.kind == "indexed":
                missing = [ext for ext in (".bin", ".idx") if not Path(str(full) + ext).is_file()]
                if missing:
                    raise ConfigError(
                        f"data.paths[{i}]={show(path)}: {path}{' and '.join(missing)} not found; "
                        "fix: the prefix of an existing .bin/.idx pair (the path without the extension)"
                    )
        if d.weights is not None:
            if len(d.weights) != len(d.paths):
                raise ConfigError(
                    f"data.weights={show(list(d.weights))}: {len(d.weights)} weights for "
                    f"{len(d.paths)} data.paths; fix: one weight per path, or data.weights=null (equal)"
                )
            for i, w in enumerate(d.weights):
                if not _is_number(w) or w <= 0:
                    raise ConfigError(
                        f"data.weights[{i}]={show(w)}: must be a finite number > 0; "
                        "fix: positive blend weights, or data.weights=null (equal)"
                    )
    if not isinstance(d.json_key, str) or not d.json_key:
        raise ConfigError(
            f"data.json_key={show(d.json_key)}: must name the JSON field holding the text; fix: data.json_key=text"
        )
    if not isinstance(d.cache_dir, str) or not d.cache_dir:
        raise ConfigError(
            f"data.cache_dir={show(d.cache_dir)}: must be a directory path; fix: data.cache_dir=~/.cache/orchestrator"
        )
    _check_tokenizer(d)


def _installed(package: str) -> bool:
    """Whether ``package`` is installed (its distribution metadata): a rank process keeps transformers out
    of its imports (``sys.modules``, :mod:`orchestrator.runtime.rank.startup`), so ``find_spec`` would say no."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(package)
    except PackageNotFoundError:
        return False
    return True


def _check_tokenizer(d: Any) -> None:
    """The tokenizer's files, vocabulary and eod (:func:`tokenizer_facts`), and the package that
    tokenizes with it when this data is tokenized here (an indexed dataset is read, never tokenized)."""
    facts = tokenizer_facts(d)
    if d.kind in ("jsonl", "stdlib") and facts.kind in ("huggingface", "gpt2-bpe") and not _installed("transformers"):
        raise ConfigError(
            f"data.tokenizer={show(d.tokenizer)}: tokenizing with it needs the transformers package "
            "(megatron-core's HuggingFaceTokenizer), which is not installed; fix: pip install "
            "transformers, or data.tokenizer=byte"
        )
