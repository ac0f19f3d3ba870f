"""Trials on warm ranks, one after another: :class:`PoolLauncher`, the drop-in for
:func:`orchestrator.submit.executor.launch` that a sweep or ``tune`` uses, keeps one
:class:`~orchestrator.submit.pool.WarmPool` while consecutive trials share its key and starts another when the
key changes or the pool ended. No torch import."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Optional

from orchestrator.config.layout import ParallelLayout
from orchestrator.config.schema import JobConfig
from orchestrator.errors import JobFailedError
from orchestrator.submit.pool import PoolEnded, WarmPool, pool_key


class PoolLauncher:
    """A drop-in for :func:`orchestrator.submit.executor.launch` that runs each trial on warm ranks.

    ``root``: where pools keep their files (``<root>/pool_<n>``); ``allocation_min``: a pool job's
    time limit (SLURM: the one allocation all its trials run in; default ``cluster.timeout_min``).
    """

    def __init__(self, root: Path, allocation_min: Optional[int] = None):
        self.root, self.allocation_min = Path(root), allocation_min
        self.pool: Optional[WarmPool] = None
        self.started = 0

    def __call__(
        self, cfg: JobConfig, layout: ParallelLayout, prepared, *, show_progress: bool = True
    ) -> Dict[str, Any]:
        from orchestrator.ckpt.rundir import METRICS_FILE
        from orchestrator.submit.progress import Progress

        retried = False
        while True:
            self.prestart(cfg, layout.world_size)
            progress = Progress(Path(cfg.run.dir) / METRICS_FILE, cfg.training.train_iters, enabled=show_progress)
            try:
                return self.pool.run(cfg, layout, prepared, 60.0 * cfg.cluster.timeout_min + 60.0, progress)
            except PoolEnded as exc:  # nothing of the trial ran: once more, on fresh ranks
                self.pool = None
                if retried:
                    raise JobFailedError(str(exc)) from None
                retried = True
                print(f"[orchestrator] {exc}; starting fresh warm ranks for it", flush=True)
            except BaseException:
                self.pool = None  # cancelled by run(); the next trial starts fresh ranks
                raise

    def prestart(self, cfg: JobConfig, world_size: int) -> None:
        """Have warm ranks for ``cfg`` (start them now, so that their imports overlap the launcher's own
        preparation of the trial); a pool with another key is closed first."""
        if self.pool is not None and (not self.pool.alive or self.pool.key != pool_key(cfg, world_size)):
            self.close()
        if self.pool is None:
            self.pool = WarmPool(cfg, world_size, self.root / f"pool_{self.started}", self.allocation_min)
            self.started += 1

    def stop(self) -> None:
        """Ask the ranks to exit without waiting (:meth:`close` waits)."""
        if self.pool is not None:
            self.pool.stop()

    def close(self, interrupted: bool = False) -> None:
        """End the warm ranks (``interrupted``: a signal to the launcher, :meth:`WarmPool.close`)."""
        if self.pool is not None:
            self.pool.close(interrupted=interrupted)
            self.pool = None
