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
    """The learning rate a spike or NaN stop's fix proposes (:func:`proposed_lr`); null: the config's own when a
    command line raised ``optimizer.lr`` above it (composition fills it in), else a tenth of ``optimizer.lr``."""
    suggest_lr_from: Optional[str] = None
    """Where ``suggest_lr`` came from, as the fix says it: composition fills it in with ``suggest_lr`` ("the
    optimizer=adam preset's default", "the experiment's own"); null: ``training.spike.suggest_lr`` (your own)."""
    window: int = 20


def proposed_lr(lr: float, suggest_lr: Optional[float], source: Optional[str] = None) -> "tuple[float, str]":
    """(the learning rate a spike or NaN stop proposes, why): ``suggest_lr`` -- the config's own, filled in when a
    command line raised ``optimizer.lr`` above it, said as ``source`` (``training.spike.suggest_lr_from``) -- when it
    is lower than ``lr``, else ``lr / 10`` (the rate is already the config's: a tenth of it is the usual next try)."""
    if suggest_lr is not None and suggest_lr < lr:
        return suggest_lr, source or "training.spike.suggest_lr"
    return lr / 10, "a tenth"


def longer_warmup(warmup_iters: int) -> int:
    """The ``optimizer.lr_warmup_iters`` a NaN stop's fix proposes: twice the current one, at least 10 (a longer
    linear warm-up keeps the first updates small while Adam's second moments are still near zero)."""
    return max(10, 2 * warmup_iters)
