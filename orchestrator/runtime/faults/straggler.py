"""Straggler detection (``training.straggler``): a rank or host that computes slower than its peers, named
while the run is live.

What is timed, on every rank, every iteration: its own compute — each call of the forward step megatron is
given and of megatron's ``backward_step`` (the module attribute is swapped in for the iteration's schedule
and restored after it) — never the point-to-point receives, the data-parallel all-reduce or the optimizer, so
a rank waiting for a slow peer does not look slow itself (every rank of a pipeline waits as long as the
slowest one).

* On a GPU: CUDA events recorded around each call, read once per window (no host synchronisation per
  iteration; kernels run asynchronously, so wall time around a call would measure only the launches).
* On a CPU: the wall time of each call. Not the rank's CPU time: a CPU quota (cgroup ``cpu.cfs_quota_us``
  / ``cpu.max``) or an oversubscribed host stretches a rank's wall time while its CPU time per unit of
  work stays the same (measured here: 200 matmuls, 0.09 CPU-s either way, 0.4 -> 1.1 wall-s at a 20%
  quota), so a throttled rank is invisible to CPU time. The CPU seconds of the same calls are kept beside
  it (``cpu_ms``): a wall far above them says the rank waited for a core.

Each window of at least ``interval`` iterations, at the loop's next logging iteration, each rank's score — the
lower quartile over the window's iterations of its compute seconds (:func:`lower_quartile`), divided by its
pipeline stage's planned hardware FLOPs (:func:`orchestrator.plan.cost.flops_per_step`, so ranks of different
stages compare; data-parallel peers of a stage have the same FLOPs) — rides to every rank on that iteration's
one all-reduce (runtime.training.exchange: no collective of its own; with the shipped ``training.log_interval``
10 and ``interval`` 8, windows of 10). Every rank then judges the same numbers: a rank whose score exceeds the
median of the *other* ranks' by more than ``threshold`` and its own best score of the windows before by more
than ``threshold`` (it got slower: nvidia-resiliency-ext's individual score; or it is more than twice as slow
as the others, :data:`ALONE`) straggles in that window (:func:`judge`); after ``windows`` windows in a row it is
named (rank 0 prints one line; the logging rank writes a ``straggler`` record to ``metrics.jsonl``), once
per episode. On a job of several hosts, a host whose ranks are all named is named as the host. The named
ranks and hosts go into the run's summary (``stragglers``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Dict, Iterator, List, Optional

import torch


def stage_flops(rank) -> List[float]:
    """Planned hardware FLOPs per optimizer step of each pipeline stage (the planner's count); equal
    weights when the planner cannot count this config."""
    from orchestrator.errors import OrchestratorError
    from orchestrator.plan.cost import flops_per_step
    from orchestrator.plan.memory import plan

    pp = rank.layout.pipeline_model_parallel_size
    try:
        p = plan(rank.cfg, vocab_size=rank.built.padded_vocab_size, profile=None, layout=rank.layout)
        return [float(x) for x in flops_per_step(p.shape, p.layout, p.recipe, p.padded_vocab_size)[2]]
    except (OrchestratorError, ValueError, ZeroDivisionError):
        return [1.0] * pp


def lower_quartile(values: List[float]) -> float:
    """The window's typical iteration, robust to a few iterations slowed by something else on the host (a
    save, a burst of another process): the lower quartile (3rd of 10). A straggler is slow in every iteration."""
    return sorted(values)[len(values) // 4]


ALONE = 1.0
"""Slower than the other ranks by more than this (2x) straggles whatever the rank's own history says (a rank slow
from its first window has no faster past to compare with)."""


def judge(scores: List[float], threshold: float, best: Optional[List[Optional[float]]] = None) -> List[Optional[float]]:
    """For each rank, how much slower than the median of the other ranks' scores it is (0.35 = 35% slower)
    when that exceeds ``threshold``, else None. Fewer than 2 ranks: nobody.

    ``best``: each rank's own best (lowest) score of the windows before (None: no history yet). With it, a rank
    straggles only when it is also slower than its own best by more than ``threshold`` — it got slower, as
    nvidia-resiliency-ext's individual score asks (its relative score alone named a different, unthrottled rank
    in most stretches on a loaded shared machine, where ranks differ by up to 45% for as long as the load lasts)
    — or when it is more than :data:`ALONE` slower than the others."""
    out: List[Optional[float]] = []
    for r, score in enumerate(scores):
        others = scores[:r] + scores[r + 1 :]
        ref = statistics.median(others) if others else 0.0
        slower = score / ref - 1.0 if ref > 0 else 0.0
        if best is not None and slower <= ALONE:
            own = best[r]
            slower = slower if own and score / own - 1.0 > threshold else 0.0
        out.append(slower if slower > threshold else None)
    return out


def straggling_hosts(hosts: List[str], streak: List[int], windows: int) -> List[tuple]:
    """``(host, its ranks)`` for each host whose ranks have all straggled ``windows`` windows in a row; none
    on a job of one host (its ranks are compared only with each other)."""
    if len(set(hosts)) < 2:
        return []
    by_host: Dict[str, List[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    return [(h, ranks) for h, ranks in sorted(by_host.items()) if all(streak[r] >= windows for r in ranks)]


class StragglerWatch:
    """One rank's compute clock and the window verdicts (see the module docstring). Build it on every rank;
    ``timing`` wraps each iteration's schedule, ``tick`` ends it; when :meth:`due`, :meth:`row` rides on the
    logging all-reduce and :meth:`verdict` reads every rank's."""

    def __init__(self, rank, trackers, start: int):
        from megatron.core import parallel_state as ps

        sc = rank.cfg.training.straggler
        self.rank, self.trackers = rank, trackers
        self.interval, self.threshold, self.windows = int(sc.interval), float(sc.threshold), int(sc.windows)
        self.world = torch.distributed.get_world_size()
        self.pp_rank, self.dp_rank = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank()
        self.flops = stage_flops(rank)[self.pp_rank]
        self.cuda = rank.device == "cuda"
        self.skip_until = start + rank.cfg.training.timing_warmup_iters  # first iterations: allocation, caches
        self._iter_wall, self._iter_cpu = 0.0, 0.0
        self._events: List[tuple] = []
        self._window: List[tuple] = []  # per iteration: (wall s or the iteration's events, cpu s)
        self.window_iterations = self.interval  # the last closed window's length (a logging iteration closes it)
        self.streak = [0] * self.world
        self.best: List[Optional[float]] = [None] * self.world  # each rank's best score so far (its own history)
        self.named: List[Dict[str, object]] = []
        self._named_hosts: set = set()

    # -- timing
    def _timed(self, fn):
        def timed(*args, **kwargs):
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                c0 = time.thread_time()
                out = fn(*args, **kwargs)
                end.record()
                self._events.append((start, end))
            else:
                w0, c0 = time.perf_counter(), time.thread_time()
                out = fn(*args, **kwargs)
                self._iter_wall += time.perf_counter() - w0
            self._iter_cpu += time.thread_time() - c0
            return out

        return timed

    @contextlib.contextmanager
    def timing(self, forward_step) -> Iterator[object]:
        """For one iteration's ``forward_backward``: yields the timed forward step; megatron's
        ``backward_step`` is timed while inside."""
        from megatron.core.pipeline_parallel import schedules

        saved = schedules.backward_step
        schedules.backward_step = self._timed(saved)
        try:
            yield self._timed(forward_step)
        finally:
            schedules.backward_step = saved

    def tick(self, iteration: int) -> None:
        """End of iteration ``iteration``'s schedule: its compute seconds join the window."""
        if iteration <= self.skip_until:
            self._iter_wall, self._iter_cpu, self._events = 0.0, 0.0, []
            return
        self._window.append((list(self._events) if self.cuda else self._iter_wall, self._iter_cpu))
        self._iter_wall, self._iter_cpu, self._events = 0.0, 0.0, []

    def due(self) -> bool:
        """The window holds ``interval`` iterations: its verdict rides on the next logging all-reduce (the
        same on every rank)."""
        return len(self._window) >= self.interval

    def row(self) -> List[float]:
        """This rank's part of the verdict (closes the window): ``[score, compute s, CPU s, pp rank, dp rank]``,
        the score being the window's :func:`lower_quartile` compute seconds per planned FLOP of the stage."""
        compute = lower_quartile(self._seconds())
        cpu = lower_quartile([c for _, c in self._window])
        self.window_iterations, self._window = len(self._window), []
        return [compute / self.flops, compute, cpu, float(self.pp_rank), float(self.dp_rank)]

    def _seconds(self) -> List[float]:
        if not self.cuda:
            return [w for w, _ in self._window]
        if self._window and self._window[-1][0]:
            self._window[-1][0][-1][1].synchronize()  # the window's last kernel: every event before it is done
        return [sum(s.elapsed_time(e) for s, e in evs) / 1000.0 for evs, _ in self._window]

    # -- the verdict
    def verdict(self, iteration: int, rows: List[List[float]]) -> None:
        """Every rank's :meth:`row` (rank order), the same on every rank: who straggles, who is named."""
        scores = [r[0] for r in rows]
        slower = judge(scores, self.threshold, self.best)
        self.best = [s if b is None else min(b, s) for b, s in zip(self.best, scores)]  # every rank: the same
        hosts = list(self.rank.info.hosts)
        for r, s in enumerate(slower):
            self.streak[r] = self.streak[r] + 1 if s is not None else 0
            if s is not None and self.streak[r] == self.windows:
                self._name(
                    {
                        "event": "straggler",
                        "iteration": iteration,
                        "rank": r,
                        "host": hosts[r],
                        "pp_rank": int(rows[r][3]),
                        "dp_rank": int(rows[r][4]),
                        "slower_by": round(s, 4),
                        "compute_ms": round(rows[r][1] * 1e3, 3),
                        "cpu_ms": round(rows[r][2] * 1e3, 3),
                        "windows": self.windows,
                        "interval": self.window_iterations,  # the window as closed (>= interval)
                        "time": time.time(),
                    }
                )
        self._name_hosts(iteration, hosts)

    def _name_hosts(self, iteration: int, hosts: List[str]) -> None:
        for host, ranks in straggling_hosts(hosts, self.streak, self.windows):
            if host not in self._named_hosts:
                self._named_hosts.add(host)
                self._name(
                    {
                        "event": "straggler",
                        "iteration": iteration,
                        "host": host,
                        "ranks": ranks,
                        "windows": self.windows,
                        "interval": self.window_iterations,  # the window as closed (>= interval)
                        "time": time.time(),
                    }
                )

    def _name(self, record: Dict[str, object]) -> None:
        hosts = set(getattr(self.rank.info, "hosts", ()) or ())
        record["line"] = describe(record, self.threshold, len(hosts) > 1)  # what the log says, for ``status``
        self.named.append(record)
        self.trackers.event(record)  # the logging rank writes it
        if self.rank.rank0:
            print(f"[orchestrator] warning: {record['line']}", flush=True)


def describe(record: Dict[str, object], threshold: float, other_hosts: bool = True) -> str:
    """One line naming a straggling rank or host, with its numbers and what to look at (and, when the job has
    ``other_hosts``, leaving the host out)."""
    span = (
        f"{record['windows']} windows of {record['interval']} iterations in a row, to iteration {record['iteration']}"
    )
    if "rank" not in record:
        return (
            f"straggler: host {record['host']} (all its ranks {record['ranks']}) computes slower than the other "
            f"hosts' ranks for {span}; fix: check that host (CPU quota or frequency, GPU clocks and "
            f"temperature: nvidia-smi -q -d PERFORMANCE), or leave it out (cluster.exclude={record['host']})"
        )
    compute, cpu = float(record["compute_ms"]), float(record["cpu_ms"])  # type: ignore[arg-type]
    if compute > 1.5 * cpu:  # it waited for a core
        seen, look = (
            f", {cpu:g} ms of it on a CPU",
            "a CPU quota (cgroup cpu.cfs_quota_us / cpu.max) or other processes",
        )
    else:
        seen, look = "", "that device (clocks, temperature: nvidia-smi -q -d PERFORMANCE; other processes)"
    return (
        f"straggler: rank {record['rank']} (host {record['host']}, pipeline stage {record['pp_rank']}, DP rank "
        f"{record['dp_rank']}) computes {float(record['slower_by']) * 100:.0f}% slower than the median of the "  # type: ignore
        f"other ranks per planned FLOP (threshold {threshold * 100:.0f}%; {compute:g} ms of compute per "
        f"iteration{seen}) for {span}; fix: check {look} on {record['host']}"
        + (f", or leave the host out (cluster.exclude={record['host']})" if other_hosts else "")
    )


def watch_for(rank, trackers, start: int) -> Optional[StragglerWatch]:
    """The watch of ``training.straggler`` from iteration ``start`` (None when ``interval`` is null or the job has
    one rank); windows begin after ``training.timing_warmup_iters``."""
    if rank.cfg.training.straggler.interval is None or torch.distributed.get_world_size() < 2:
        return None
    return StragglerWatch(rank, trackers, start)


def timing(watch: Optional[StragglerWatch], forward_step):
    """``watch.timing(forward_step)``, or the forward step unchanged without a watch."""
    return watch.timing(forward_step) if watch is not None else contextlib.nullcontext(forward_step)
