"""Settings of the two slowness checks: ``cluster.link_check`` (links before training) and
``training.straggler`` (slow ranks during it). Sections of :class:`~orchestrator.config.cluster.ClusterConfig`
and :class:`~orchestrator.config.schema.TrainingConfig`; the checks themselves are
:mod:`orchestrator.runtime.faults.links` and :mod:`orchestrator.runtime.faults.straggler`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

LINKS_ONLY = "only"
"""``cluster.link_check.action`` of the job ``python -m orchestrator check links`` submits (never a user's value):
the ranks rendezvous, check the links and end."""


@dataclass
class LinkCheckConfig:
    """Before the first iteration of a multi-node job: the bandwidth of every cross-node link the layout uses."""

    action: str = "warn"
    """warn: name a slow link and train; refuse: name it and stop before training (exit 2, not requeued); off."""
    min_fraction: float = 0.5
    """A link below this fraction of the median of the other links of its kind is slow (0 < x <= 1)."""
    min_gbps: Optional[float] = None
    """A link below this many Gbit/s is slow, whatever the others measure; null: no floor. The only
    judge of a kind with a single link (a 2-node job with one pipeline cut)."""
    megabytes: float = 4.0
    """Bytes sent per measurement (MB; the best of 3 after a warm-up of 1/8 of it)."""


@dataclass
class StragglerConfig:
    """During training: each rank's compute time per iteration, compared among ranks every ``interval`` iterations."""

    interval: Optional[int] = 8
    """Iterations per window (one score per rank per window); null: off."""
    threshold: float = 0.4
    """A rank whose compute per planned FLOP exceeds the median of the other ranks' and its own best window's by
    more than this fraction (0.4 = 40% slower: nvidia-resiliency-ext's 0.7 score in NVIDIA's recipes) straggles in
    that window (0 < x < 10; more than 2x the others': whatever its history). At 0.2 with the other ranks alone,
    unthrottled ranks on a loaded shared machine (load 27-32, 2 cores) were named in 2 of 5 stretches
    (``bench/straggler.py --rule``)."""
    windows: int = 3
    """Windows in a row a rank must straggle before it is named. With ``interval`` 8: a rank throttled from
    any iteration on is named within 29 iterations (a window counts once 6 of its 8 iterations are slow)."""
