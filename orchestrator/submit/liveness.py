"""Is a job's process alive: a local job's ranks (the submitit controller's children and the ranks they forked), a
process id, a rank's result file (written, or left stale by an earlier attempt). The one place the launcher and
``status`` ask. No torch import."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple


def read_result(path: Path) -> Optional[Tuple[str, Any]]:
    if not path.exists():
        return None
    from submitit.core.utils import pickle_load

    try:
        return pickle_load(path)
    except Exception:  # being written
        return None


def local_alive_ranks(job) -> Optional[set]:
    """Ranks whose local task process is alive (None when the controller is gone or unreadable).

    Tasks are the controller's direct children; each carries its rank in SUBMITIT_LOCAL_GLOBALID
    (the checkpoint writer's forked helpers are grandchildren and are not counted). Ranks forked by
    the task (:mod:`orchestrator.runtime.start.forked`) are found by the process ids their job recorded.
    """
    import psutil

    from orchestrator.runtime.start.forked import alive_forked_ranks

    process = getattr(job, "_process", None)
    if process is None or process.poll() is not None:
        return None
    try:
        controller = psutil.Process(process.pid)
        if "submitit.local._local" not in " ".join(controller.cmdline()):  # started through a shell
            controller = next(
                (c for c in controller.children() if "submitit.local._local" in " ".join(c.cmdline())), None
            )
            if controller is None:
                return None
        alive = set()
        for child in controller.children():
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                rank = child.environ().get("SUBMITIT_LOCAL_GLOBALID")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if rank is not None:
                alive.add(int(rank))
        forked = alive_forked_ranks(job.paths.folder, str(job.job_id))
        if getattr(job, "forks_ranks", False) and forked is None:
            return None  # the task is still importing: its ranks are not forked yet
        return alive | (forked or set())
    except psutil.NoSuchProcess:
        return None


def dead_ranks(job, world_size: int, results: Dict[int, Any]) -> List[int]:
    """Local ranks that exited without writing a result (SIGKILL, OOM killer); re-checked after 1 s."""
    for attempt in range(2):
        alive = local_alive_ranks(job)
        if alive is None and getattr(job, "forks_ranks", False) and 0 not in results:
            # the task that forked the ranks (rank 0) ended without a result; its forks died with it
            from orchestrator.runtime.start.forked import read_rank_pids

            forked = bool(read_rank_pids(job.paths.folder, str(job.job_id)))
            return [0] if forked and read_result(Path(job.task(0).paths.result_pickle)) is None else []
        process = getattr(job, "_process", None)
        ended = alive is None and process is not None and process.poll() is not None
        if (alive is None and not ended) or (not alive and not results):
            return []  # not started yet, or nothing ran to compare with (handled by the state check)
        alive = alive or set()  # a controller that ended with its tasks: a rank without a result died
        for i in range(world_size):
            if i not in results:
                r = read_result(Path(job.task(i).paths.result_pickle))
                if r is not None:
                    results[i] = r
        dead = [i for i in range(world_size) if i not in results and i not in alive]
        if not dead:
            return []
        if attempt == 0:
            time.sleep(1.0)  # a rank may have been between writing its result and exiting
    return [0] if 0 in dead and getattr(job, "forks_ranks", False) else dead  # its forks died with rank 0


def result_mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def is_stale(rank: int, path: Path, stale: Dict[int, float]) -> bool:
    """Rank ``rank``'s result file still holds what a failed, requeued attempt wrote."""
    return rank in stale and result_mtime(path) == stale[rank]


def pid_alive(pid: str) -> bool:
    try:
        p = int(pid)
        os.kill(p, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    try:  # a recycled pid is not our job
        cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
        return b"submitit" in cmdline or b"python" in cmdline
    except OSError:
        return True
