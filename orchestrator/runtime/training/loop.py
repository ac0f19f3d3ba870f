"""The training loop, its evaluation, and nothing the bare megatron-core loop does not need per step.

Per iteration: megatron-core's num-microbatches calculator (``update_num_microbatches(consumed_samples)``:
this iteration's micro-batch count and global batch, which ``training.rampup_batch_size`` ramps;
runtime.training.batch_ramp) → megatron's ``get_forward_backward_func()`` (no pipelining, 1F1B or
interleaved 1F1B, chosen by megatron from the parallel state) with that many micro-batches →
``optimizer.step()`` → ``scheduler.step(increment)`` (1 iteration, or the batch's samples with a ramp, as
Megatron-LM's). ``consumed_samples`` grows by each iteration's own batch.

Host synchronisation: none beyond megatron's own (its gradient-norm all-reduce, when clipping).
The micro-batch losses stay tensors; the lm loss (mean over micro-batches on the last stage, then
over DP x CP, in nats per token) is reduced and read only on iterations that log, save or stop. That
one all-reduce (runtime.training.exchange) also carries the stop poll (every rank stops after the same iteration
once any got a signal; between logging iterations a non-blocking poll at most every few seconds:
runtime.training.stop_poll) and, when their windows close, the straggler watch's and the step breakdown's rows.

Evaluation (``training.eval_iters > 0``): every ``training.eval_interval`` iterations and after
the last, the validation lm loss over the first ``eval_iters`` global batches of the held-out
split (the same batches every time), through megatron's schedule with ``forward_only=True`` (so
across pipeline stages), averaged like the training loss; perplexity = exp(loss).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import torch

from orchestrator.runtime.faults import spike, straggler
from orchestrator.runtime.rank.build import Data, Rank
from orchestrator.runtime.training import breakdown, exchange, forward, trace
from orchestrator.runtime.training.batch_ramp import Batch, BatchRamp
from orchestrator.runtime.training.metrics import Trackers
from orchestrator.runtime.training.resume import Saver, Start
from orchestrator.runtime.training.save_schedule import SaveSchedule
from orchestrator.runtime.training.step_log import StepLog
from orchestrator.runtime.training.stop_poll import StopPoll

NONFINITE_GRAD_ENV = "ORCHESTRATOR_TEST_NONFINITE_GRAD_AT"
"""Test-only (tests/test_guard.py): a comma-separated list of iterations at which every rank sets one
element of its first gradient to +inf after the backward pass, before the optimizer step, to exercise
``training.nan_policy`` in a real job. Unset in every real run; nothing else reads it."""


def _inject_nonfinite_grad(model, iteration: int) -> None:
    """Put +inf into one gradient element at the iterations named by :data:`NONFINITE_GRAD_ENV`."""
    at = os.environ.get(NONFINITE_GRAD_ENV)
    if not at or str(iteration) not in at.split(","):
        return
    for chunk in model:
        for param in chunk.parameters():
            grad = getattr(param, "main_grad", None)
            if grad is None:
                grad = param.grad
            if grad is not None:
                grad.view(-1)[0] = math.inf
                return


@dataclass
class Outcome:
    """How the loop ended."""

    status: str  # completed | exited | stopped
    iteration: int
    consumed_samples: int
    lm_loss: float
    step_times: List[float] = field(default_factory=list)
    """Per-iteration wall times (s) after the timing warm-up, for the summary's median."""
    cpu_times: List[float] = field(default_factory=list)
    """The same iterations' CPU time of this process (s): what the loop costs, whatever the machine's load."""
    train_wall_s: float = 0.0
    """Wall time of the whole loop (s): every iteration, its records, evaluations and saves; a job's or a
    trial's start-up is its wall time minus this."""
    schedule_trace: Optional[Dict[str, object]] = None
    """``training.trace_iteration``'s measured bubble per stage next to the formula (runtime.training.trace)."""
    breakdown: Optional[Dict[str, object]] = None
    """The timed iterations' step per stage by category (runtime.training.breakdown), on the logging rank."""
    stragglers: List[Dict[str, object]] = field(default_factory=list)
    """The ranks and hosts ``training.straggler`` named (runtime.faults.straggler), in order."""


def _phase(guard, name: str):
    """The guard's watchdog allowance for a stretch without iterations (nothing without a guard)."""
    return guard.phase(name) if guard is not None else contextlib.nullcontext()


def _eval_due(rank: Rank, data: Data, iteration: int, completed: bool) -> bool:
    t = rank.cfg.training
    return data.valid is not None and (completed or bool(t.eval_interval) and iteration % t.eval_interval == 0)


def _step(
    rank: Rank, data: Data, forward_backward, iteration: int, batch: Batch, guard, clock, watch, tracer
) -> Tuple[list, float, bool, Optional[float]]:
    """Iteration ``iteration``'s forward/backward (megatron-core's schedule, ``batch.num_microbatches``) and
    optimizer step (the LR scheduler advanced by ``batch.scheduler_increment``), timed for the breakdown (``clock``), the straggler
    watch and the trace; ``(losses, lr applied, update_ok, grad_norm)``."""
    cfg, t, b = rank.cfg, rank.cfg.training, rank.built
    if clock is not None:
        clock.begin_step(iteration)
    with breakdown.section(clock, "optimizer"):
        for chunk in b.model:
            chunk.zero_grad_buffer()
        b.optimizer.zero_grad()
    with straggler.timing(watch, forward.forward_step) as timed, trace.around(tracer, iteration, timed) as forward_step:
        losses = forward_backward(
            forward_step_func=forward_step,
            data_iterator=data.train,
            model=b.model,
            num_microbatches=batch.num_microbatches,
            seq_length=cfg.model.seq_length,
            micro_batch_size=t.micro_batch_size,
            forward_only=False,
        )
    _inject_nonfinite_grad(b.model, iteration)
    lr = b.optimizer.param_groups[0]["lr"]  # what this step applies
    # guard.step: megatron's optimizer step that never applies a non-finite update
    with breakdown.section(clock, "optimizer"):
        update_ok, grad_norm, _ = guard.step(b.optimizer) if guard is not None else b.optimizer.step()
        if update_ok:  # Megatron-LM's rule: a skipped update does not advance the schedule
            b.scheduler.step(increment=batch.scheduler_increment)
    return losses, lr, update_ok, grad_norm


def _stop(poll: StopPoll, saver: Saver, trackers: Trackers, stop, iteration: int) -> None:
    """After the stop's save: wait for its write (the requeued job resumes from it), say it, requeue or exit."""
    poll.close()
    saver.finish()
    trackers.event({"event": "stopped", "iteration": iteration, "time": time.time()})
    stop.requeue_or_exit("signal")


@dataclass
class Reduced:
    """What a logging iteration's all-reduce brought (runtime.training.exchange), or a plain iteration's poll."""

    loss: Optional[float] = None
    """The loss on the last stage (None elsewhere and where it was not reduced)."""
    shared: Optional[float] = None
    """The loss on every rank (the spike guard's), None where not reduced."""
    stopping: bool = False
    """Every rank stops after this iteration."""
    reduced: bool = False
    breakdown: Optional[Dict[str, object]] = None
    """A closed breakdown window (on the logging rank)."""


def _reduce(rank: Rank, clock, poll: StopPoll, watch, losses, it: int, logging: bool, last: bool, t0: float) -> Reduced:
    """Iteration ``it``'s one collective of ours: on a logging iteration (``logging``) the loss, the stop poll and,
    when due, the straggler and breakdown windows ride on one all-reduce; another iteration polls the stop
    (:class:`StopPoll`) and reduces the loss only when it stops (its iteration is saved and logged)."""
    step_loss = forward.step_loss(losses)  # a tensor on the last stage: no host sync
    if watch is not None:
        watch.tick(it)  # this iteration's compute joins the straggler window
    if not logging:
        with breakdown.section(clock, "loop-sync"):
            if not poll.requested():
                return Reduced()
    ex = exchange.Exchange(rank.tensor_device, rank.info.rank, rank.layout.world_size)  # the carried layout
    ex.add("stop", poll.share() if logging else [])
    straggling = watch is not None and watch.due()
    if straggling:
        ex.add_row("straggler", watch.row())
    closing = clock is not None and clock.due(it, last)
    if closing:
        ex.add_row("breakdown", clock.row(time.perf_counter() - t0))
    with breakdown.section(clock, "loss-all-reduce"):
        got = ex.all_reduce(step_loss)
    stopping = not logging or (not last and poll.merged(got["stop"][0], got["stop"][1] / ex.world))
    if straggling:
        watch.verdict(it, got["straggler"])
    shaped = clock.result(it, got["breakdown"]) if closing and rank.is_logger else None
    return Reduced(got["loss"] if step_loss is not None else None, got["loss"], stopping, True, shaped)


def train(rank: Rank, data: Data, start: Start, saver: Saver, trackers: Trackers, stop, guard=None) -> Outcome:
    """Train from ``start`` to ``training.train_iters`` (or a stop / ``exit_after_iters``); collective.

    ``stop``: a StopRequest; ``guard``: runtime.guard's Guard (optimizer ``step`` that never applies a
    non-finite update, ``check`` before any save of an iteration, a watchdog allowance for evaluation,
    ``beat`` after every iteration), or None. A requested stop saves and never returns
    (``stop.requeue_or_exit``).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    t = rank.cfg.training
    forward_backward = get_forward_backward_func()
    it, consumed, last_loss = start.iteration, start.consumed_samples, math.nan
    ramp = BatchRamp(rank.cfg, rank.layout.data_parallel_size, torch.distributed.get_rank())
    clock = breakdown.clock_for(rank)  # None when training.breakdown_interval=0
    log, poll = StepLog(rank, trackers, start.iteration, clock), StopPoll(stop)
    status, loop_start = "completed", time.perf_counter()
    tracer = trace.tracer_for(rank)  # None unless training.trace_iteration is set
    spikes = spike.SpikeWatch(t.spike.factor, t.spike.window)
    spikes.seed(rank.cfg.run.dir, start.iteration)  # guarded from an attempt's first iteration
    watch = straggler.watch_for(rank, trackers, start.iteration)  # None when training.straggler.interval is null
    schedule = SaveSchedule(rank, start.iteration, trackers)  # checkpoint.save_interval, or auto's Young–Daly
    while it < t.train_iters:
        t0, c0, batch = time.perf_counter(), time.process_time(), ramp.at(consumed)  # megatron-core's calculator
        losses, lr, update_ok, grad_norm = _step(
            rank, data, forward_backward, it + 1, batch, guard, clock, watch, tracer
        )
        it, consumed = it + 1, consumed + batch.samples
        last = it == t.train_iters
        exiting = bool(t.exit_after_iters) and it - start.iteration >= t.exit_after_iters and not last
        save_now = schedule.due(it) and not last  # due: every rank, every iteration (auto chooses collectively)
        # alike on all ranks; the attempt's first iteration too, as Megatron-LM's training_log (the spike guard's
        # first reference, and a record from the start)
        logging = last or exiting or save_now or it % t.log_interval == 0 or it == start.iteration + 1
        got = _reduce(rank, clock, poll, watch, losses, it, logging, last, t0)
        loss, stopping = got.loss, got.stopping
        if guard is not None:  # raises before anything of this iteration is saved
            with breakdown.section(clock, "loop-sync"):
                update_ok = guard.check(it, loss, grad_norm) and update_ok
                spike.check(guard, spikes, it, got.shared, grad_norm, got.reduced)  # likewise
        # the whole iteration but its record, evaluation and save; wall and this process's CPU time
        log.tick(time.perf_counter() - t0, time.process_time() - c0, it, batch)
        log.breakdown(it, got.breakdown)
        if loss is not None:  # every iteration whose loss was read: a log, save, stop or exit, the first, the last
            last_loss = loss
            log.record(it, consumed, loss, lr, grad_norm, update_ok)
        if _eval_due(rank, data, it, completed=last):
            with _phase(guard, "evaluation"):
                log.eval(it, consumed, forward.evaluate(rank, forward_backward, data))
        if save_now or stopping or exiting:
            saver(it, consumed)
            if save_now:
                schedule.saved(it, saver.last_blocking_s)
        saver.poll()  # an asynchronous write finishes here, on every rank together
        if guard is not None:
            guard.beat(it)
        if stopping:
            _stop(poll, saver, trackers, stop, it)
        if exiting:
            status = "exited"
            break
    poll.close()
    whole = log.whole_run()  # collective
    return Outcome(
        status,
        it,
        consumed,
        last_loss,
        log.timed,
        log.cpu,
        time.perf_counter() - loop_start,
        tracer.result if tracer is not None else None,
        breakdown=whole,
        stragglers=watch.named if watch is not None else [],
    )
