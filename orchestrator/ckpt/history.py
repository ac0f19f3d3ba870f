"""The run's attempt history: ``<run_dir>/jobs.jsonl``, one JSON object per line.

Who writes: the launcher records each submission (:func:`record_submission`: job id, cluster, log
paths, submitit folder, number of tasks); the job records its events (:func:`record_event`:
``requeued``, ``stopped`` … from :mod:`orchestrator.runtime.preempt`). Readers:
:mod:`orchestrator.submit.status` and the sweep table. Appends go through
:func:`orchestrator.io.append_jsonl` (locked, whole lines). No torch import.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from orchestrator.ckpt.rundir import JOBS_FILE
from orchestrator.io import append_jsonl, read_jsonl

PathLike = Union[str, Path]


def record_submission(run_dir: PathLike, job_id: str, cluster: Any, log_paths: Optional[Dict[str, str]] = None,
                      **extra: Any) -> Dict[str, Any]:
    """Record a submission in ``<run_dir>/jobs.jsonl`` and return the record.

    ``cluster``: the cluster kind (``"slurm"``/``"local"``) or a ClusterConfig (kind and name are
    taken from it). ``log_paths``: e.g. ``{"stdout": ..., "stderr": ...}`` of rank 0 (submitit's
    ``job.paths``); the submitit folder is derived from them unless ``folder=`` is given.
    Useful extras: ``num_tasks``, ``folder``, ``command``, ``script`` (sbatch file path).
    """
    if isinstance(cluster, str):
        kind, name = cluster, cluster
    else:
        kind, name = getattr(cluster, "kind", str(cluster)), getattr(cluster, "name", str(cluster))
    logs = {k: str(v) for k, v in (log_paths or {}).items()}
    record: Dict[str, Any] = {"event": "submitted", "time": time.time(), "job_id": str(job_id), "cluster": kind,
                              "cluster_name": name, "run_dir": str(Path(run_dir).absolute()), "logs": logs}
    if "folder" not in extra and logs:
        extra["folder"] = str(Path(next(iter(logs.values()))).parent)
    record.update({k: (str(v) if isinstance(v, Path) else v) for k, v in extra.items()})
    return append_jsonl(Path(run_dir) / JOBS_FILE, record)


def record_event(run_dir: PathLike, event: str, **fields: Any) -> Dict[str, Any]:
    """Record a job event (``requeued``, ``stopped``, ``cancelled``, ...) in ``<run_dir>/jobs.jsonl``."""
    record = {"event": event, "time": time.time(), **fields}
    return append_jsonl(Path(run_dir) / JOBS_FILE, record)


def read_records(run_dir: PathLike) -> List[Dict[str, Any]]:
    """All records of ``<run_dir>/jobs.jsonl`` (malformed lines skipped)."""
    return read_jsonl(Path(run_dir) / JOBS_FILE)
