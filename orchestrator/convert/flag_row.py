"""One row of the Megatron-LM flag table (:mod:`orchestrator.convert.megatron_args` documents the fields). Pure data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple


class _Keep:
    """Sentinel: Megatron-LM has no default that applies; the orchestrator's value stays."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP = _Keep()


@dataclass(frozen=True)
class Flag:
    """One row of :data:`TABLE` (see the module docstring for the fields)."""

    flag: str
    key: Optional[str] = None
    kind: str = "str"
    value: Any = True
    default: Any = KEEP
    export: bool = True
    omit: Tuple[Any, ...] = ()
    note: str = ""
