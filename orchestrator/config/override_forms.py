"""Command-line forms of values that Hydra's grammar makes awkward, read before composing
(:mod:`orchestrator.config.compose`).

- A string of comma-separated numbers (``data.split``, Megatron's ``"98,2,0"``): bare, ``data.split=98,2,0`` is a
  sweep; Hydra's list ``data.split=[98,2,0]`` is taken and written as that string (:func:`lists_as_strings`); the
  quoted form ``"data.split='98,2,0'"`` is the string itself. A sweep outside ``-m`` is told both
  (:func:`sweep_refusal`).
- A config group added twice (``+experiment=a +experiment=b``) is one line naming it, fixed by choosing once
  (:func:`repeated_group_refusal`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from orchestrator.errors import ConfigError

LIST_AS_STRING = ("data.split",)
"""String keys whose value is a comma-separated list: Hydra's list form is joined into that string."""


def lists_as_strings(overrides: List[str], parsed: List[Any]) -> List[str]:
    """``overrides`` with ``data.split=[98,2,0]`` (any ``+`` kept) as ``data.split='98,2,0'`` (``parsed``: Hydra's
    parse of ``overrides``, one each)."""
    out = []
    for raw, o in zip(overrides, parsed):
        if o.key_or_group in LIST_AS_STRING and not o.is_sweep_override() and isinstance(o.value(), list):
            plus = raw[: len(raw) - len(raw.lstrip("+"))]
            raw = f"{plus}{o.key_or_group}='{','.join(str(v) for v in o.value())}'"
        out.append(raw)
    return out


def sweep_refusal(o: Any, field: Optional[Any]) -> ConfigError:
    """The line for a sweep override ``o`` outside ``-m`` (``field``: the schema's dataclass field of its key, or
    None): one job per value with -m, or the one value a string key (quoted, as bash passes it) or a list key takes."""
    key, line = o.key_or_group, o.input_line
    text = line.split("=", 1)[1] if "=" in line else ""
    if field is not None and str(field.type) in ("str", "Optional[str]"):
        listed = f", or {key}=[{text}]" if key in LIST_AS_STRING else ""
        one = f"\"{key}='{text}'\" for the one string {text!r} (quoted: a bare comma is a sweep){listed}"
    else:
        one = f"{key}=[{text}] for a list value"
    return ConfigError(
        f"{line}: a sweep (several values) needs -m; fix: python -m orchestrator -m ... to run one job per value, "
        f"or {one}"
    )


def repeated_group_refusal(parsed: List[Any], options: Dict[str, List[str]]) -> Optional[ConfigError]:
    """The line for a config group added by more than one override (``+experiment=X +experiment=X``, which Hydra
    refuses; a group chosen twice without ``+`` takes the last), or None."""
    from hydra.core.override_parser.types import OverrideType

    seen: Dict[str, str] = {}
    for o in parsed:
        key = o.key_or_group
        if key not in options or o.type != OverrideType.ADD:  # model=a model=b: the last wins, as in Hydra
            continue
        if key in seen:
            return ConfigError(
                f"{o.input_line}: {key} is chosen more than once ({seen[key]} and {o.input_line}); fix: give "
                f"{key} once, e.g. {seen[key]} alone"
            )
        seen[key] = o.input_line
    return None
