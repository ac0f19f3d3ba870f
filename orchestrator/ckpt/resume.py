"""Resume safety: compare a checkpoint's manifest with the requested run, refuse or allow.

:func:`preflight` runs on the launching machine before submission and again inside the
job before loading. It finds the latest complete checkpoint of ``<run.dir>/checkpoints``,
:func:`compare` s its manifest with the config and layout, and raises
:class:`~orchestrator.errors.ResumeMismatchError` with a table (key, checkpoint value,
requested value) and the Hydra overrides that would match the checkpoint.

Every difference is one of three kinds:

``refuse``  the checkpoint cannot carry it, opt-in or not: model shape, vocab size and
            padded vocab, tokenizer, data identity (kind, paths, weights, split, content
            fingerprint), sequence length, optimizer type and sharding
            (``use_distributed_optimizer``), precision, checkpoint format, and context /
            expert parallel sizes (CP replicates weights and torch_dist keys experts
            globally, but neither resume path is verified here, so they stay refused), and the
            layer spec that ran (``local`` vs ``transformer_engine``, recorded resolved in the
            manifest's ``model.transformer_impl``): the two specs name their state differently
            (TE's fused layer-norm weights, ``_extra_state``) and no test here proves a torch_dist
            load across them. A request of ``auto`` is judged where it resolves: on the launcher
            only when the job will run on CPU (local spec), otherwise by the job itself.
``reshard`` carried by megatron's torch_dist format, only with ``checkpoint.allow_reshard=true``:
            TP, PP, VPP, DP (and the world size), sequence_parallel. Model weights are
            ShardedTensors with global offsets (layers keyed by global layer number), so any
            TP/PP/VPP split maps onto them. Optimizer state: with the non-distributed optimizer
            it is sharded exactly like the weights and reshards the same way; the distributed
            optimizer's default ``fully_sharded_model_space`` format also reshards over
            TP/PP/DP in megatron-core 0.16.1 (``dp_reshardable`` would carry DP only). Also
            here: ``training.global_batch_size`` (consumed-sample accounting and the LR schedule
            meaning change).
``warn``    legitimately changed on resume, reported but never refused: micro_batch_size
            (same GBS gives the same update), train_iters, learning-rate schedule and other
            optimizer hyper-parameters, seed (note: changes GPTDataset shuffling), dropout,
            recomputation, device, software versions (but megatron-core going back to an
            older release line, e.g. a 0.19.x checkpoint under 0.16.x, is refused: its
            dist_checkpointing cannot read what newer lines write).

Run-local settings (``run.*``, ``cluster.*`` except the world size, ``checkpoint.*``,
logging, ``data.cache_dir``, group names) are not compared.

The run lock is :class:`orchestrator.ckpt.lock.RunLock`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from orchestrator.ckpt.manifest import (
    CHECKPOINT_FORMAT,
    CheckpointInfo,
    _default_warn,
    _iter_dirs,
    collect_versions,
    latest_complete,
    save_dir_of,
)
from orchestrator.config.layout import ParallelLayout, padded_vocab_size
from orchestrator.config.schedule import lr_schedule
from orchestrator.config.schema import JobConfig, to_dict
from orchestrator.config.tokenizer import model_vocab_size
from orchestrator.errors import ResumeMismatchError

REFUSE, RESHARD, WARN = "refuse", "reshard", "warn"

_LAYOUT = [  # manifest["layout"] key, Hydra key, kind
    ("tensor_model_parallel_size", "parallelism.tensor_model_parallel_size", RESHARD),
    ("pipeline_model_parallel_size", "parallelism.pipeline_model_parallel_size", RESHARD),
    ("virtual_pipeline_model_parallel_size", "parallelism.virtual_pipeline_model_parallel_size", RESHARD),
    ("data_parallel_size", "parallelism.data_parallel_size", RESHARD),
    ("sequence_parallel", "parallelism.sequence_parallel", RESHARD),
    ("context_parallel_size", "parallelism.context_parallel_size", REFUSE),
    ("expert_model_parallel_size", "parallelism.expert_model_parallel_size", REFUSE),
]
_REFUSE_KEYS = {
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
}
_RESHARD_KEYS = {"training.global_batch_size"}
_IGNORE_PREFIXES = ("run.", "cluster.", "checkpoint.", "parallelism.", "logging.")
_IGNORE_KEYS = {
    "plan",
    "dry_run",
    "gpu",
    "data.cache_dir",
    "data.name",
    "model.name",
    "training.name",
    "training.log_interval",
    "training.timing_warmup_iters",
    "training.exit_after_iters",
    "training.distributed_timeout_minutes",
    "training.eval_interval",
    "training.eval_iters",
    "model.make_vocab_size_divisible_by",
    "model.vocab_size",  # judged by the (padded) vocab
    "model.transformer_impl",
}  # judged by what it resolved to (_layer_spec_mismatch)
_NOTES = {
    "training.global_batch_size": "changes tokens per step and the meaning of the LR schedule; "
    "consumed_samples carries the data position",
    "training.seed": "the dataset shuffle order depends on the seed",
    "data.tokenizer": "token ids would mean different things",
    "optimizer.use_distributed_optimizer": "optimizer state layouts differ; checkpoint.init_from loads weights only",
}
_SCHEDULE_KEYS = {
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


def _flatten(d: dict, prefix: str = "") -> Dict[str, object]:
    out: Dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _normalized(flat: Dict[str, object]) -> Dict[str, object]:
    flat = dict(flat)
    if flat.get("model.num_query_groups") is None:
        flat["model.num_query_groups"] = flat.get("model.num_attention_heads")
    if flat.get("model.ffn_hidden_size") is None and isinstance(flat.get("model.hidden_size"), int):
        flat["model.ffn_hidden_size"] = 4 * flat["model.hidden_size"]
    return flat


def layer_spec_of(config: dict) -> Optional[str]:
    """The layer spec a run with this (``to_dict``) config uses: ``local`` / ``transformer_engine``, or
    None while ``auto`` is undecided (a GPU job decides when it starts: TE when it imports there)."""
    impl = (config.get("model") or {}).get("transformer_impl")
    if impl != "auto":
        return impl
    cluster, device = config.get("cluster") or {}, (config.get("training") or {}).get("device")
    on_cpu = device == "cpu" or (cluster.get("kind") == "local" and not cluster.get("gpus_per_node"))
    return "local" if on_cpu else None


def _layer_spec_mismatch(manifest: dict, cfg: JobConfig) -> Optional[Mismatch]:
    """Refuse a resume across layer specs; warn when the checkpoint's spec is not known."""
    ck = (manifest.get("model") or {}).get("transformer_impl") or layer_spec_of(manifest.get("config") or {})
    req = layer_spec_of(to_dict(cfg))
    if req is None or ck == req:
        return None
    if ck is None:
        return Mismatch(
            "model.transformer_impl",
            "unrecorded",
            req,
            None,
            WARN,
            "the checkpoint did not record which layer spec its GPU job resolved auto to; make sure it was " + req,
        )
    return Mismatch(
        "model.transformer_impl",
        ck,
        req,
        f"model.transformer_impl={ck}",
        REFUSE,
        f"the checkpoint was trained with the {ck} layer spec; loading it into {req} is not "
        "verified (their parameter names and extra state differ)",
    )


GROUP_NAMES = ("optimizer.name",)
"""Names that are a config group's option: the fix picks the option (its lr, schedule... with it), not the name."""


def _kind(key: str) -> Optional[str]:
    if key in _IGNORE_KEYS or key.startswith(_IGNORE_PREFIXES):
        return None
    return REFUSE if key in _REFUSE_KEYS else RESHARD if key in _RESHARD_KEYS else WARN


def _vocab_mismatches(
    manifest: dict, cfg: JobConfig, layout: ParallelLayout, tokenizer: Optional[dict]
) -> List[Mismatch]:
    """The vocabulary and its padding (megatron pads to a multiple of make_vocab_size_divisible_by x TP)."""
    out: List[Mismatch] = []
    model = manifest.get("model") or {}
    vocab = model.get("vocab_size")
    req_vocab = model_vocab_size(cfg, tokenizer["vocab_size"])[0] if (tokenizer or {}).get("vocab_size") else vocab
    if vocab is not None and req_vocab != vocab:
        out.append(Mismatch("model.vocab_size", vocab, req_vocab, None, REFUSE, "the tokenizer's vocabulary changed"))
    ck_div, div, tp = (
        model.get("make_vocab_size_divisible_by"),
        cfg.model.make_vocab_size_divisible_by,
        layout.tensor_model_parallel_size,
    )
    ck_pad = model.get("padded_vocab_size")
    if vocab is not None and ck_pad is not None:
        pad = padded_vocab_size(req_vocab, div, tp)
        if ck_div != div:
            out.append(
                Mismatch(
                    "model.make_vocab_size_divisible_by",
                    ck_div,
                    div,
                    f"model.make_vocab_size_divisible_by={hydra_value(ck_div)}",
                    REFUSE if pad != ck_pad else WARN,
                    f"padded vocab {ck_pad} -> {pad}" if pad != ck_pad else "padded vocab unchanged",
                )
            )
        if pad != ck_pad:
            keep = [
                d
                for d in range(ck_pad // tp, 0, -1)
                if ck_pad % tp == 0 and padded_vocab_size(req_vocab, d, tp) == ck_pad
            ][:1]
            hint = (
                f"; to keep TP={tp} set model.make_vocab_size_divisible_by={keep[0]}"
                if keep
                else f"; no make_vocab_size_divisible_by gives {ck_pad} at TP={tp}"
            )
            out.append(
                Mismatch(
                    "model.padded_vocab_size",
                    ck_pad,
                    pad,
                    None,
                    REFUSE,
                    f"ceil({req_vocab} / ({div} x TP {tp})) x {div * tp} = {pad}" + hint,
                )
            )
    return out


def compare(
    manifest: dict,
    cfg: JobConfig,
    layout: ParallelLayout,
    *,
    data_fingerprint: Optional[str],
    tokenizer: Optional[dict],
) -> List[Mismatch]:
    """Every difference between ``manifest`` and the requested run, in table order.

    ``data_fingerprint``/``tokenizer``: the requested data content fingerprint and tokenizer
    identity when the caller knows them (the job does; a login node may pass None, and then
    only the configured data paths and tokenizer spec are compared).
    """
    out: List[Mismatch] = []
    # 1. parallel layout
    ck_layout, req_layout = manifest["layout"], layout.as_dict()
    for name, key, kind in _LAYOUT:
        if ck_layout.get(name) != req_layout[name]:
            out.append(
                Mismatch(key, ck_layout.get(name), req_layout[name], f"{key}={hydra_value(ck_layout.get(name))}", kind)
            )
    ck_world, world = ck_layout.get("world_size"), layout.world_size
    if ck_world != world:
        c = cfg.cluster
        if c.kind == "local" and c.tasks_per_node is None:
            override, note = None, "follows from parallelism.data_parallel_size on cluster=local"
        elif isinstance(ck_world, int) and ck_world % c.nodes == 0:
            override, note = f"cluster.tasks_per_node={ck_world // c.nodes}", ""
        else:
            override, note = None, f"needs cluster.nodes x cluster.tasks_per_node = {ck_world}"
        out.append(Mismatch("world_size", ck_world, world, override, RESHARD, note))
    # 2. every config leaf (model shape, data, tokenizer spec, batch, optimizer, ...)
    ck_cfg = _normalized(_flatten(manifest.get("config") or {}))
    req_cfg = _normalized(_flatten(to_dict(cfg)))
    described = False
    for key in list(dict.fromkeys([*ck_cfg, *req_cfg])):
        kind = _kind(key)
        if kind is None or ck_cfg.get(key) == req_cfg.get(key):
            continue
        note = _NOTES.get(key, "")
        if key in _SCHEDULE_KEYS and not described:
            note, described = lr_schedule(cfg).describe(int(manifest.get("iteration") or 0) + 1), True
        if key == "training.global_batch_size":
            note += f" (checkpoint consumed {manifest.get('consumed_samples')} samples)"
        group = key[: -len(".name")] if key in GROUP_NAMES else None  # the option the user picks: optimizer=adam
        fix = f"{group}={ck_cfg.get(key)}" if group else f"{key}={hydra_value(ck_cfg.get(key))}"
        out.append(Mismatch(key, ck_cfg.get(key), req_cfg.get(key), fix, kind, note))
    # 3. vocab: megatron pads to a multiple of make_vocab_size_divisible_by x TP
    out += _vocab_mismatches(manifest, cfg, layout, tokenizer)
    # 4. tokenizer and data content, when the caller knows them
    ck_tok = manifest.get("tokenizer") or {}
    for k in sorted(set(ck_tok) | set(tokenizer or {})) if tokenizer is not None else []:
        if k not in ("spec", "vocab_size") and ck_tok.get(k) != tokenizer.get(k):
            out.append(
                Mismatch(
                    f"tokenizer.{k}",
                    ck_tok.get(k),
                    tokenizer.get(k),
                    None,
                    REFUSE,
                    "tokenizer identity differs; restore the checkpoint's tokenizer",
                )
            )
    ck_fp = (manifest.get("data") or {}).get("fingerprint")
    if data_fingerprint is not None and ck_fp is not None and ck_fp != data_fingerprint:
        out.append(
            Mismatch(
                "data.fingerprint",
                ck_fp,
                data_fingerprint,
                None,
                REFUSE,
                "the data's content changed since the checkpoint; restore it or start a new run",
            )
        )
    spec = _layer_spec_mismatch(manifest, cfg)
    if spec is not None:
        out.append(spec)
    # 5. checkpoint format and software versions
    fmt = (manifest.get("checkpoint") or {}).get("format")
    if fmt != CHECKPOINT_FORMAT:
        out.append(Mismatch("checkpoint.format", fmt, CHECKPOINT_FORMAT, None, REFUSE, "only torch_dist is loaded"))
    now = collect_versions()
    for k, v in (manifest.get("versions") or {}).items():
        if k in now and now[k] != v:
            out.append(_version_mismatch(k, v, now[k]))
    return out


def _release_line(version: Optional[str]) -> Optional[tuple]:
    """``"0.19.2"`` -> ``(0, 19)``; None when the version does not start with two numbers."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _version_mismatch(dist: str, saved: Optional[str], running: Optional[str]) -> Mismatch:
    """A software version that changed: allowed, except megatron-core going back to an older release line.

    megatron-core's dist_checkpointing reads what its own and older lines wrote, not what newer ones
    write: a 0.19.x checkpoint (it writes no ``common.pt``) loaded by 0.16.1 failed with an
    AttributeError inside megatron's load. A patch-level difference stays a warning.
    """
    old, new = _release_line(saved), _release_line(running)
    if dist == "megatron-core" and old and new and new < old:
        return Mismatch(
            f"{VERSIONS}{dist}",
            saved,
            running,
            None,
            REFUSE,
            f"saved by megatron-core {saved}, which this megatron-core {running} cannot load (a "
            f"checkpoint loads under its own release line or a newer one); fix: run with "
            f"megatron-core>={old[0]}.{old[1]}, or start a new run",
        )
    return Mismatch(f"{VERSIONS}{dist}", saved, running, None, WARN)


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


def preflight(
    cfg: JobConfig,
    layout: ParallelLayout,
    *,
    data_fingerprint: Optional[str] = None,
    tokenizer: Optional[dict] = None,
    warn: Optional[Callable[[str], None]] = None,
    verify: bool = True,
) -> Optional[CheckpointInfo]:
    """The checkpoint this run will resume from (None: start fresh), or raise ResumeMismatchError.

    Looks in ``<run.dir>/checkpoints``. Torn saves are skipped with a warning; a corrupt newest
    checkpoint raises ManifestError (restore or move it aside). With ``checkpoint.auto_resume=false``
    a save directory that already holds checkpoints is refused instead of overwritten.
    """
    warn = warn or _default_warn
    save_dir = save_dir_of(cfg)
    if not cfg.checkpoint.auto_resume:
        existing = _iter_dirs(save_dir)
        if existing:
            raise ResumeMismatchError(
                f"{save_dir} already holds checkpoints ({existing[0].name} .. {existing[-1].name}) and "
                f"checkpoint.auto_resume=false would train from scratch over them; fix: checkpoint.auto_resume=true "
                f"to resume, or another run.name / run.dir (checkpoint.init_from=<dir> loads weights only)"
            )
        return None
    info = latest_complete(save_dir, warn, verify=verify, skip_corrupt=False)
    if info is None:
        return None
    mismatches = compare(info.manifest, cfg, layout, data_fingerprint=data_fingerprint, tokenizer=tokenizer)
    refused = blocking(mismatches, cfg.checkpoint.allow_reshard)
    if refused:
        only_reshard = all(m.kind == RESHARD for m in refused)
        why = (
            "differs in ways torch_dist can reshard; opt in with checkpoint.allow_reshard=true, or match it"
            if only_reshard
            else "differs in ways a resume cannot carry"
        )
        raise ResumeMismatchError(
            f"cannot resume from {info.path} (iteration {info.iteration}): the requested "
            f"run {why}\n{format_mismatch_table(mismatches)}"
        )
    versions = [m for m in mismatches if m.key.startswith(VERSIONS) and m.kind == WARN]
    if versions:  # one line: an upgrade mid-run is expected; the next manifest's origin keeps the old ones
        warn(
            f"versions changed since {info.path.name}: "
            + ", ".join(f"{m.key[len(VERSIONS) :]} {m.checkpoint} -> {m.requested}" for m in versions)
        )
    others = [m for m in mismatches if m not in versions]
    if others:
        warn(f"resuming from {info.path} with changes:\n{format_mismatch_table(others)}")
    info.mismatches = mismatches
    return info


INIT_SHAPE_KEYS = {k for k in _REFUSE_KEYS if k.startswith("model.") and k != "model.seq_length"} | {
    "model.padded_vocab_size"
}
"""What ``checkpoint.init_from``'s weights must match to load (their shapes); the layout may differ."""


def init_from_refusal(manifest: dict, cfg: JobConfig, layout: ParallelLayout) -> Optional[str]:
    """Why ``checkpoint.init_from``'s weights cannot load into the requested model (its diff table), or None."""
    bad = [m for m in compare(manifest, cfg, layout, data_fingerprint=None, tokenizer=None) if m.key in INIT_SHAPE_KEYS]
    if not bad:
        return None
    return (
        f"checkpoint.init_from={cfg.checkpoint.init_from}: its weights do not fit the requested model "
        f"({', '.join(m.key for m in bad)} differ); fix: the matching model overrides below, or a checkpoint "
        f"of this model\n{format_mismatch_table(bad)}"
    )


def origin_of(info: CheckpointInfo) -> dict:
    """The ``origin`` entry for manifests written by a run resumed from ``info``."""
    resharded = {m.key: [m.checkpoint, m.requested] for m in info.mismatches if m.kind == RESHARD}
    changed = any(m.key.startswith(VERSIONS) for m in info.mismatches)
    return {
        "resumed_from": str(info.path),
        "iteration": info.iteration,
        "resharded": resharded,
        "from_layout": (info.manifest or {}).get("layout") if resharded else None,
        "from_versions": (info.manifest or {}).get("versions") if changed else None,
    }


# ---- run lock -------------------------------------------------------------------------
