"""A composed config out, a Megatron-LM launch script in: :func:`export`.

The flags come from walking :data:`~orchestrator.convert.megatron_args.TABLE` backwards: each
exporting row prints its flag unless the value is Megatron-LM's default (then the flag is left
out and Megatron-LM arrives at the same value); rows of kind ``special`` have an exporter here
(:data:`EXPORTERS`). The launcher lines come from :mod:`orchestrator.convert.launcher`.

What no Megatron-LM flag or launcher option says (group choices, a CPU run's task layout, our
data kinds, a stated DP) travels on ``# orchestrator:`` comment lines, which Megatron-LM's shell
ignores and :func:`~orchestrator.convert.to_config.convert` reads back; they are found by
importing the flags once and comparing the composed result with ``cfg``, so that importing the
export gives back ``cfg`` exactly. Pure Python (composes with Hydra; no torch).
"""

from __future__ import annotations

import dataclasses
import shlex
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Dict, List, Optional

from orchestrator.config.compose import CONFIG_GROUPS
from orchestrator.config.tokenizer import TOKENIZER_TYPES
from orchestrator.convert import launcher, ramp_flags
from orchestrator.convert import megatron_args as M
from orchestrator.convert.experiment_file import compose, json_value, write

PROGRAM = "pretrain_gpt.py"


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def _get(cfg, key: str) -> Any:
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part, None)
    return obj


def _vpp(cfg) -> List[List[str]]:
    p = cfg.parallelism
    if p.virtual_pipeline_model_parallel_size is None:
        return []
    per_chunk = cfg.model.num_layers // (p.pipeline_model_parallel_size * p.virtual_pipeline_model_parallel_size)
    return [["--num-layers-per-virtual-pipeline-stage", str(per_chunk)]]


def _gqa(cfg) -> List[List[str]]:
    groups = cfg.model.num_query_groups
    return [] if groups is None else [["--group-query-attention"], ["--num-query-groups", str(groups)]]


def _ffn(cfg) -> List[List[str]]:
    m = cfg.model
    if m.ffn_hidden_size is not None:
        return [["--ffn-hidden-size", str(m.ffn_hidden_size)]]
    if m.activation == "swiglu":  # ours: null = 4h; Megatron-LM's null with --swiglu is 8h/3
        return [["--ffn-hidden-size", str(4 * m.hidden_size)]]
    return []


def _checkpoints(cfg) -> List[List[str]]:
    directory = str(PurePosixPath(cfg.run.root) / cfg.run.name / "checkpoints")
    out = []
    if cfg.checkpoint.save_at_end or cfg.checkpoint.save_interval:
        out.append(["--save", directory])
        if not cfg.checkpoint.save_interval:  # validate_args asserts an interval with --save; it saves at the end too
            out.append(["--save-interval", str(cfg.training.train_iters)])
    if cfg.checkpoint.auto_resume:
        out.append(["--load", directory])
    return out


def auto_interval(cfg) -> int:
    """The interval ``checkpoint.save_interval=auto`` starts with for ``cfg`` (the plan's Young–Daly interval
    at its predicted step time and save cost, clipped to the auto bounds): Megatron-LM saves at a fixed
    interval, so the export says this one."""
    from orchestrator.pipeline import goodput_forecast
    from orchestrator.plan.memory import plan

    return goodput_forecast(cfg, plan(cfg).step_time_s).interval_iters


def _save_interval(cfg) -> List[List[str]]:
    value = cfg.checkpoint.save_interval
    if value == "auto":
        return [["--save-interval", str(auto_interval(cfg))]]
    return [["--save-interval", str(value)]] if value else []


def _tensorboard(cfg) -> List[List[str]]:
    if not _get(cfg, "logging.tensorboard"):
        return []
    return [["--tensorboard-dir", str(PurePosixPath(cfg.run.root) / cfg.run.name / "tensorboard")]]


def _data(cfg) -> List[List[str]]:
    d = cfg.data
    if d.kind == "indexed":
        words = [w for pair in zip(map(_text, d.weights), d.paths) for w in pair] if d.weights else list(d.paths)
        return [["--data-path", *words]]
    if d.kind == "mock":
        return [["--mock-data"]]
    return []


def _byte_model_vocab(cfg) -> Optional[int]:
    """The vocabulary a byte-tokenized job's model is built with when it is not the byte tokenizer's 258: the
    preset's own tokenizer's (``model.vocab_size``, config.tokenizer.model_vocab_size's rule); else None."""
    from orchestrator.config.tokenizer import model_vocab_size

    size, _ = model_vocab_size(cfg, int(M.BYTE_NULL_TOKENIZER[0][1]))
    return size if size != int(M.BYTE_NULL_TOKENIZER[0][1]) else None


def _byte_tokenizer_comment(cfg) -> str:
    """What the exported NullTokenizer stands for, with the vocabulary padded as Megatron pads it at this TP."""
    from orchestrator.config.layout import padded_vocab_size

    size = _byte_model_vocab(cfg) or int(M.BYTE_NULL_TOKENIZER[0][1])
    tp = cfg.parallelism.tensor_model_parallel_size
    padded = padded_vocab_size(size, cfg.model.make_vocab_size_divisible_by, tp)
    if size == int(M.BYTE_NULL_TOKENIZER[0][1]):
        return (
            "# data.tokenizer=byte: NullTokenizer with --vocab-size 258 and these eod/pad ids has the same ids and "
            f"embedding (bytes 0-255, eod 256, pad 257; padded to {padded} at TP {tp})."
        )
    return (
        f"# data.tokenizer=byte with model.vocab_size={size} ({cfg.model.name}'s tokenizer): NullTokenizer with "
        f"--vocab-size {size} builds the same embedding (padded to {padded} at TP {tp}); for its real ids pass "
        "--tokenizer-type HuggingFaceTokenizer --tokenizer-model <its tokenizer directory> instead."
    )


def _tokenizer(cfg) -> List[List[str]]:
    d = cfg.data
    size = getattr(d, "vocab_size", None)
    if d.tokenizer == "byte":
        built = _byte_model_vocab(cfg)
        if built is not None:  # the preset's tokenizer's vocabulary: the same embedding, the byte ids inside it
            return [
                ["--tokenizer-type", "NullTokenizer"],
                ["--vocab-size", str(built)],
                *[list(pair) for pair in M.BYTE_NULL_TOKENIZER if pair[0] != "--vocab-size"],
            ]
        return [["--tokenizer-type", "NullTokenizer"], *[list(pair) for pair in M.BYTE_NULL_TOKENIZER]]
    if d.tokenizer not in TOKENIZER_TYPES:  # a tokenizer.json or its directory
        path = PurePosixPath(d.tokenizer)
        local_dir = path.name == "tokenizer.json" and str(path.parent).startswith(("/", ".", "~"))
        model = str(path.parent) if local_dir else d.tokenizer  # a directory stays one
        out = [["--tokenizer-type", "HuggingFaceTokenizer"], ["--tokenizer-model", model]]
    elif d.tokenizer == "NullTokenizer":
        size = size or 1  # megatron-core's NullTokenizer: `size` ids, the eod stated
        return [
            ["--tokenizer-type", "NullTokenizer"],
            ["--vocab-size", str(size)],
            ["--null-tokenizer-eod-id", str(d.eod_id if d.eod_id is not None else size - 1)],
        ]
    else:
        out = [["--tokenizer-type", d.tokenizer]]
        for flag, key in (
            ("--vocab-file", "vocab_file"),
            ("--merge-file", "merge_file"),
            ("--tokenizer-model", "tokenizer_model"),
        ):
            if getattr(d, key, None):
                out.append([flag, getattr(d, key)])
    if size is not None and not (d.tokenizer == "GPT2BPETokenizer" and size == M.GPT2_BPE_VOCAB):
        out.append(["--vocab-size", str(size)])
    return out


def _overlap(flag: str, which: int) -> Callable[[Any], List[List[str]]]:
    def exporter(cfg) -> List[List[str]]:
        from orchestrator.config.machine import runs_on_cpu
        from orchestrator.config.megatron_fields import data_parallel_size, overlaps

        return [[flag]] if overlaps(cfg, not runs_on_cpu(cfg), data_parallel_size(cfg))[which] else []

    return exporter


def _experts(cfg) -> List[List[str]]:
    """``--num-experts`` and the dispatcher the job builds (all-to-all; Megatron-LM's default is allgather)."""
    n = cfg.model.num_moe_experts
    return [["--num-experts", str(n)], ["--moe-token-dispatcher-type", "alltoall"]] if n else []


EXPORTERS: Dict[str, Callable[[Any], List[List[str]]]] = {
    "--rampup-batch-size": ramp_flags.export_rampup,
    "--train-iters": ramp_flags.in_samples("--train-iters", "--train-samples", "training.train_iters"),
    "--lr-decay-iters": ramp_flags.in_samples("--lr-decay-iters", "--lr-decay-samples", "optimizer.lr_decay_iters"),
    "--lr-warmup-iters": ramp_flags.in_samples("--lr-warmup-iters", "--lr-warmup-samples", "optimizer.lr_warmup_iters"),
    "--num-experts": _experts,
    "--overlap-grad-reduce": _overlap("--overlap-grad-reduce", 0),
    "--overlap-param-gather": _overlap("--overlap-param-gather", 1),
    "--num-layers-per-virtual-pipeline-stage": _vpp,
    "--group-query-attention": _gqa,
    "--ffn-hidden-size": _ffn,
    "--save": _checkpoints,
    "--save-interval": _save_interval,
    "--tensorboard-dir": _tensorboard,
    "--data-path": _data,
    "--tokenizer-type": _tokenizer,
}
"""Exporters of the ``special`` rows that export (the table's import-only specials need none)."""


def _passthrough(cfg) -> List[List[str]]:
    """``model/parallelism/optimizer.megatron`` as Megatron-LM's flags of the same names (``tp_comm_overlap: true``
    -> ``--tp-comm-overlap``; a value -> ``--bucket-size 1000000``; false: Megatron-LM's default for its store-true
    flags, left out). They also travel on ``# orchestrator:`` lines, so ``from-megatron`` gets them back exactly."""
    from orchestrator.config.megatron_passthrough import passthrough

    out: List[List[str]] = []
    for fields in passthrough(cfg).values():
        for name, value in sorted(fields.items()):
            flag = "--" + name.replace("_", "-")
            if value is True:
                out.append([flag])
            elif value is not False and value is not None:
                out.append([flag, *map(_text, value if isinstance(value, (list, tuple)) else [value])])
    return out


def flags(cfg) -> List[List[str]]:
    """``pretrain_gpt.py`` flags of ``cfg``, each ``[flag, values...]``, in table order, then the pass-through
    fields' (:func:`_passthrough`)."""
    out: List[List[str]] = []
    for r in M.TABLE:
        if not r.export or r.key is None or r.kind in ("none", "wrong"):
            continue
        if r.kind == "special" or r.flag in EXPORTERS:
            out += EXPORTERS[r.flag](cfg)
            continue
        value = _get(cfg, r.key)
        if r.kind == "on":
            if value == r.value:
                out.append([r.flag])
        elif (
            value is not None
            and value not in r.omit
            and not (r.default is not M.KEEP and value == r.default and type(value) is type(r.default))
        ):
            out.append([r.flag, _text(value)])
    return out + _passthrough(cfg)


def _quote(word: str) -> str:
    return f'"{word}"' if word.startswith("$") else shlex.quote(word)


def render(cfg, overrides: List[str], world: int, extras: Dict[str, Any]) -> str:
    """The launch script: header, ``# orchestrator:`` lines, ``#SBATCH``, exports, setup, launch line."""
    c = cfg.cluster
    nodes = c.nodes if c.kind == "slurm" else 1
    ranks = world // nodes
    lines = [
        "#!/bin/bash",
        f"# Megatron-LM launch of `python -m orchestrator {' '.join(overrides)}`",
        "# (python -m orchestrator.convert to-megatron; `from-megatron` imports it back unchanged).",
        f"# world size {world} = {nodes} node(s) x {ranks} processes; checked by orchestrator's validation.",
        "# `# orchestrator:` lines carry what Megatron-LM has no flag for; its shell ignores them.",
    ]
    if cfg.data.kind in ("stdlib", "jsonl"):
        lines.append(
            f"# data={cfg.data.name}: Megatron-LM reads prepared .bin/.idx data; prepare it and add "
            "--data-path (the orchestrator prepares it into data.cache_dir)."
        )
    if cfg.data.tokenizer == "byte":
        lines.append(_byte_tokenizer_comment(cfg))
    if cfg.training.rampup_batch_size is not None:
        lines.append(ramp_flags.newer_megatron_comment(cfg))
    choices = [f"{g}={getattr(cfg, g).name}" for g in CONFIG_GROUPS if _is_option(g, getattr(cfg, g).name)]
    lines.append("# orchestrator: defaults " + " ".join(choices))
    lines += [f"# orchestrator: {key}={json_value(value)}" for key, value in extras.items()]
    if c.kind == "slurm":
        lines += launcher.slurm_lines(cfg, ranks)
    lines += [f"export {k}={shlex.quote(str(v))}" for k, v in (c.env or {}).items()]
    lines += list(c.setup or [])
    if c.kind == "slurm" or nodes > 1:
        lines.append('MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)')
    words = launcher.launch_words(cfg, nodes, ranks)
    lines.append(" ".join(_quote(w) for w in words) + f" {PROGRAM} \\")
    body = [" ".join(shlex.quote(w) for w in group) for group in flags(cfg)]
    lines += [f"    {item} \\" for item in body[:-1]] + [f"    {body[-1]}"]
    return "\n".join(lines) + "\n"


def _is_option(group: str, name: str) -> bool:
    from orchestrator.config.compose import conf_dir

    return (conf_dir() / group / f"{name}.yaml").is_file()


def leaves(cfg, prefix: str = "") -> Dict[str, Any]:
    """Every dotted leaf key of a JobConfig with its value (dict- and list-valued keys whole)."""
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            out.update(leaves(value, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = value
    return out


def reimport(text: str) -> Any:
    """Compose what ``from-megatron`` makes of ``text`` (a script) — the round trip's other half."""
    from orchestrator.convert.shell import parse_shell
    from orchestrator.convert.to_config import convert

    conv = convert(parse_shell(text, "<export>", {}), "_to_megatron_roundtrip")
    with tempfile.TemporaryDirectory(prefix="orchestrator-convert-") as tmp:
        write(conv, Path(tmp))
        return compose(["+experiment=_to_megatron_roundtrip"], Path(tmp))


def export(cfg, overrides: List[str], world: int) -> str:
    """The script for ``cfg``: flags + launcher, plus the ``# orchestrator:`` lines that make
    ``from-megatron`` give back ``cfg`` exactly (``run.dir`` is derived and not compared)."""
    first = render(cfg, overrides, world, {})
    back = leaves(reimport(first))
    extras = {k: v for k, v in leaves(cfg).items() if k != "run.dir" and back.get(k) != v}
    return render(cfg, overrides, world, extras) if extras else first
