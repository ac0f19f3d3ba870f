"""Where a step's time goes, per pipeline stage: compute, pipeline bubble, data-parallel communication,
optimizer, data loading, and what none of them covers.

``training.breakdown_interval=N`` (default 10; 0: off, and nothing here runs). The clock is megatron-core's
own timing hook: the ``timers`` field of the model's ``TransformerConfig`` (``ModelParallelConfig.timers``,
"see megatron.core.timers.Timers"), which megatron's schedules already call around every section this
needs, by name; nothing of megatron is wrapped or patched:

=====================  ========================================================================================
category               megatron-core's timer names (0.16 and 0.19)
=====================  ========================================================================================
``compute``            ``forward-compute``, ``backward-compute`` (the forward step, loss, backward of every
                       micro-batch and model chunk), less ``data``, which runs inside the forward step
``bubble``             every point-to-point call of the schedule (``forward-recv``, ``backward-send``,
                       ``forward-send-backward-recv`` ...): waiting for the neighbour's activations and
                       gradients, and their transfer
``dp_comm``            ``all-grads-sync`` (DDP's gradient all-reduce / reduce-scatter, or the wait for the
                       overlapped one), ``embedding-grads-all-reduce`` and megatron's other gradient syncs of
                       ``finalize_model_grads``; the loop's lm-loss all-reduce over all ranks (on logging
                       iterations: the last stage's loss to every rank, for the spike guard too)
``data``               ``batch-generator`` (Megatron-LM's name): the forward step's ``next(data_iterator)``
``optimizer``          the loop's zeroing of the gradient buffers, ``optimizer.step()`` (gradient norm and its
                       all-reduce, clipping, update) and the LR scheduler's step
``sync``               the loop's own collectives over all ranks: the stop poll and the NaN guard's
                       all-reduce (where a rank waits for the slowest of all)
``cpu_wait``           CPU ranks: the time the rank's thread was ready to run but waited for a core (Linux
                       ``/proc/thread-self/schedstat``'s run-queue delay, field 2, ns), wherever in the step it
                       fell: it is taken out of the section it interrupted, so a rank that shares its cores
                       with other processes (data workers, a neighbour's job, more ranks than cores) shows
                       it here rather than inflating compute or ``other``; 0 on a GPU and where the kernel
                       keeps no schedstat
``other``              the step time less the above: the schedule's own Python between sections
=====================  ========================================================================================

A section is timed with ``time.perf_counter()`` on CPU, less the run-queue delay read at its ends (one
``pread`` of the schedstat file, about 1.2 µs); on a GPU with a pair of CUDA events on the current
stream (no synchronisation; they are read at the next window, after one ``torch.cuda.synchronize()``), so a
section is the device time between the work queued before it and its own: a recv that waits shows as bubble,
data loading that starves the device as data. Nested sections count once: ``data`` is taken out of the
``compute`` that encloses it.

Every N iterations (at the first logging iteration that closes a window of N, and at the last) each rank's
window totals ride to the logging rank on that iteration's one all-reduce (runtime.training.exchange; no
collective of their own; the logging iteration's own all-reduce and what follows it fall in no window, only in
the run's), which prints one line and writes a
``breakdown`` record to ``metrics.jsonl``; the job's summary carries the same over its timed iterations
(after ``training.timing_warmup_iters``). Per stage: the mean over its ranks of each category's share of the
step, and on a GPU the stage's MFU (model FLOPs of the stage per GPU per step / (step time x the GPU's peak,
:mod:`orchestrator.plan.inputs`)).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Dict, List, Optional

import torch

from orchestrator.plan.step_breakdown import CATEGORIES, per_stage

_NAMES = {
    "forward-compute": "compute",
    "backward-compute": "compute",
    "batch-generator": "data",
    "all-grads-sync": "dp_comm",
    "embedding-grads-all-reduce": "dp_comm",
    "non-tensor-parallel-grads-all-reduce": "dp_comm",
    "conditional-embedder-grads-all-reduce": "dp_comm",
    "optimizer": "optimizer",
    "loss-all-reduce": "dp_comm",
    "loop-sync": "sync",
}
"""megatron-core's timer names (and the loop's own sections) -> category; p2p names are found by :func:`category`."""


def category(name: str) -> Optional[str]:
    """The category of a megatron timer name (None: not counted, e.g. ``forward-backward``, which encloses
    the others)."""
    if name in _NAMES:
        return _NAMES[name]
    parts = name.split("-")
    return "bubble" if "send" in parts or "recv" in parts else None


class RunQueueDelay:
    """The calling thread's run-queue delay so far (seconds): how long it was ready to run but waited for a
    core (Linux ``/proc/thread-self/schedstat``, second field, nanoseconds; see the kernel's
    Documentation/scheduler/sched-stats.rst). Read with one ``pread`` on a descriptor opened once by the
    thread that reads it; ``available`` is False (and every reading 0.0) where the file does not exist."""

    def __init__(self):
        try:
            self._fd: Optional[int] = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            self._fd = None
        self.available = self._fd is not None

    def __call__(self) -> float:
        if self._fd is None:
            return 0.0
        return int(os.pread(self._fd, 96, 0).split()[1]) / 1e9

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _Section:
    """One named timer, as megatron calls it: ``start(barrier=False)`` ... ``stop(barrier=False)``."""

    __slots__ = ("clock", "category")

    def __init__(self, clock: "StepClock", cat: Optional[str]):
        self.clock, self.category = clock, cat

    def start(self, barrier: bool = False) -> None:
        if self.category is not None:
            self.clock._push(self.category)

    def stop(self, barrier: bool = False) -> None:
        if self.category is not None:
            self.clock._pop()


class StepClock:
    """megatron's ``config.timers`` for one rank: seconds per category of the current step, window and run.

    Build it on every rank (collective: a gloo group and one all-reduce to find the logging rank).
    """

    def __init__(self, rank, interval: int):
        from megatron.core import parallel_state as ps

        self.rank, self.interval, self.cuda = rank, interval, rank.device == "cuda"
        self.stage = ps.get_pipeline_model_parallel_rank()
        self.group = torch.distributed.new_group(backend="gloo")
        who = torch.tensor([rank.info.rank if rank.is_logger else -1], dtype=torch.int64)
        torch.distributed.all_reduce(who, op=torch.distributed.ReduceOp.MAX, group=self.group)
        self.logger = int(who[0])
        self._sections: Dict[str, _Section] = {}
        self._open: List[list] = []  # [category, start marker, run-queue delay at start]
        self.delay = RunQueueDelay() if not self.cuda else None  # CPU: the waits for a core (cpu_wait)
        self._step_delay = 0.0
        self._step = dict.fromkeys(CATEGORIES, 0.0)
        self._intervals: List[tuple] = []  # GPU: (category, enclosing category, start event, end event)
        self._pending: List[tuple] = []  # GPU: (intervals, step seconds, timed, in window) of finished steps
        self.window = _Totals()
        self.run = _Totals()
        self.first = self.closed_first = 0
        self._closed = False  # row() closed the window inside this step: its end joins the run's totals only

    def __call__(self, name: str, log_level: Optional[int] = None) -> _Section:
        section = self._sections.get(name)
        if section is None:
            section = self._sections[name] = _Section(self, category(name))
        return section

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _push(self, cat: str) -> None:
        self._open.append([cat, self._mark(), self.delay() if self.delay else 0.0])

    def _pop(self) -> None:
        if not self._open:
            return
        cat, start, delay = self._open.pop()
        parent = self._open[-1][0] if self._open else None
        if self.cuda:
            self._intervals.append((cat, parent, start, self._mark()))
            return
        elapsed = time.perf_counter() - start - (self.delay() - delay if self.delay else 0.0)
        self._step[cat] += elapsed
        if parent is not None and parent != cat:
            self._step[parent] -= elapsed

    @contextlib.contextmanager
    def section(self, name: str):
        """A section the loop times itself (``optimizer``)."""
        timer = self(name)
        timer.start()
        try:
            yield
        finally:
            timer.stop()

    def begin_step(self, iteration: int) -> None:
        """Iteration ``iteration`` starts: what was timed since the last step (an evaluation) is dropped."""
        self._open, self._intervals = [], []
        self._step = dict.fromkeys(CATEGORIES, 0.0)
        self._step_delay = self.delay() if self.delay else 0.0
        if not self.window.iterations:
            self.first = iteration

    def end_step(self, step_s: float, timed: bool) -> None:
        """The step ended after ``step_s`` seconds (the loop's step time); ``timed``: past the warm-up."""
        in_window, self._closed = not self._closed, False
        if self.cuda:
            self._pending.append((self._intervals, step_s, timed, in_window))
            self._intervals = []
            return
        if self.delay:
            self._step["cpu_wait"] = self.delay() - self._step_delay
        if in_window:
            self.window.add(self._step, step_s)
        if timed:
            self.run.add(self._step, step_s)

    def _seconds_of(self, intervals: List[tuple]) -> Dict[str, float]:
        """GPU: seconds per category of one step's recorded events (after a synchronisation)."""
        seconds = dict.fromkeys(CATEGORIES, 0.0)
        for cat, parent, start, end in intervals:
            elapsed = start.elapsed_time(end) / 1e3
            seconds[cat] += elapsed
            if parent is not None and parent != cat:
                seconds[parent] -= elapsed
        return seconds

    def _resolve(self) -> None:
        """GPU: read the events of the finished steps (one synchronisation)."""
        if not self._pending:
            return
        torch.cuda.synchronize()
        for intervals, step_s, timed, in_window in self._pending:
            seconds = self._seconds_of(intervals)
            if in_window:
                self.window.add(seconds, step_s)
            if timed:
                self.run.add(seconds, step_s)
        self._pending = []

    def due(self, iteration: int, last: bool) -> bool:
        """The window spans ``interval`` iterations to ``iteration`` (or it is the last): on a logging iteration,
        its :meth:`row` rides on the all-reduce (the same on every rank)."""
        return last or iteration - self.first + 1 >= self.interval

    def row(self, step_so_far_s: float) -> List[float]:
        """This rank's window to the current iteration, closing it: ``[stage, iterations, step s, seconds per
        category (CATEGORIES)]``, the current iteration counted with its sections so far and ``step_so_far_s``
        seconds (the rest of it goes into the run's totals only)."""
        self._resolve()
        if self.cuda:
            torch.cuda.synchronize()
            current = self._seconds_of(self._intervals)  # the sections closed so far
        else:
            current = dict(self._step)
            if self.delay:
                current["cpu_wait"] = self.delay() - self._step_delay
        totals = self.window
        totals.add(current, step_so_far_s)
        self.window, self._closed, self.closed_first = _Totals(), True, self.first
        return [float(self.stage), float(totals.iterations), totals.step_s] + [totals.seconds[c] for c in CATEGORIES]

    def result(self, iteration: int, rows: List[List[float]]) -> Dict[str, object]:
        """The closed window's per-stage shares from every rank's :meth:`row` (the logging rank's record)."""
        return {"iterations": [self.closed_first, iteration], **per_stage(rows, mfu_inputs(self.rank))}

    def gather(self) -> Optional[Dict[str, object]]:
        """The timed iterations' per-stage shares on the logging rank, None elsewhere (the job's summary; once
        per run). Collective over every rank: one ``gather`` on a gloo group."""
        self._resolve()
        totals = self.run
        mine = torch.tensor(
            [float(self.stage), float(totals.iterations), totals.step_s] + [totals.seconds[c] for c in CATEGORIES],
            dtype=torch.float64,
        )
        everyone = (
            [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
            if self.rank.info.rank == self.logger
            else None
        )
        torch.distributed.gather(mine, everyone, dst=self.logger, group=self.group)
        if everyone is None:
            return None
        return {"iterations": None, **per_stage([t.tolist() for t in everyone], mfu_inputs(self.rank))}


class _Totals:
    def __init__(self):
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self.step_s, self.iterations = 0.0, 0

    def add(self, seconds: Dict[str, float], step_s: float) -> None:
        for c in CATEGORIES:
            self.seconds[c] += seconds[c]
        self.step_s += step_s
        self.iterations += 1


def mfu_inputs(rank) -> Optional[Dict[str, object]]:
    """GPU only: per-GPU model FLOPs per step of each stage (the planner's count without recomputation) and
    the peak FLOP/s of this GPU (the preset its name names, else ``gpu``'s) at the job's precision."""
    if rank.device != "cuda":
        return None
    from dataclasses import replace

    from orchestrator.errors import OrchestratorError
    from orchestrator.plan.cost import flops_per_step
    from orchestrator.plan.inputs import GPU_PRESETS
    from orchestrator.plan.memory import plan

    try:
        p = plan(rank.cfg, vocab_size=rank.built.padded_vocab_size, profile=None, layout=rank.layout)
    except (OrchestratorError, ValueError, ZeroDivisionError):
        return None
    name = torch.cuda.get_device_name().upper()
    preset = next((g for k, g in sorted(GPU_PRESETS.items(), key=lambda kv: -len(kv[0])) if k.upper() in name), p.gpu)
    _, _, stages = flops_per_step(p.shape, p.layout, replace(p.recipe, recompute_granularity=None), p.padded_vocab_size)
    per_gpu = p.layout.world_size // p.layout.pipeline_model_parallel_size
    return {"stage_flops": [s / per_gpu for s in stages], "peak": preset.peak_flops(p.recipe.precision)}


def clock_for(rank) -> Optional[StepClock]:
    """A :class:`StepClock` hung on the model's config when ``training.breakdown_interval`` > 0, else None
    (collective when on)."""
    interval = rank.cfg.training.breakdown_interval
    if not interval:
        return None
    clock = StepClock(rank, interval)
    rank.built.tf_config.timers = clock
    return clock


def section(clock: Optional[StepClock], name: str):
    return clock.section(name) if clock is not None else contextlib.nullcontext()
