"""When a job saves: every ``checkpoint.save_interval`` iterations, or, with ``save_interval=auto``, every
Young–Daly interval (Young 1974, Daly 2006: ``tau* = sqrt(2 C M)`` maximises the share of time that trains,
first order in the failure rate; :mod:`orchestrator.plan.goodput` has the model).

With ``auto`` the interval is chosen, identically on every rank (the save is collective):

1. once ``checkpoint.auto_min_interval`` iterations of this attempt have run, from C = the planner's
   predicted blocking time of a save (its bytes at :data:`orchestrator.plan.goodput.WRITE_GBPS_PER_NODE`
   per node) — no save has been measured yet;
2. after every save, from C = that save's measured blocking time (the slowest rank's: training waited
   that long; an asynchronous save blocks only for staging).

M is the job's mean time between failures (:func:`orchestrator.plan.goodput.job_mtbf`: ``cluster.mtbf_hours``,
else this run's history once it has failures, else published fleet data per node), read on rank 0 at the
first choice; the step time is the slowest rank's median iteration wall time over the last
:data:`STEP_WINDOW` iterations. The interval in iterations, ``round(sqrt(2 C M) / step)``, is clipped to
``[auto_min_interval, auto_max_interval]``; the next save is that many iterations after the last one (or
after the attempt's start). Each choice is a ``save_interval`` event in metrics.jsonl with its inputs, and
a line in rank 0's log.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Dict, Optional

import torch

from orchestrator.runtime.rank.build import Rank

STEP_WINDOW = 50
"""Iterations whose wall times give the step time of a choice (their median: a save's or an evaluation's
iteration does not move it)."""


class SaveSchedule:
    """``due(iteration)`` every iteration on every rank (collective when ``auto`` chooses), ``saved(iteration,
    blocking_s)`` after every save."""

    def __init__(self, rank: Rank, start_iteration: int, trackers=None):
        c = rank.cfg.checkpoint
        self.rank, self.trackers = rank, trackers
        self.auto = c.save_interval == "auto"
        self.every: Optional[int] = None if self.auto else (c.save_interval or None)
        self.bounds = (int(c.auto_min_interval), c.auto_max_interval)
        self.last_save = start_iteration
        self.next_save: Optional[int] = None
        self.first_choice = start_iteration + self.bounds[0]
        self.mtbf: Optional[tuple] = None  # (seconds, source), rank 0's, at the first choice
        self.steps: deque = deque(maxlen=STEP_WINDOW)
        self._tick: Optional[float] = None
        self.choices: list = []

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` (just trained) saves; with ``auto``, the first choice is made here (collective)."""
        now = time.perf_counter()
        if self._tick is not None:
            self.steps.append(now - self._tick)
        self._tick = now
        if not self.auto:
            return bool(self.every) and iteration % self.every == 0
        if self.next_save is None and iteration >= self.first_choice:
            self._choose(iteration, self._predicted_save_s(), "predicted")
        return self.next_save is not None and iteration >= self.next_save

    def saved(self, iteration: int, blocking_s: float) -> None:
        """After a save at ``iteration`` that held training ``blocking_s`` (the same on every rank): with
        ``auto``, the next interval from that measured cost (collective)."""
        self.last_save = iteration
        if self.auto:
            self._choose(iteration, blocking_s, "measured")
        self._tick = time.perf_counter()  # the save's own wall time is not a step

    def _predicted_save_s(self) -> float:
        from orchestrator.plan.ckpt_size import checkpoint_bytes
        from orchestrator.plan.goodput import checkpoint_seconds

        cfg = self.rank.cfg
        return checkpoint_seconds(checkpoint_bytes(cfg, self.rank.layout), int(cfg.cluster.nodes or 1))

    def _job_mtbf(self) -> tuple:
        """(seconds, source) of the job's MTBF: rank 0 reads the run's history once, every rank gets it."""
        if self.mtbf is None:
            box: list = [None]
            if self.rank.rank0:
                box[0] = history_mtbf(self.rank.cfg)
            torch.distributed.broadcast_object_list(box, src=0)
            self.mtbf = tuple(box[0])
        return self.mtbf

    def _choose(self, iteration: int, save_s: float, save_source: str) -> None:
        from orchestrator.plan.goodput import interval_iterations, young_daly_s

        mtbf_s, mtbf_source = self._job_mtbf()
        mine = statistics.median(self.steps) if self.steps else 0.0
        step = torch.tensor([mine], dtype=torch.float64, device=self.rank.tensor_device)
        torch.distributed.all_reduce(step, op=torch.distributed.ReduceOp.MAX)
        step_s = max(float(step[0]), 1e-6)
        interval = interval_iterations(save_s, mtbf_s, step_s, *self.bounds)
        self.next_save = self.last_save + interval
        record: Dict[str, object] = {
            "event": "save_interval",
            "iteration": iteration,
            "interval": interval,
            "next_save": self.next_save,
            "young_daly_s": round(young_daly_s(save_s, mtbf_s), 4),
            "save_s": save_s,
            "save_s_source": save_source,
            "mtbf_s": mtbf_s,
            "mtbf_source": mtbf_source,
            "step_s": step_s,
            "bounds": list(self.bounds),
            "time": time.time(),
        }
        self.choices.append(record)
        if self.trackers is not None:
            self.trackers.event(record)
        if self.rank.rank0:
            print(
                f"checkpoint.save_interval=auto: every {interval} iterations (next save at {self.next_save}): "
                f"sqrt(2 x C {save_s:.3g} s ({save_source}) x M {mtbf_s / 3600:.3g} h ({mtbf_source})) / step "
                f"{step_s:.3g} s, within [{self.bounds[0]}, {self.bounds[1] if self.bounds[1] else 'no max'}]",
                flush=True,
            )


def history_mtbf(cfg) -> tuple:
    """(seconds, source) of the job's MTBF for ``cfg`` (:func:`orchestrator.plan.goodput.job_mtbf`), with the
    failures and wall time of the run's own history (orchestrator.ckpt.goodput) when it has failures."""
    from orchestrator.ckpt.goodput import account
    from orchestrator.plan.goodput import job_mtbf

    failures, wall_s = 0, 0.0
    if not cfg.cluster.mtbf_hours:
        acc = account(cfg.run.dir)
        if acc is not None:
            failures, wall_s = len(acc.failures), acc.wall_s
    return job_mtbf(cfg.cluster.mtbf_hours, int(cfg.cluster.nodes or 1), failures, wall_s)
