"""A stop asked of a live job: ``<run.dir>/stop.json``, written by whoever asks, read by the job's rank 0.

Who asks: ``orchestrator stop RUN`` (cause ``by request``) and a launcher that waits on a local job
and gets SIGINT, SIGTERM or SIGHUP (cause ``interrupted``, :mod:`orchestrator.submit.signals`). Who
reads: the job's rank 0 polls it once a second (:func:`orchestrator.runtime.faults.launcher.watch_stop`)
and asks the ranks' one graceful stop (:mod:`orchestrator.runtime.faults.preempt`: every rank agrees
on the same iteration, saves unless that iteration is saved already, and exits; never requeued);
``status`` reads it to say ``stopping``. A request names the job it is for, so a request left by an
earlier job never stops a later one; a new submission removes it (:func:`clear`). No torch import.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Dict, Optional, Union

from orchestrator.ckpt.rundir import STOP_FILE
from orchestrator.io import write_atomic

PathLike = Union[str, Path]
BY_REQUEST = "by request"
"""The attempt cause of a job stopped by ``orchestrator stop`` (:data:`orchestrator.ckpt.history.CAUSES`)."""


def stop_path(run_dir: PathLike) -> Path:
    """``<run_dir>/stop.json``."""
    return Path(run_dir) / STOP_FILE


def request(run_dir: PathLike, job_id: str, *, by: str, cause: str, now: bool = False) -> Dict[str, Any]:
    """Ask job ``job_id`` to stop; ``by``: who asks, in words (``orchestrator stop``, ``SIGTERM to the
    launcher``); ``cause``: the attempt cause the job records (``by request`` or ``interrupted``);
    ``now``: the asker ends the job itself, unsaved (``--now``, a second signal). Written atomically."""
    record = {
        "job_id": str(job_id),
        "by": by,
        "cause": cause,
        "now": bool(now),
        "time": time.time(),
        "pid": os.getpid(),
    }
    write_atomic(stop_path(run_dir), json.dumps(record) + "\n", fsync=False)
    return record


def read(run_dir: PathLike, job_id: Optional[str] = None) -> Optional[Dict[str, Any]]:
    """The stop asked of ``job_id`` (of any job when None); None when none was asked or it is unreadable."""
    try:
        record = json.loads(stop_path(run_dir).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or (job_id is not None and str(record.get("job_id")) != str(job_id)):
        return None
    return record


def clear(run_dir: PathLike) -> None:
    """Remove a stop request (a new job is submitted to the run: the request was for an earlier one)."""
    try:
        stop_path(run_dir).unlink()
    except OSError:
        pass
