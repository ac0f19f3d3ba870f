"""Megatron-LM flags in, orchestrator settings out: :func:`convert` maps a :class:`Source`.

Every flag of the source ends in exactly one place: a setting (with the flag as its comment),
``flagged`` (a mistake for a GPT job, with the reason; mapped too when it has a meaning here) or
``not_converted`` (no equivalent, with the reason). Flags Megatron-LM would have defaulted get
Megatron-LM's default written out (``defaults``), so the imported run is the one Megatron-LM
would have started; values Megatron-LM derives (VPP from layers per virtual stage, the SwiGLU
MLP width, warm-up from a fraction, the global batch from the world size) are written with their
arithmetic (``derived``). What had to be assumed (no world size, no tokenizer) is said
(``assumed``). Megatron-LM's derivation rules are :mod:`orchestrator.convert.rules`, the launcher
side (``#SBATCH``, ``srun``, ``torchrun``, exports) is :mod:`orchestrator.convert.launcher`.
Pure Python; the result is rendered by :mod:`orchestrator.convert.experiment_file`.
"""

from __future__ import annotations

import re
from typing import Dict, List, Optional

from orchestrator.convert import megatron_args as M
from orchestrator.convert.conversion import Conversion, fail, number
from orchestrator.convert.sources import Arg, Source

REQUIRED = (
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--seq-length",
    "--micro-batch-size",
    "--lr",
    "--train-iters",
)
"""Flags Megatron-LM cannot run without (it has no default); the orchestrator's value stays when absent."""
DEFAULT = "Megatron-LM default"
"""The source of a setting no flag and no rule gave (its YAML comment)."""


def _plain(conv: Conversion, r: M.Flag, arg: Arg) -> None:
    if r.kind == "on":
        if arg.values:
            raise fail(arg.flag, f"takes no value (got {' '.join(arg.values)})", f"write `{arg.flag}` alone")
        value = r.value
    else:
        value = number(arg, r.kind)
    previous = conv.settings.get(r.key)
    if previous is not None and previous.source.split()[0] != arg.flag:
        conv.flagged.append(
            f"{arg.text}: {r.key} is also set by {previous.source}; Megatron-LM refuses or "
            f"ignores one of them; {arg.flag} is used"
        )
    conv.set(r.key, value, arg.text)
    if r.note:
        conv.flagged.append(f"{arg.text}: {r.note}")


def _classify(conv: Conversion, given: Dict[str, Arg]) -> None:
    """Plain flags become settings; known mistakes and flags without an equivalent are listed."""
    for flag, arg in given.items():
        r = M.row(flag)
        if r is None:
            conv.not_converted.append(
                f"{arg.text}: not a flag this converter knows (not in its table, "
                "orchestrator/convert/megatron_args.py), so nothing here sets it; if the run "
                "depends on it, set the matching key in the written file"
            )
            conv.status[flag] = "not converted"
        elif r.kind == "none":
            conv.not_converted.append(f"{arg.text}: {r.note}")
            conv.status[flag] = "not converted"
        elif r.kind == "wrong":
            conv.flagged.append(f"{arg.text}: {r.note}; not converted")
            conv.status[flag] = "flagged"
        else:
            conv.status[flag] = "flagged" if r.note else "mapped"
            if r.kind != "special":
                _plain(conv, r, arg)


def _undecided(conv: Conversion) -> None:
    """Flags inside an ``if`` only the running script decides: listed (not converted), each with that ``if``."""
    for arg, where in conv.source.undecided:
        conv.not_converted.append(
            f"{arg.text}: inside {where}, which bash decides only when the script runs; not read; fix: --var NAME=VALUE "
            "for its variables (or move the flag out of the if) and convert again"
        )
        conv.status[f"{arg.flag} ({arg.where})"] = "not converted"


def _defaults(conv: Conversion, given: Dict[str, Arg]) -> None:
    """Megatron-LM's default for every key no flag set; the required flags that are missing are said."""
    for key in M.mapped_keys():
        if key in conv.settings:
            continue
        default = M.megatron_default(key)
        if default is not M.KEEP:
            conv.set(key, default, DEFAULT)
    missing = [f for f in REQUIRED if f not in given and M.row(f).key not in conv.settings]
    if missing and not conv.from_export:
        conv.assumed.append(
            f"not given (Megatron-LM requires them): {', '.join(missing)}; the orchestrator's "
            f"defaults stay for {', '.join(M.row(f).key for f in missing)}"
        )


def undefined_variables(source: Source) -> Dict[str, List[str]]:
    """Each variable the script leaves undefined (``$1``, ``$DATA_PATH``) -> the converted flags whose
    values need it, in the order found; flags whose value is not read (not converted, or only their
    presence counts, :func:`~orchestrator.convert.rules.unread_values`) need none."""
    from orchestrator.convert.rules import unread_values

    unread = unread_values({arg.flag: arg for arg in source.args})
    out: Dict[str, List[str]] = {}
    for arg in source.args:
        r = M.row(arg.flag)
        if r is None or r.kind in ("none", "wrong") or arg.flag in unread:
            continue
        for name in re.findall(r"\$\{?([A-Za-z_]\w*|\d+)", " ".join(arg.values)):
            flags = out.setdefault(name, [])
            if arg.flag not in flags:
                flags.append(arg.flag)
    return dict(sorted(out.items(), key=lambda kv: (not kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0)))


def _defaults_written(conv: Conversion) -> List[str]:
    """The "defaults written out" list: each key that still holds Megatron-LM's default once every rule
    ran (a rule deriving it, such as warm-up from --lr-warmup-fraction, takes it off the list)."""
    out = []
    for key, s in conv.settings.items():
        if s.source == DEFAULT and s.value is not None:
            first = M.rows_for(key)[0]
            out.append(
                f"{key}={s.value} (no {first.flag})" if first.kind in ("on", "special") else f"{first.flag} {s.value}"
            )
    return out


def schema_keys() -> List[str]:
    """Every dotted leaf key of :class:`~orchestrator.config.schema.JobConfig`, in field order."""
    from orchestrator.config.keys import is_section
    from orchestrator.config.keys import schema_keys as all_keys
    from orchestrator.config.schema import JobConfig

    return [k for k, f in all_keys(JobConfig).items() if not is_section(f)]


def convert(
    source: Source,
    name: str,
    nodes: Optional[int] = None,
    gpus_per_node: Optional[int] = None,
    gpu: Optional[str] = None,
) -> Conversion:
    """Map ``source`` onto orchestrator settings (raises ConfigError with ``<key>: <what>; fix: <how>``)."""
    from orchestrator.convert import launcher
    from orchestrator.convert.rules import batches_and_schedule, checkpoints, data, model, tensorboard, tokenizer
    from orchestrator.convert.rules_parallel import data_parallel, sequence_parallel, virtual_pipeline

    conv = Conversion(name=name, source=source)
    groups, extras = launcher.orchestrator_lines(source)
    conv.from_export = bool(groups)
    given: Dict[str, Arg] = {}
    for arg in source.args:
        if arg.flag in given:
            conv.flagged.append(
                f"{arg.flag} given twice ({given[arg.flag].text}, {arg.text}); the last counts, as in Megatron-LM"
            )
        given[arg.flag] = arg
    _classify(conv, given)
    _undecided(conv)
    for rule in (tokenizer, data, checkpoints, tensorboard, model, virtual_pipeline, sequence_parallel):
        rule(conv, given)
    _defaults(conv, given)
    launcher.cluster(conv, nodes, gpus_per_node)
    data_parallel(conv)
    batches_and_schedule(conv, given)
    if not conv.from_export:
        for key in ("model.name", "parallelism.name"):
            conv.set(key, name, "the experiment's name")
        if "run.name" not in conv.settings:
            conv.set("run.name", name, "the experiment's name (no --save)")
    if not conv.from_export:
        conv.defaults += _defaults_written(conv)
    if gpu:
        conv.set("gpu", gpu, "--gpu (planner preset)")
    conv.groups.update(groups)
    for key, value in extras.items():
        conv.set(key, value, "orchestrator line")
    known = set(schema_keys())
    for key in [k for k in conv.settings if k not in known]:
        s = conv.settings.pop(key)
        conv.pending_schema.append(f"{key}: {s.value!r} ({s.source}) - this schema has no {key} yet")
    return conv
