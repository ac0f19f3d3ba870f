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
    suggest_lr: Optional[float] = None
    """The learning rate a spike or NaN stop's fix proposes (:func:`proposed_lr`); null: the experiment's own when a
    command line raised ``optimizer.lr`` above it (composition fills it in), else a tenth of ``optimizer.lr``."""
    window: int = 20


def proposed_lr(lr: float, suggest_lr: Optional[float]) -> "tuple[float, str]":
    """(the learning rate a spike or NaN stop proposes, why): ``suggest_lr`` -- the experiment's own, filled in when a
    command line raised ``optimizer.lr`` above it -- when it is lower than ``lr``, else ``lr / 10`` (the rate is
    already the experiment's: a tenth of it is the usual next try)."""
    if suggest_lr is not None and suggest_lr < lr:
        return suggest_lr, "the experiment's own"
    return lr / 10, "a tenth"
