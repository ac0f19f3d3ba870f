"""``training.spike``: the loss / grad-norm spike stop's settings (a section of :class:`~orchestrator.config.schema.TrainingConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class SpikeConfig:
    """Loss / grad-norm spike stop (orchestrator/runtime/faults/spike.py, where the default is argued)."""

    factor: Optional[float] = 10.0
    """Stop the attempt (nothing of that iteration saved) when the lm loss exceeds this x the median of its
    last ``window`` values, or the gradient norm this x their max (megatron-core's spiky-loss factor); null: never."""
    window: int = 20
