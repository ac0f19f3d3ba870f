"""A sweep's bookkeeping in the driver process: each point's record (``<point dir>/point.json``, written
atomically, the summary rebuilt after it), the driver's state while Hydra runs the points, and the lines
it says. How a point is evaluated and launched: :mod:`orchestrator.sweep.driver`; SLURM points queued
and waited on at the end: :mod:`orchestrator.sweep.queue`.
"""

from __future__ import annotations

import json
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.io import write_atomic
from orchestrator.sweep.records import FINAL, POINT_FILE, job_id_in, measured
from orchestrator.sweep.render import short_reason
from orchestrator.sweep.table import write_summary


def say(message: str) -> None:
    try:
        print("\n".join(f"[sweep] {line}" for line in message.splitlines()), flush=True)
    except OSError:  # the terminal is gone (a SIGHUP): the point files and the table still say it
        pass


def tail(text: str, lines: int = 15) -> str:
    """The error's last lines, after its first line (which usually names the job and rank)."""
    all_lines = str(text).rstrip().splitlines()
    if len(all_lines) <= lines:
        return "\n".join(all_lines)
    return "\n".join([all_lines[0], "..."] + all_lines[-(lines - 1) :])


@dataclass
class Point:
    """Where a multirun point lives and how Hydra composed it."""

    sweep_dir: Path
    run_dir: Path
    num: int
    overrides: List[str]


@dataclass
class Driver:
    """What this process learned while Hydra ran the points (read by :func:`finish`)."""

    sweep_dir: Optional[Path] = None
    submitted: List[Tuple[Point, Any, int, str]] = field(default_factory=list)
    """(point, JobConfig, world size, job id) of SLURM jobs submitted without waiting."""
    wait_at_end: bool = True
    pool: Any = None
    """The warm ranks of local points (orchestrator.submit.pool_launcher.PoolLauncher), made by the first one."""
    points: Optional[int] = None
    """How many points the sweep has (:func:`announce`), for "point 2 of 3"."""
    signals: Any = None
    """From the first queued SLURM point to the last wait: a signal detaches from all (submit.signals.DetachSignals)."""

    def launcher(self, cfg: Any) -> Any:
        """How a point runs: warm ranks (local, ``sweep.warm_pool``) or None (a fresh job)."""
        if cfg.cluster.kind != "local" or not cfg.sweep.warm_pool:
            return None
        if self.pool is None:
            from orchestrator.submit.pool_launcher import PoolLauncher

            self.pool = PoolLauncher(Path(self.sweep_dir) / ".pool")
        return self.pool

    def close_pool(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


DRIVER = Driver()


def announce(points: int, swept: List[str], cluster_kind: str) -> None:
    """The sweep's first line (Hydra's own launcher lines are off: conf/config.yaml)."""
    DRIVER.points = points
    how = "all queued at once on SLURM" if cluster_kind == "slurm" else "one after another on this machine"
    say(f"{points} point{'s' * (points != 1)} ({' x '.join(swept) or 'no swept key'}), {how}")


def current_point() -> Optional[Point]:
    """The multirun point being composed, or None in a single run (or outside Hydra)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode
    except ImportError:  # pragma: no cover - hydra is a dependency
        return None
    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:
        return None
    return Point(
        sweep_dir=Path(hc.sweep.dir).absolute(),
        run_dir=Path(hc.runtime.output_dir).absolute(),
        num=int(hc.job.num),
        overrides=[str(o) for o in hc.overrides.task],
    )


def write_point(point: Point, record: Dict[str, Any]) -> None:
    point.run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(point.run_dir / POINT_FILE, json.dumps(record, indent=1, default=str) + "\n")


def rebuild(sweep_dir: Path) -> None:
    """Rebuild the summary; a broken summary never takes the sweep down."""
    try:
        write_summary(sweep_dir)
    except Exception as exc:  # pragma: no cover - diagnostics only
        say(f"warning: could not rebuild the summary of {sweep_dir}: {exc!r}")


def record_point(
    point: Point, record: Dict[str, Any], status: str, reason: str = "", quiet: bool = False, **extra: Any
) -> None:
    """Write the point's status (``quiet``: no line, no table: a detach says one line for all points)."""
    record.update(status=status, reason=reason, **extra)
    if status in FINAL:
        record["ended"] = time.time()
        if status in ("completed", "stopped"):
            record["measured"] = measured(point.run_dir, record.get("training", {}).get("timing_warmup_iters", 0))
    record["job_id"] = record.get("job_id") or job_id_in(point.run_dir)
    write_point(point, record)
    if quiet:
        return
    if status != "running":
        reached, total = (record.get("measured") or {}).get("iteration"), record.get("training", {}).get("train_iters")
        at = f" at iteration {reached} of {total}" if reached is not None and total else ""
        line = f"point {point.num}: {status}{at}" + (f" -- {short_reason(reason)}" if reason else "")
        say(line)
    rebuild(point.sweep_dir)


def exception_reason(exc: BaseException, frames: int = 6, message_lines: int = 8) -> str:
    """An unexpected exception's last frames, then its type and message (the message first lines)."""
    tb = traceback.format_tb(exc.__traceback__)[-frames:]
    message = "".join(traceback.format_exception_only(type(exc), exc)).rstrip().splitlines()
    if len(message) > message_lines:
        message = message[:message_lines] + ["..."]
    return "".join(tb).rstrip() + "\n" + "\n".join(message)


def job_id_from_message(message: str) -> Optional[str]:
    m = re.search(r"\bjob (\d+(?:_\d+)?)\b", message)
    return m.group(1) if m else None
