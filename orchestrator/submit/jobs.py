"""Where a submitted job is: SLURM's view (``scontrol``), submitit's result files, the run's events.

:func:`job_status` says ``pending``, ``running`` (``stopping`` in ``status`` once a stop is asked), ``requeued``, ``completed``, ``failed``,
``cancelled`` or ``stopped`` (``unknown`` when nothing answers), and, from the run's attempt records
(:mod:`orchestrator.ckpt.history`), why its latest attempt ended (``cause``: ``nan``, ``hang``,
``crashed``, ``timeout`` …) with the job's own one-line ``message``. SLURM jobs are asked with
``scontrol show job`` (accounting, hence ``sacct``, may be absent — it is on the dev cluster —
and submitit polls it at most every 10 minutes); submitit's result files
(``<job>_<rank>_result.pkl``) fill in when SLURM no longer knows the job (after ``MinJobAge``)
and for local runs. No torch import. Subprocess calls are bounded (30 s).
"""

from __future__ import annotations

import os
import pickle
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from orchestrator.errors import RANKS_DIED
from orchestrator.slurm import parse_scontrol_job, restarts_of, scontrol_job
from orchestrator.submit.liveness import pid_alive

STATES = ("pending", "running", "stopping", "requeued", "completed", "failed", "cancelled", "stopped", "unknown")
ENDED = frozenset({"completed", "failed", "cancelled", "stopped"})

# SLURM job states (squeue/scontrol long names) -> ours.
_SLURM_RUNNING = {
    "RUNNING",
    "CONFIGURING",
    "COMPLETING",
    "SUSPENDED",
    "STOPPED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "POWER_UP_NODE",
}
_SLURM_REQUEUED = {"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"}
_SLURM_FAILED = {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED", "REVOKED"}
PathLike = Union[str, Path]


@dataclass
class JobStatus:
    """Where one submitted job is. ``state`` is one of :data:`STATES`."""

    state: str
    job_id: str
    cluster: str = "slurm"
    slurm_state: Optional[str] = None
    """SLURM's own state (e.g. TIMEOUT, OUT_OF_MEMORY) when SLURM still knows the job."""
    restarts: int = 0
    """Requeues so far (SLURM ``Restarts``)."""
    exit_code: Optional[str] = None
    reason: Optional[str] = None
    results: Dict[int, str] = field(default_factory=dict)
    """rank -> "success"/"error" from submitit's result files."""
    detail: str = ""
    cause: Optional[str] = None
    """Why the latest attempt ended (:data:`orchestrator.ckpt.history.CAUSES`), when recorded."""
    message: str = ""
    """The job's own one-line account of that end (a NaN stop, a hang)."""

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def describe(self) -> str:
        parts = [self.state]
        if self.cause and self.cause != self.state and self.state in ("failed", "stopped"):
            parts.append(f"({self.cause})")
        elif self.slurm_state and self.slurm_state.lower() != self.state:
            parts.append(f"({self.slurm_state})")
        if self.restarts:
            parts.append(f"after {self.restarts} requeue{'s' if self.restarts > 1 else ''}")
        if self.detail:
            parts.append(f"- {self.detail}")
        return " ".join(parts)


# ---- SLURM ---------------------------------------------------------------------------------------


def slurm_job_status(job_id: str) -> Optional[JobStatus]:
    """The job's state from ``scontrol show job``; None when SLURM does not (or no longer) know it."""
    return _status_from_fields(scontrol_job(str(job_id)), job_id)


def status_from_scontrol(text: str, job_id: str) -> Optional[JobStatus]:
    """The :class:`JobStatus` that ``scontrol show job`` output ``text`` describes (None without a JobState)."""
    return _status_from_fields(parse_scontrol_job(text), job_id)


def _status_from_fields(fields: Dict[str, str], job_id: str) -> Optional[JobStatus]:
    raw = fields.get("JobState")
    if not raw:
        return None
    restarts = restarts_of(fields) or 0
    reason = fields.get("Reason")
    if raw == "PENDING":
        state = "requeued" if restarts else "pending"
    elif raw in _SLURM_REQUEUED:
        state = "requeued"
    elif raw in _SLURM_RUNNING:
        state = "running"
    elif raw == "COMPLETED":
        state = "completed"
    elif raw == "CANCELLED":
        state = "cancelled"
    elif raw in _SLURM_FAILED:
        state = "failed"
    else:
        state = "unknown"
    return JobStatus(
        state=state,
        job_id=str(job_id),
        cluster="slurm",
        slurm_state=raw,
        restarts=restarts,
        exit_code=fields.get("ExitCode"),
        reason=None if reason in (None, "None") else reason,
    )


# ---- submitit files ------------------------------------------------------------------------------


def result_outcomes(folder: PathLike, job_id: str) -> Dict[int, str]:
    """rank -> "success"/"error" (or "unreadable") from submitit's ``<job>_<rank>_result.pkl`` files; "exited"
    for a torchrun agent's rank that stopped (or left requeued) on the job's own decision (a submitit task
    writes no file then)."""
    from orchestrator.runtime.start.agent import exit_code_of

    folder = Path(folder)
    out: Dict[int, str] = {}
    if not folder.is_dir():
        return out
    # submitit's names, or result_<rank>.pkl of a job of torchrun agents (runtime/start/agent.py)
    pattern = re.compile(rf"^(?:{re.escape(str(job_id))}_(\d+)_result|result_(\d+))\.pkl$")
    for path in folder.iterdir():
        m = pattern.match(path.name)
        if not m:
            continue
        try:
            with open(path, "rb") as f:
                read = pickle.load(f)
            outcome = "exited" if exit_code_of(read) is not None else read[0]
        except Exception:
            outcome = "unreadable"
        out[int(m.group(1) or m.group(2))] = outcome if outcome in ("success", "error", "exited") else "unreadable"
    return out


def _result_error(folder: Path, job_id: str, rank: int) -> Optional[str]:
    try:
        with open(folder / f"{job_id}_{rank}_result.pkl", "rb") as f:
            outcome, value = pickle.load(f)
        return str(value) if outcome == "error" else None
    except Exception:
        return None


def failed_rank_tail(
    folder: PathLike, job_id: str, num_tasks: Optional[int] = None, lines: int = 15
) -> Optional[Tuple[int, List[str]]]:
    """(rank, last lines) of the first rank that failed: its error result, else the first stderr
    log that shows a traceback or an error. None when no rank shows one."""
    folder = Path(folder)
    outcomes = result_outcomes(folder, job_id)
    for rank in sorted(r for r, o in outcomes.items() if o == "error"):
        text = _result_error(folder, job_id, rank)
        if text:
            return rank, text.rstrip().splitlines()[-lines:]
    ranks = (
        range(num_tasks)
        if num_tasks
        else sorted(
            int(m.group(1))
            for p in (folder.iterdir() if folder.is_dir() else [])
            if (m := re.match(rf"^{re.escape(str(job_id))}_(\d+)_log\.err$", p.name))
        )
    )
    for rank in ranks:
        path = folder / f"{job_id}_{rank}_log.err"
        if not path.exists():
            continue
        text = tail_text(path)
        if re.search(r"Traceback|Error|error:|Killed|CANCELLED", text):
            return rank, text.rstrip().splitlines()[-lines:]
    return None


def tail_text(path: Path, max_bytes: int = 65536) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        return f.read().decode(errors="replace")


# ---- status of a job / a run ---------------------------------------------------------------------


def job_status(
    job_id: str,
    cluster: str,
    folder: Optional[PathLike] = None,
    num_tasks: Optional[int] = None,
    events: Sequence[Dict[str, Any]] = (),
) -> JobStatus:
    """Combine SLURM's view (``scontrol``), submitit's result files and the run's events."""
    job_id = str(job_id)
    # Ask the scheduler / the process first, read result files second: a job that ends in between
    # has written its results before it is seen as ended, never the other way round.
    st: Optional[JobStatus] = slurm_job_status(job_id) if cluster == "slurm" else None
    alive = cluster == "local" and st is None and pid_alive(job_id)
    if cluster in ("hosts", "torchrun"):  # its launcher waits on the sessions / the agent: alive while it is
        launcher = (
            next(
                (e.get("launcher") for e in events if e.get("event") == "submitted" and str(e.get("job_id")) == job_id),
                None,
            )
            or {}
        )
        alive = launcher.get("host") == socket.gethostname() and pid_alive(str(launcher.get("pid")))
    outcomes = result_outcomes(folder, job_id) if folder else {}
    own_events = [e for e in events if str(e.get("job_id")) == job_id]
    stopped = any(e.get("event") == "stopped" for e in own_events)
    exited = [r for r, o in outcomes.items() if o == "exited"]  # ranks that stopped on the job's decision
    complete = bool(num_tasks) and len(outcomes) - len(exited) >= num_tasks
    if st is None:
        st = JobStatus(state="unknown", job_id=job_id, cluster=cluster)
        if alive and not complete:
            st.state = "running"
    st.results = outcomes
    errors = sorted(r for r, o in outcomes.items() if o not in ("success", "exited"))
    if errors:
        st.state, st.detail = "failed", f"rank {errors[0]} raised an exception"
    elif complete and st.state not in ("cancelled", "failed"):
        st.state = "completed"
    elif st.state == "unknown" and len(outcomes) > len(exited) and not num_tasks:
        st.state = "completed"
    elif stopped and st.state in ("failed", "unknown"):
        st.state, st.detail = "stopped", "stopped after saving a checkpoint (not requeued)"
    elif st.state == "completed" and num_tasks and not complete and folder:
        st.detail = f"result files from {len(outcomes)} of {num_tasks} ranks"
    elif st.state == "unknown" and cluster in ("local", "hosts", "torchrun"):  # (they end with their launcher)
        st.state, st.detail = "failed", f"the {cluster} job ended without result files"
    attach_cause(st, events)
    return st


def attach_cause(st: JobStatus, events: Sequence[Dict[str, Any]]) -> None:
    """Fill ``cause``/``message`` from the latest attempt's end; a NaN or hang is a failure with that name."""
    from orchestrator.ckpt.attempts import attempts

    mine = [a for a in attempts(events) if a.job_id == st.job_id and a.end is not None]
    if not mine:
        return
    last = max(mine, key=lambda a: (a.attempt, a.restart))  # the latest start (in-place restarts share the attempt)
    st.cause, st.message = last.cause, last.message
    died = RANKS_DIED.match(last.message or "")
    if died and st.state == "failed":  # the rank that died first, not its peers' broken collectives
        st.detail = died.group(0)
    elif last.cause == "node failure" and st.state == "failed":  # the host lost, not its ranks' errors after it
        st.detail = (last.message or "").split("; ")[0]
    if (
        last.cause in ("nan", "spike", "hang", "disk full")
        and not last.requeued
        and st.state in ("failed", "unknown", "stopped")
    ):
        st.state, st.detail = "failed", ""
    if last.cause == "by request" and st.state in ("failed", "cancelled", "unknown", "stopped"):
        st.state, st.detail = "stopped", ""  # `orchestrator stop`: "stopped (by request)"
    unsaved = last.cause == "interrupted" and (last.message or "").endswith(", unsaved")  # WaitSignals.end_words
    if unsaved and st.state in ("failed", "cancelled", "unknown") and "error" not in st.results.values():
        st.state, st.detail = "stopped", last.message  # a signal to the launcher ended it at once, on purpose


SLURM_ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
    "UNKNOWN",
}
