"""Loss and gradient-norm spikes stop the attempt before anything of that iteration is saved.

An lm loss above ``training.spike.factor`` x the median of its last ``training.spike.window`` (20)
values, or a global gradient norm above factor x the largest of its last ``window``, ends the attempt
as a NaN does (:mod:`.guard`): every rank raises :class:`~orchestrator.errors.LossSpikeError` at the
same iteration, before its save, with one line naming the iteration, the value and the reference, and
a hint that lowers the learning rate. ``training.spike.factor=null`` turns it off.

Why a factor of 10 (the default): it is megatron-core's own (Megatron-LM's ``pretrain_gpt.py`` passes
``SPIKY_LOSS_FACTOR = 10`` to the rerun state machine's ``is_unexpectedly_large``, which flags a value
above 10 x the largest of its first 100). Measured here on a healthy 4471-iteration gpt_tiny run: the
loss never exceeded 1.66 x its 20-iteration median (a ten-fold cross-entropy is past uniform guessing:
ln(vocab) is 5.6 for the byte tokenizer, 11.8 for 128k ids), so the loss is held to the *median*, which
one earlier outlier cannot raise. Gradient norms are spikier (the same run: 9.3 x the median once, at
iteration 767, where clipping contained it; 5.6 x the window's max), so they are held to the *maximum*,
as megatron-core does. Both are compared from the second value on: ``optimizer.lr=1000`` on gpt_tiny stops at
iteration 3 (loss 274318 against a median of 5.77), where before it saved checkpoints of losses in the
millions until a NaN at iteration 9.

Every rank decides alike: the gradient norm is global already, and the loss (known on the last
pipeline stage only) is shared with one MAX all-reduce per iteration where it was computed.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Deque, Dict, Optional, Tuple

REFERENCE = {"lm loss": ("median", statistics.median), "grad norm": ("max", max)}
"""What each metric's recent values are summarised by before the factor applies (see above)."""


class SpikeWatch:
    """Recent values of ``lm loss`` and ``grad norm``; :meth:`spike` says whether a new one is a spike.

    Pure (no torch): the caller supplies values every rank agrees on.
    """

    def __init__(self, factor: Optional[float], window: int = 20):
        self.factor = factor
        self.recent: Dict[str, Deque[float]] = {k: collections.deque(maxlen=window) for k in ("lm loss", "grad norm")}

    def seed(self, run_dir, start_iteration: int, tail_bytes: int = 1 << 20) -> int:
        """Fill the window from the run's own records of the iterations up to ``start_iteration`` (the checkpoint an
        attempt resumed from: its later records were redone), so that a resumed, requeued or restarted attempt is
        guarded from its first iteration. Reads the end of ``metrics.jsonl`` (``tail_bytes``); every rank reads the
        same file before training, so all agree. Returns how many iterations it took."""
        import json
        from pathlib import Path

        path = Path(run_dir) / "metrics.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - tail_bytes))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return 0
        kept: Dict[int, dict] = {}
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            it = rec.get("iteration") if isinstance(rec, dict) and "event" not in rec else None
            if isinstance(it, int) and it <= start_iteration:
                kept[it] = rec  # a redone iteration: its last record
        last = sorted(kept)[-self.recent["lm loss"].maxlen :] if kept else []
        for it in last:
            for what, key in (("lm loss", "lm_loss"), ("grad norm", "grad_norm")):
                value = kept[it].get(key)
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self.recent[what].append(float(value))
        return len(last)

    def spike(self, what: str, value: Optional[float]) -> Optional[Tuple[float, float]]:
        """(value, reference) when ``value`` exceeds factor x the :data:`REFERENCE` of the recent ones,
        else None (and the value joins the window). Non-finite values are the NaN guard's and never join."""
        if self.factor is None or value is None or not math.isfinite(value):
            return None
        recent = self.recent[what]
        reference = REFERENCE[what][1](recent) if recent else None
        if reference is not None and reference > 0 and value > self.factor * reference:
            return value, reference
        recent.append(float(value))
        return None


def check(
    guard,
    watch: SpikeWatch,
    iteration: int,
    lm_loss: Optional[float],
    grad_norm: Optional[float],
    loss_reduced: bool = True,
) -> None:
    """Raise :class:`~orchestrator.errors.LossSpikeError` on every rank when this iteration's loss or
    gradient norm is a spike (call BEFORE any save of ``iteration``, after the NaN guard's check).
    ``guard``: the rank's :class:`~orchestrator.runtime.faults.guard.Guard` (the attempt's record).

    ``lm_loss``: the loss every rank sees (the loop's one all-reduce of it,
    :class:`~orchestrator.runtime.training.exchange.Exchange`), None where no rank has one.
    ``loss_reduced``: whether the loop reduced this iteration's loss (its log, save and stop iterations; the same
    on every rank). On the others only the gradient norm, which every rank already holds from the optimizer's own
    all-reduce, is checked. No collective and no host sync of its own."""
    if watch.factor is None:
        return
    loss = lm_loss if loss_reduced else None
    for what, value in (("lm loss", loss), ("grad norm", grad_norm)):
        hit = watch.spike(what, None if value is None else float(value))
        if hit is not None:
            _stop(guard, iteration, what, *hit, len(watch.recent[what]))


def _stop(guard, iteration: int, what: str, value: float, reference: float, n: int) -> None:
    """End the attempt as ``spike`` (recorded once) and raise LossSpikeError, naming value and reference."""
    from orchestrator.ckpt import history
    from orchestrator.config.spike import proposed_lr
    from orchestrator.errors import LossSpikeError
    from orchestrator.runtime.faults.diskspace import latest_checkpoint

    cfg = guard.cfg
    lr, factor = cfg.optimizer.lr, cfg.training.spike.factor
    lower, why = proposed_lr(lr, cfg.training.spike.suggest_lr, cfg.training.spike.suggest_lr_from)
    latest = latest_checkpoint(guard.run_dir)
    keep = f"the latest checkpoint stays {latest}" if latest else "no checkpoint was saved before it"
    message = (
        f"{what} spike at iteration {iteration}: {value:.6g} > training.spike.factor={factor:g} x "
        f"{REFERENCE[what][0]} {reference:.6g} of the last {n} iteration(s): stopped before anything of "
        f"iteration {iteration} was saved, {keep}; fix: lower the learning rate (optimizer.lr={lr:g} -> "
        f"optimizer.lr={lower:g}, {why}) and {'rerun to resume' if latest else 'rerun (nothing was saved: it starts again from iteration 0)'}, "
        "or training.spike.factor=null to train through spikes"
    )
    if history.claim_attempt_end(guard.run_dir, guard.job_id, guard.attempt):
        for write in (
            lambda: history.record_event(
                guard.run_dir,
                "spike",
                job_id=guard.job_id,
                attempt=guard.attempt,
                iteration=iteration,
                what=what,
                value=value,
                reference=reference,
            ),
            lambda: history.record_attempt_ended(
                guard.run_dir, guard.job_id, guard.attempt, "spike", iteration=iteration, message=message
            ),
        ):
            try:
                write()
            except OSError:
                pass  # the stop itself must not fail on a full disk
    raise LossSpikeError(message)
