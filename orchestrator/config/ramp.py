"""Batch-size ramp-up (``training.rampup_batch_size``): Megatron-LM's ``--rampup-batch-size`` rules. Pure Python.

``[start, increment, samples]``: the global batch starts at ``start`` samples and grows by ``increment`` over
``samples`` consumed samples until it reaches ``training.global_batch_size`` (megatron-core 0.16.1
``num_microbatches_calculator.RampupBatchsizeNumMicroBatchesCalculator``: with ``n = (GBS - start) / increment``
steps, the batch after ``c`` consumed samples is ``start + increment x floor(c / (samples / n))``, and GBS once
``c > samples``). The runtime asks megatron-core's own calculator for every iteration's batch
(:mod:`orchestrator.runtime.training.batch_ramp`); this module holds the rules it must pass before a job is queued
(:func:`problem`) and, for megatron-core 0.19, which dropped the ramp calculator for a step schedule
(``step_batch_size_schedule``, ``"THRESHOLD:BS ..."`` in samples), the same ramp spelled as steps
(:func:`step_schedule`).

Unlike Megatron-LM, which refuses ``--rampup-batch-size`` with ``--train-iters`` (its ramp needs
``--train-samples``), training here stays iteration-based: ``training.train_iters`` counts iterations, each one's
global batch follows the ramp, so a run with a ramp consumes fewer samples than ``train_iters x GBS``. The LR
schedule then runs in samples as Megatron-LM's does (warm-up and decay lengths ``iters x GBS``, stepped by each
iteration's batch; :mod:`orchestrator.config.schedule`).
"""

from __future__ import annotations

from typing import List, Optional

KEY = "training.rampup_batch_size"


def _shown(ramp) -> str:
    return "[" + ",".join(str(v) for v in ramp) + "]"


def problem(ramp, global_batch_size: int, micro_batch_size: int, dp: int, pp: int, interleaved: bool) -> Optional[str]:
    """One ``error:`` line's text when ``ramp`` (``training.rampup_batch_size``) breaks Megatron-LM's rules, else None.

    Rules: three integers ``start > 0``, ``increment > 0``, ``samples > 0``; ``start < GBS`` (megatron-core divides
    the ramp samples by ``(GBS - start) / increment`` steps); ``start`` and ``increment`` multiples of
    ``MBS x DP`` (every batch of the ramp is whole micro-batches on every DP rank, megatron-core's consistency
    check); ``(GBS - start) % increment == 0`` (megatron-core's assertion); with the interleaved schedule every
    ramp batch's micro-batch count a multiple of PP (the layout's rule for GBS, applied to each batch).
    """
    if ramp is None:
        return None
    values = list(ramp)
    if len(values) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values):
        return (
            f"{KEY}={_shown(values)}: must be null or three positive integers [start, increment, samples] "
            f"(Megatron-LM --rampup-batch-size); fix: e.g. {KEY}=[{micro_batch_size * dp},{micro_batch_size * dp},1000]"
        )
    start, inc, samples = values
    gbs, step = global_batch_size, micro_batch_size * dp
    fix_start = next((s for s in range(step, gbs, step) if (gbs - s) % step == 0), None)
    if start >= gbs:
        return (
            f"{KEY}={_shown(values)}: the start batch {start} must be below training.global_batch_size={gbs} "
            f"(the ramp grows to it); fix: a start of {fix_start or step}, or {KEY}=null"
        )
    if start % step or inc % step:
        bad = "start" if start % step else "increment"
        return (
            f"{KEY}={_shown(values)}: the {bad} ({start if bad == 'start' else inc}) is not divisible by "
            f"training.micro_batch_size x DP = {micro_batch_size} x {dp} = {step}, so a ramp batch is not whole "
            f"micro-batches on every DP rank; fix: start and increment multiples of {step}, e.g. "
            f"{KEY}=[{step},{step},{samples}]"
        )
    if (gbs - start) % inc:
        return (
            f"{KEY}={_shown(values)}: training.global_batch_size - start = {gbs} - {start} = {gbs - start} is not "
            f"divisible by the increment {inc}; fix: an increment dividing {gbs - start} that is a multiple of "
            f"{step}, e.g. {KEY}=[{start},{step},{samples}]"
        )
    if interleaved and (start // step % pp or inc // step % pp):
        return (
            f"{KEY}={_shown(values)}: the interleaved schedule needs every ramp batch's num_microbatches to be a "
            f"multiple of pipeline_model_parallel_size={pp}, but start / (MBS x DP) = {start // step} and "
            f"increment / (MBS x DP) = {inc // step}; fix: start and increment multiples of {step * pp}, or {KEY}=null"
        )
    return None


def step_schedule(ramp: List[int], global_batch_size: int) -> str:
    """The ramp as megatron-core 0.19's ``step_batch_size_schedule`` (thresholds in samples), equal to megatron-core
    0.16.1's ramp calculator at every consumed-sample count.

    Batch ``start + k x increment`` from the first count ``c`` at which 0.16.1's expression
    ``int(c / (samples / n))`` (a float division) reaches ``k``, ``k = 0..n``, ``n = (GBS - start) / increment``;
    GBS from there or from ``samples + 1`` (0.16.1: ``c > samples``), whichever comes first. ``[4, 4, 12]`` with
    GBS 16: ``"0:4 4:8 8:12 12:16"``. With fewer ramp samples than steps two steps can share a count: the larger
    batch wins there, as 0.16.1's floor skips steps.
    """
    start, inc, samples = (int(v) for v in ramp)
    n = (global_batch_size - start) // inc
    per = samples / n  # megatron-core 0.16.1: rampup_samples_per_increment

    def first(k: int) -> int:  # the smallest c with int(c / per) >= k, from the exact guess ceil(k x samples / n)
        c = -(-k * samples // n)
        while c > 0 and int((c - 1) / per) >= k:
            c -= 1
        while int(c / per) < k:
            c += 1
        return c

    steps = {first(k): start + k * inc for k in range(n)}
    steps[min(first(n), samples + 1)] = global_batch_size
    return " ".join(f"{threshold}:{batch}" for threshold, batch in sorted(steps.items()))


def _steps(ramp: List[int], global_batch_size: int) -> List[tuple]:
    """:func:`step_schedule` as ``[(threshold samples, batch), ...]``."""
    return [tuple(int(x) for x in e.split(":")) for e in step_schedule(ramp, global_batch_size).split()]


def samples_after(ramp: Optional[List[int]], global_batch_size: int, iterations: int) -> int:
    """Samples consumed by ``iterations`` iterations (each one's batch chosen at its starting count, as megatron-core's
    ``update_num_microbatches(consumed_samples)`` before each step); ``iterations x GBS`` without a ramp."""
    if ramp is None:
        return iterations * global_batch_size
    consumed, left, steps = 0, iterations, _steps(ramp, global_batch_size)
    for i, (_, batch) in enumerate(steps):
        upto = steps[i + 1][0] if i + 1 < len(steps) else None
        n = left if upto is None else min(left, max(0, -(-(upto - consumed) // batch)))
        consumed, left = consumed + n * batch, left - n
    return consumed


def iterations_for(ramp: Optional[List[int]], global_batch_size: int, samples: int) -> int:
    """Iterations until ``samples`` are consumed (Megatron-LM's ``update_train_iters`` for ``--train-samples``:
    iterate while consumed < samples); ``samples // GBS`` without a ramp, as it."""
    if ramp is None:
        return samples // global_batch_size
    lo, hi = 0, max(1, samples)  # samples_after grows with iterations (every batch >= 1 sample)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if samples_after(ramp, global_batch_size, mid) < samples else (lo, mid)
    return lo


def describe(training, dp: int) -> Optional[str]:
    """The ramp's arithmetic of ``training`` (a TrainingConfig) with ``dp`` DP ranks in one line (printed with the
    layout's), None without a ramp."""
    t = training
    ramp, global_batch_size, micro_batch_size, train_iters = (
        t.rampup_batch_size,
        t.global_batch_size,
        t.micro_batch_size,
        t.train_iters,
    )
    if ramp is None:
        return None
    start, inc, samples = ramp
    n = (global_batch_size - start) // inc
    step = micro_batch_size * dp
    total = samples_after(ramp, global_batch_size, train_iters)
    return (
        f"batch ramp-up: GBS {start} -> {global_batch_size} in {n} steps of {inc} over {samples} samples "
        f"(~{samples / n:g} samples each); num_microbatches {start // step} -> {global_batch_size // step}; "
        f"training.train_iters={train_iters} iterations consume {total:,} samples (not {train_iters} x "
        f"{global_batch_size}); the LR schedule counts samples"
    )
