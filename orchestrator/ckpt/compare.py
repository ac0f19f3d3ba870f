"""Comparing a checkpoint's manifest with the requested run: every difference, its kind (refuse, reshard,
warn) and the override that would match (the rules :mod:`orchestrator.ckpt.resume` documents and applies)."""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from orchestrator.ckpt.manifest import CHECKPOINT_FORMAT, collect_versions
from orchestrator.ckpt.mismatch import (
    GROUP_NAMES,
    LAYOUT_KEYS,
    NOTES,
    REFUSE,
    RESHARD,
    SCHEDULE_KEYS,
    VERSIONS,
    WARN,
    Mismatch,
    hydra_value,
    key_kind,
)
from orchestrator.config.layout import ParallelLayout, padded_vocab_size
from orchestrator.config.schedule import lr_schedule
from orchestrator.config.schema import JobConfig, to_dict
from orchestrator.config.tokenizer import model_vocab_size


def _flatten(d: dict, prefix: str = "") -> Dict[str, object]:
    """Leaves by dotted key; an empty mapping is null (``model.megatron: {}`` sets nothing, like null or no key)."""
    out: Dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = None if v == {} else v
    return out


def _normalized(flat: Dict[str, object]) -> Dict[str, object]:
    flat = dict(flat)
    for key, default in (("model.rotary_base", 10000), ("model.rope_scaling_factor", 8.0)):  # older manifests
        flat.setdefault(key, default)
    flat.setdefault("model.rope_scaling", None)
    flat.setdefault("model.norm_epsilon", 1e-5)
    flat.setdefault("model.add_qkv_bias", None)
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
    for name, key, kind in LAYOUT_KEYS:
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
        kind = key_kind(key)
        if kind is None or ck_cfg.get(key) == req_cfg.get(key):
            continue
        note = NOTES.get(key, "")
        if key in SCHEDULE_KEYS and not described:
            note, described = lr_schedule(cfg).describe(int(manifest.get("iteration") or 0) + 1), True
        if key == "training.global_batch_size":
            note += f" (checkpoint consumed {manifest.get('consumed_samples')} samples)"
        group = key[: -len(".name")] if key in GROUP_NAMES else None  # the option the user picks: optimizer=adam
        fix = f"{group}={ck_cfg.get(key)}" if group else f"{key}={hydra_value(ck_cfg.get(key))}"
        out.append(Mismatch(key, ck_cfg.get(key), req_cfg.get(key), fix, kind, note))
    # 3. vocab: megatron pads to a multiple of make_vocab_size_divisible_by x TP
    out += _vocab_mismatches(manifest, cfg, layout, tokenizer)
    out += _identity_mismatches(manifest, cfg, data_fingerprint, tokenizer)
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


def _identity_mismatches(
    manifest: dict, cfg: JobConfig, data_fingerprint: Optional[str], tokenizer: Optional[dict]
) -> List[Mismatch]:
    """The tokenizer's and the data's identity (when the caller knows them) and the layer spec that ran."""
    out: List[Mismatch] = []
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
    return out
