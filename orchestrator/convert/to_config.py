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

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from orchestrator.convert import megatron_args as M
from orchestrator.convert.sources import Arg, Source
from orchestrator.errors import ConfigError

REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads", "--seq-length", "--micro-batch-size",
            "--lr", "--train-iters")
"""Flags Megatron-LM cannot run without (it has no default); the orchestrator's value stays when absent."""


@dataclass
class Setting:
    """A value for one dotted key and where it came from (written as the YAML comment)."""

    value: Any
    source: str


@dataclass
class Conversion:
    """The mapped experiment: group choices, settings and every finding, in the order found."""

    name: str
    source: Source
    groups: Dict[str, str] = field(default_factory=dict)
    settings: Dict[str, Setting] = field(default_factory=dict)
    flagged: List[str] = field(default_factory=list)
    not_converted: List[str] = field(default_factory=list)
    derived: List[str] = field(default_factory=list)
    assumed: List[str] = field(default_factory=list)
    defaults: List[str] = field(default_factory=list)
    pending_schema: List[str] = field(default_factory=list)
    status: Dict[str, str] = field(default_factory=dict)
    """Each flag of the source -> "mapped", "flagged" or "not converted" (never absent)."""
    world_size: Optional[int] = None
    tokenizer_vocab: Optional[int] = None
    """Vocabulary known from the tokenizer flags (also when this schema cannot store data.vocab_size yet)."""
    from_export: bool = False
    """The source carries ``# orchestrator: defaults ...`` (an export of ours)."""

    def set(self, key: str, value: Any, source: str) -> None:
        """Set ``key`` (dotted) to ``value``, remembering ``source`` for the file's comment."""
        self.settings[key] = Setting(value, source)

    def get(self, key: str, default: Any = None) -> Any:
        """The value set for ``key`` so far, or ``default``."""
        s = self.settings.get(key)
        return default if s is None else s.value

    @property
    def vocab_size(self) -> Optional[int]:
        """The tokenizer vocabulary the plan must use (None: the planner reads data.tokenizer)."""
        return self.get("data.vocab_size", self.tokenizer_vocab)


def fail(key: str, what: str, fix: str) -> ConfigError:
    """The one error shape: ``<key>: <what>; fix: <how>``."""
    return ConfigError(f"{key}: {what}; fix: {fix}")


def number(arg: Arg, kind: str):
    """The one value of ``arg`` as ``kind`` (int, float or str; "" is None); ConfigError otherwise."""
    if len(arg.values) != 1:
        raise fail(arg.flag, f"expects one value, got {len(arg.values)} ({' '.join(arg.values) or 'none'})",
                   f"write `{arg.flag} VALUE`")
    text = arg.values[0]
    if "$" in text:
        raise fail(arg.flag, f"{text!r} contains a shell variable the script does not define",
                   "define it in the script or pass --var NAME=VALUE")
    if kind == "str" and text == "":
        return None  # Megatron-LM's "" (off) is our null
    try:
        return {"int": int, "float": float, "str": str}[kind](text)
    except ValueError:
        raise fail(arg.flag, f"{text!r} is not {'an integer' if kind == 'int' else 'a number'}",
                   f"give {arg.flag} a {'whole number' if kind == 'int' else 'number'}") from None


def _plain(conv: Conversion, r: M.Flag, arg: Arg) -> None:
    if r.kind == "on":
        if arg.values:
            raise fail(arg.flag, f"takes no value (got {' '.join(arg.values)})", f"write `{arg.flag}` alone")
        value = r.value
    else:
        value = number(arg, r.kind)
    previous = conv.settings.get(r.key)
    if previous is not None and previous.source.split()[0] != arg.flag:
        conv.flagged.append(f"{arg.text}: {r.key} is also set by {previous.source}; Megatron-LM refuses or "
                            f"ignores one of them; {arg.flag} is used")
    conv.set(r.key, value, arg.text)
    if r.note:
        conv.flagged.append(f"{arg.text}: {r.note}")


def _classify(conv: Conversion, given: Dict[str, Arg]) -> None:
    """Plain flags become settings; known mistakes and flags without an equivalent are listed."""
    for flag, arg in given.items():
        r = M.row(flag)
        if r is None:
            conv.not_converted.append(f"{arg.text}: no equivalent here")
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


def _defaults(conv: Conversion, given: Dict[str, Arg]) -> None:
    """Megatron-LM's default for every key no flag set; the required flags that are missing are said."""
    for key in M.mapped_keys():
        if key in conv.settings:
            continue
        default = M.megatron_default(key)
        if default is not M.KEEP:
            conv.set(key, default, "Megatron-LM default")
            first = M.rows_for(key)[0]
            if not conv.from_export and default is not None:
                conv.defaults.append(f"{key}={default} (no {first.flag})" if first.kind in ("on", "special")
                                     else f"{first.flag} {default}")
    missing = [f for f in REQUIRED if f not in given and M.row(f).key not in conv.settings]
    if missing and not conv.from_export:
        conv.assumed.append(f"not given (Megatron-LM requires them): {', '.join(missing)}; the orchestrator's "
                            f"defaults stay for {', '.join(M.row(f).key for f in missing)}")


def schema_keys(cls=None, prefix: str = "") -> List[str]:
    """Every dotted leaf key of :class:`~orchestrator.spec.schema.JobConfig`, in field order."""
    if cls is None:
        from orchestrator.spec.schema import JobConfig as cls
    keys = []
    for f in dataclasses.fields(cls):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        if dataclasses.is_dataclass(sub):
            keys += schema_keys(type(sub), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def convert(source: Source, name: str, nodes: Optional[int] = None, gpus_per_node: Optional[int] = None,
            gpu: Optional[str] = None) -> Conversion:
    """Map ``source`` onto orchestrator settings (raises ConfigError with ``<key>: <what>; fix: <how>``)."""
    from orchestrator.convert import launcher
    from orchestrator.convert.rules import (batches_and_schedule, checkpoints, data, data_parallel, model,
                                            tensorboard, tokenizer, virtual_pipeline)

    conv = Conversion(name=name, source=source)
    groups, extras = launcher.orchestrator_lines(source)
    conv.from_export = bool(groups)
    given: Dict[str, Arg] = {}
    for arg in source.args:
        if arg.flag in given:
            conv.flagged.append(f"{arg.flag} given twice ({given[arg.flag].text}, {arg.text}); the last counts, "
                                "as in Megatron-LM")
        given[arg.flag] = arg
    _classify(conv, given)
    for rule in (tokenizer, data, checkpoints, tensorboard, model, virtual_pipeline):
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
