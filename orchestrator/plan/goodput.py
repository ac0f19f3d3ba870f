"""The goodput forecast: the expected effective training time ratio (ETTR) of a job at its size, and the
checkpoint interval that maximises it.

Model (Young 1974, Daly 2006; Kokolis et al. 2024 model ETTR the same way): the job saves every ``tau``
seconds of training, each save blocks training for ``C`` seconds (a cycle ``c = tau + C``), failures arrive at
random (Poisson) with mean time between failures ``M`` (the job's: a node's MTBF / the number of nodes) while the
job is up — training, saving, and redoing lost work alike — and each failure costs the restart ``R`` (detection,
re-queue or in-place restart, start-up, checkpoint load) plus the work since the last completed save. Between
two failures the job is up ``g ~ Exp(M)`` and keeps ``floor(g / c)`` cycles, ``E = 1 / (e^(c/M) - 1)`` of them;
by renewal-reward (kept training over up time plus restart, per failure)

    ETTR = tau / ((M + R) (e^((tau + C) / M) - 1))

which to first order in ``c / M`` is ``tau / (tau + C) x 1 / (1 + (R + (tau + C) / 2) / M)`` (half a cycle lost
per failure), and the interval that maximises it is, to first order, Young–Daly's ``tau* = sqrt(2 C M)``. The
first-order form counts failures only during kept work: at ``c / M`` = 0.5 it was 6.0 points above a measured
ETTR of 53.0%, which this form puts at 53.3% (``bench/goodput.py``: T = 60 s, every 72
iterations). Failures during a restart are not modelled (second order in ``R / M``).

Pure Python, no torch: ``plan=true`` prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple

NODE_MTBF_HOURS = 54 * 24 * 2048 / 419
"""A node's mean time between unexpected interruptions, hours (~6,335): Llama 3 405B's pretraining (Meta,
"The Llama 3 Herd of Models", 2024, sec. 3.3.4) saw 419 unexpected interruptions in 54 days on 16,384 H100s
(2,048 nodes of 8 GPUs), ~78% of them hardware. Used when the run's own history has no failures yet."""

RESTART_S_IN_PLACE = 120.0
"""A failure's cost with in-place restarts (``cluster.max_restarts`` > 0), seconds, before the load: detection
(a crash is seen at once; the hang watchdog's timeout is extra) and a restart of every rank in the allocation
(Megatron-LM's in-process restart allows 60/90 s soft/hard)."""

RESTART_S_REQUEUE = 600.0
"""The same through a SLURM requeue: the job re-enters the queue and starts afresh (an assumption: a busy
cluster's queue can make it hours)."""

WRITE_GBPS_PER_NODE = 2.0
"""Checkpoint write bandwidth per node, GB/s (a parallel file system client; torch_dist writes from every rank
at once), used when no save was measured. Reads (the load after a restart) are assumed as fast."""


@dataclass(frozen=True)
class Forecast:
    """What a job's goodput is expected to be. Seconds unless named otherwise."""

    nodes: int
    mtbf_s: float
    """The job's mean time between failures."""
    save_s: float
    """A save's blocking time, C."""
    restart_s: float
    """A failure's cost besides the work redone, R (restart + checkpoint load)."""
    step_s: float
    interval_iters: int
    """The configured ``checkpoint.save_interval``."""
    ettr: float
    """Expected ETTR at the configured interval."""
    best_interval_iters: int
    """Young–Daly's interval, in iterations (at least 1)."""
    best_ettr: float
    mtbf_source: str = ""
    """Where ``mtbf_s`` comes from (:func:`job_mtbf`)."""
    auto: bool = False
    """``checkpoint.save_interval=auto``: the job starts at the Young–Daly interval (``interval_iters``)."""

    def lines(self) -> list:
        """The forecast as the plan says it."""
        return [
            f"goodput forecast (Young/Daly; ETTR = tau / ((M+R)(e^((tau+C)/M) - 1))): job MTBF M = "
            f"{self.mtbf_s / 3600:.3g} h ({self.mtbf_source}), save blocking C = {self.save_s:.3g} s, restart + load "
            f"R = {self.restart_s:.3g} s",
            f"  checkpoint.save_interval={'auto: ' if self.auto else ''}{self.interval_iters} (tau = {self.interval_iters * self.step_s:.3g} s): "
            f"expected ETTR {100 * self.ettr:.1f}%; Young-Daly sqrt(2CM) = {self.best_interval_iters} iterations: "
            f"{100 * self.best_ettr:.1f}%",
        ]


def expected_ettr(interval_s: float, save_s: float, mtbf_s: float, restart_s: float) -> float:
    """ETTR at save interval ``interval_s`` (training seconds between saves); see the module docstring.
    Raises ValueError for a non-positive interval or MTBF."""
    if interval_s <= 0 or mtbf_s <= 0:
        raise ValueError(f"interval_s={interval_s} and mtbf_s={mtbf_s} must be > 0")
    return interval_s / ((mtbf_s + restart_s) * math.expm1((interval_s + save_s) / mtbf_s))


def job_mtbf(mtbf_hours: Optional[float], nodes: int, failures: int = 0, wall_s: float = 0.0) -> Tuple[float, str]:
    """(the job's mean time between failures in seconds, where it comes from): ``cluster.mtbf_hours`` when
    given; else the run's own history once it has failures (its wall time over all attempts / its failures);
    else :data:`NODE_MTBF_HOURS` / ``nodes`` (a job fails when any of its nodes does)."""
    if mtbf_hours:
        return mtbf_hours * 3600.0, f"cluster.mtbf_hours={mtbf_hours:g}"
    if failures > 0 and wall_s > 0:
        return wall_s / failures, f"this run's history: {failures} failure(s) in {wall_s / 3600:.3g} h"
    nodes = max(int(nodes), 1)
    return NODE_MTBF_HOURS * 3600.0 / nodes, (
        f"{NODE_MTBF_HOURS:,.0f} node-hours (Llama 3's fleet) / {nodes} node(s); set cluster.mtbf_hours for yours"
    )


def young_daly_s(save_s: float, mtbf_s: float) -> float:
    """Young–Daly's checkpoint interval ``sqrt(2 C M)``, seconds of training between saves."""
    return math.sqrt(2.0 * max(save_s, 0.0) * mtbf_s)


def interval_iterations(save_s: float, mtbf_s: float, step_s: float, lo: int = 1, hi: Optional[int] = None) -> int:
    """Young–Daly's interval in whole iterations of ``step_s`` seconds, clipped to ``[lo, hi]``."""
    n = max(lo, int(round(young_daly_s(save_s, mtbf_s) / max(step_s, 1e-9))))
    return min(n, hi) if hi is not None else n


def forecast(
    nodes: int,
    step_s: float,
    save_s: float,
    load_s: float,
    interval_iters: int,
    in_place: bool,
    mtbf_hours: Optional[float] = None,
    auto: Optional[Tuple[int, Optional[int]]] = None,
) -> Forecast:
    """The forecast for a job of ``nodes`` nodes whose step takes ``step_s`` and whose save blocks ``save_s`` and
    loads in ``load_s``; ``in_place``: failures restart in place (else a requeue); ``mtbf_hours``: the job's MTBF
    (:func:`job_mtbf`); ``auto``: ``(min, max)`` bounds of ``checkpoint.save_interval=auto``, whose interval
    (Young–Daly's, clipped) replaces ``interval_iters``."""
    mtbf_s, source = job_mtbf(mtbf_hours, nodes)
    restart_s = (RESTART_S_IN_PLACE if in_place else RESTART_S_REQUEUE) + load_s
    best = interval_iterations(save_s, mtbf_s, step_s)
    if auto is not None:
        interval_iters = interval_iterations(save_s, mtbf_s, step_s, auto[0], auto[1])
    return Forecast(
        nodes=nodes,
        mtbf_s=mtbf_s,
        save_s=save_s,
        restart_s=restart_s,
        step_s=step_s,
        interval_iters=interval_iters,
        ettr=expected_ettr(interval_iters * step_s, save_s, mtbf_s, restart_s),
        best_interval_iters=best,
        best_ettr=expected_ettr(best * step_s, save_s, mtbf_s, restart_s),
        mtbf_source=source,
        auto=auto is not None,
    )


def checkpoint_seconds(checkpoint_bytes: int, nodes: int, gbps_per_node: float = WRITE_GBPS_PER_NODE) -> float:
    """Seconds to write (or read) ``checkpoint_bytes`` from ``nodes`` nodes at ``gbps_per_node`` GB/s each."""
    return checkpoint_bytes / (max(nodes, 1) * gbps_per_node * 1e9)
