"""A difference between a checkpoint and the requested run: its kind (refuse, reshard, warn: the rules of
:mod:`orchestrator.ckpt.resume`), which config keys are of which kind, and the table a refusal prints."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional

REFUSE, RESHARD, WARN = "refuse", "reshard", "warn"


LAYOUT_KEYS = [  # manifest["layout"] key, Hydra key, kind
    ("tensor_model_parallel_size", "parallelism.tensor_model_parallel_size", RESHARD),
    ("pipeline_model_parallel_size", "parallelism.pipeline_model_parallel_size", RESHARD),
    ("virtual_pipeline_model_parallel_size", "parallelism.virtual_pipeline_model_parallel_size", RESHARD),
    ("data_parallel_size", "parallelism.data_parallel_size", RESHARD),
    ("sequence_parallel", "parallelism.sequence_parallel", RESHARD),
    ("context_parallel_size", "parallelism.context_parallel_size", REFUSE),
    ("expert_model_parallel_size", "parallelism.expert_model_parallel_size", REFUSE),
]


REFUSE_KEYS = {
    *(
        f"model.{k}"
        for k in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "ffn_hidden_size",
            "seq_length",
            "max_position_embeddings",
            "position_embedding_type",
            "rotary_base",
            "rope_scaling",
            "rope_scaling_factor",
            "normalization",
            "activation",
            "add_bias_linear",
            "untie_embeddings_and_output_weights",
            "num_moe_experts",
        )
    ),
    *(f"data.{k}" for k in ("kind", "paths", "weights", "split", "json_key", "tokenizer", "stdlib_max_mb")),
    "optimizer.name",
    "optimizer.use_distributed_optimizer",
    "training.precision",
    "training.rampup_batch_size",
}


_RESHARD_KEYS = {"training.global_batch_size"}


_IGNORE_PREFIXES = ("run.", "cluster.", "checkpoint.", "parallelism.", "logging.", "sweep.")


_IGNORE_KEYS = {
    "plan",  # planning only: what is printed before the run, not what it computes
    "dry_run",
    "gpu",
    "plan_picture",
    "plan_headroom",
    "data.cache_dir",
    "data.name",
    "data.num_workers",  # how batches are read, not which
    "model.name",
    "training.name",
    "training.log_interval",
    "training.timing_warmup_iters",
    "training.exit_after_iters",
    "training.distributed_timeout_minutes",
    "training.eval_interval",
    "training.eval_iters",
    "training.spike.suggest_lr",  # advice for a stop's fix, not math
    "training.spike.suggest_lr_from",
    "model.make_vocab_size_divisible_by",
    "model.vocab_size",  # judged by the (padded) vocab
    "model.transformer_impl",
}  # judged by what it resolved to (_layer_spec_mismatch)


NOTES = {
    "training.global_batch_size": "changes tokens per step and the meaning of the LR schedule; "
    "consumed_samples carries the data position",
    "training.seed": "the dataset shuffle order depends on the seed",
    "training.rampup_batch_size": "each iteration's batch and the LR schedule's unit (samples with a ramp, "
    "iterations without) follow it; Megatron-LM's checkpoints carry it as an argument of the run",
    "training.fp8": "allowed: the same weights, their GEMMs rounded in FP8 (or no longer); the losses move",
    "data.tokenizer": "token ids would mean different things",
    "optimizer.use_distributed_optimizer": "optimizer state layouts differ; checkpoint.init_from loads weights only",
}


SCHEDULE_KEYS = {
    "optimizer.lr",
    "optimizer.min_lr",
    "optimizer.lr_decay_style",
    "optimizer.lr_warmup_iters",
    "optimizer.lr_decay_iters",
    "training.train_iters",
}
"""The config's LR schedule wins on resume (spec.schedule): the first changed key says what follows."""


@dataclass(frozen=True)
class Mismatch:
    """One difference between a checkpoint and the requested run."""

    key: str
    """Hydra key (``parallelism.pipeline_model_parallel_size``) or derived name (``model.padded_vocab_size``)."""
    checkpoint: object
    requested: object
    override: Optional[str]
    """The Hydra override that restores the checkpoint's value; None when no single key does."""
    kind: str
    """``refuse``, ``reshard`` (allowed with checkpoint.allow_reshard=true) or ``warn``."""
    note: str = ""

    @property
    def reshardable(self) -> bool:
        return self.kind == RESHARD


def hydra_value(value: object) -> str:
    """A value spelled as a Hydra override's right-hand side."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, str) and (
        value == ""
        or any(c in value for c in " ,=[]{}()'\"\\:$*?~")
        or value.lower() in ("true", "false", "null", "inf", "nan")
        or re.fullmatch(r"[-+]?[\d.]+(e[-+]?\d+)?", value, re.I)
    ):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


GROUP_NAMES = ("optimizer.name",)
"""Names that are a config group's option: the fix picks the option (its lr, schedule... with it), not the name."""


def key_kind(key: str) -> Optional[str]:
    if key in _IGNORE_KEYS or key.startswith(_IGNORE_PREFIXES):
        return None
    return REFUSE if key in REFUSE_KEYS else RESHARD if key in _RESHARD_KEYS else WARN


VERSIONS = "versions."
"""The key prefix of software-version differences (warned in one line, recorded in ``origin``)."""


def blocking(mismatches: List[Mismatch], allow_reshard: bool) -> List[Mismatch]:
    """The differences that refuse the resume (reshard ones only without ``allow_reshard``)."""
    return [m for m in mismatches if m.kind == REFUSE or (m.kind == RESHARD and not allow_reshard)]


def format_mismatch_table(mismatches: List[Mismatch]) -> str:
    """key | checkpoint | requested | resume, then the overrides that would match the checkpoint."""

    def cell(v: object) -> str:
        s = hydra_value(v) if not isinstance(v, str) else v
        return s if len(s) <= 40 else s[:37] + "..."

    label = {REFUSE: "refused", RESHARD: "reshard opt-in", WARN: "allowed"}
    rows = [("key", "checkpoint", "requested", "resume")]
    rows += [(m.key, cell(m.checkpoint), cell(m.requested), label[m.kind]) for m in mismatches]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    lines += [f"  {m.key}: {m.note}" for m in mismatches if m.note]
    overrides = list(dict.fromkeys(m.override for m in mismatches if m.override and m.kind != WARN))
    if overrides:
        lines.append("to match the checkpoint, add these overrides:")
        lines.append("  " + " ".join(overrides))
    if any(m.kind == RESHARD for m in mismatches) and not any(m.kind == REFUSE for m in mismatches):
        lines.append(
            "or keep the new values with checkpoint.allow_reshard=true (torch_dist reshards model "
            "weights and optimizer state over TP/PP/VPP/DP)"
        )
    return "\n".join(lines)
