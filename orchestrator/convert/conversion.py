"""The result of a conversion: :class:`Conversion` (settings and every finding) and the one error shape.

Shared by :mod:`orchestrator.convert.to_config` (the mapping) and :mod:`orchestrator.convert.rules`
(Megatron-LM's derivation rules). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from orchestrator.convert.sources import Arg, Source
from orchestrator.errors import ConfigError


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
        raise fail(
            arg.flag,
            f"expects one value, got {len(arg.values)} ({' '.join(arg.values) or 'none'})",
            f"write `{arg.flag} VALUE`",
        )
    text = arg.values[0]
    if "$" in text:
        raise fail(
            arg.flag,
            f"{text!r} contains a shell variable the script does not define",
            "define it in the script or pass --var NAME=VALUE",
        )
    if kind == "str" and text == "":
        return None  # Megatron-LM's "" (off) is our null
    try:
        return {"int": int, "float": float, "str": str}[kind](text)
    except ValueError:
        raise fail(
            arg.flag,
            f"{text!r} is not {'an integer' if kind == 'int' else 'a number'}",
            f"give {arg.flag} a {'whole number' if kind == 'int' else 'number'}",
        ) from None
