"""Job records and run status: what was submitted, where it is now, how far it got.

* :func:`record_submission` / :func:`record_event` append one JSON line to ``<run_dir>/jobs.jsonl``
  (submission: job id, cluster, log paths, submitit folder; events: ``requeued``/``stopped`` from
  :mod:`orchestrator.runtime.preempt`). Appends are atomic for readers: the file is rewritten to a
  temporary file and renamed over, under an advisory lock, so a reader never sees half a line.
* :func:`job_status` says where a job is: ``pending``, ``running``, ``requeued``, ``completed``,
  ``failed``, ``cancelled`` or ``stopped`` (``unknown`` when nothing answers). SLURM jobs are
  asked with ``scontrol show job`` (accounting, hence ``sacct``, may be absent — it is on the dev
  cluster — and submitit polls it at most every 10 minutes); submitit's result files
  (``<job>_<rank>_result.pkl``) and the run's ``metrics.jsonl`` fill in when SLURM no longer
  knows the job (after ``MinJobAge``) and for local runs.
* :func:`wait_for_job` is a bounded wait that notices a job ended outside our control (``scancel``,
  node failure) within one poll of SLURM noticing it, instead of waiting on result files forever.
* ``python -m orchestrator.status [runs_root]`` lists the runs under a directory with state, job
  id, requeues, last iteration and last loss, and a failed run's failing-rank error lines.

No torch import. Subprocess calls are bounded (30 s).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from orchestrator.errors import SubmissionError

JOBS_FILE = "jobs.jsonl"
METRICS_FILE = "metrics.jsonl"
STATES = ("pending", "running", "requeued", "completed", "failed", "cancelled", "stopped", "unknown")
ENDED = frozenset({"completed", "failed", "cancelled", "stopped"})

# SLURM job states (squeue/scontrol long names) -> ours.
_SLURM_RUNNING = {"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "RESIZING", "SIGNALING",
                  "STAGE_OUT", "POWER_UP_NODE"}
_SLURM_REQUEUED = {"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"}
_SLURM_FAILED = {"FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED",
                 "REVOKED"}
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

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def describe(self) -> str:
        parts = [self.state]
        if self.slurm_state and self.slurm_state.lower() != self.state:
            parts.append(f"({self.slurm_state})")
        if self.restarts:
            parts.append(f"after {self.restarts} requeue{'s' if self.restarts > 1 else ''}")
        if self.detail:
            parts.append(f"- {self.detail}")
        return " ".join(parts)


# ---- records -------------------------------------------------------------------------------------

@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _append_record(run_dir: PathLike, record: Dict[str, Any]) -> Dict[str, Any]:
    """Append ``record`` to ``<run_dir>/jobs.jsonl``: copy + new line to a temp file, fsync, rename."""
    path = Path(run_dir) / JOBS_FILE
    line = json.dumps(record, sort_keys=True, default=str) + "\n"
    with _locked(path):
        old = path.read_bytes() if path.exists() else b""
        if old and not old.endswith(b"\n"):
            old += b"\n"
        fd, tmp = tempfile.mkstemp(prefix=f".{JOBS_FILE}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(old + line.encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    return record


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
    return _append_record(run_dir, record)


def record_event(run_dir: PathLike, event: str, **fields: Any) -> Dict[str, Any]:
    """Record a job event (``requeued``, ``stopped``, ``cancelled``, ...) in ``<run_dir>/jobs.jsonl``."""
    record = {"event": event, "time": time.time(), **fields}
    return _append_record(run_dir, record)


def read_records(run_dir: PathLike) -> List[Dict[str, Any]]:
    """All records of ``<run_dir>/jobs.jsonl`` (malformed lines skipped)."""
    path = Path(run_dir) / JOBS_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


# ---- SLURM ---------------------------------------------------------------------------------------

def _run(cmd: Sequence[str]) -> Optional[subprocess.CompletedProcess]:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None


def parse_scontrol_job(text: str) -> Dict[str, str]:
    """``Key=Value`` fields of ``scontrol show job`` output.

    The first line (``JobId=... JobName=...``) is skipped apart from JobId: a job name may contain
    spaces and ``Key=`` text, and must not be able to fake a state.
    """
    lines = text.splitlines()
    out: Dict[str, str] = {}
    if lines:
        m = re.match(r"\s*JobId=(\S+)", lines[0])
        if m:
            out["JobId"] = m.group(1)
    for line in lines[1:]:
        for token in line.split():
            if "=" in token:
                key, value = token.split("=", 1)
                out.setdefault(key, value)
    return out


def slurm_job_status(job_id: str) -> Optional[JobStatus]:
    """The job's state from ``scontrol show job``; None when SLURM does not (or no longer) know it."""
    out = _run(["scontrol", "show", "job", str(job_id)])
    if out is None or out.returncode != 0 or not out.stdout.strip():
        return None
    fields = parse_scontrol_job(out.stdout)
    raw = fields.get("JobState")
    if not raw:
        return None
    restarts = int(fields.get("Restarts", "0") or 0) if fields.get("Restarts", "0").isdigit() else 0
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
    return JobStatus(state=state, job_id=str(job_id), cluster="slurm", slurm_state=raw, restarts=restarts,
                     exit_code=fields.get("ExitCode"), reason=None if reason in (None, "None") else reason)


# ---- submitit files ------------------------------------------------------------------------------

def result_outcomes(folder: PathLike, job_id: str) -> Dict[int, str]:
    """rank -> "success"/"error" (or "unreadable") from submitit's ``<job>_<rank>_result.pkl`` files."""
    folder = Path(folder)
    out: Dict[int, str] = {}
    if not folder.is_dir():
        return out
    pattern = re.compile(rf"^{re.escape(str(job_id))}_(\d+)_result\.pkl$")
    for path in folder.iterdir():
        m = pattern.match(path.name)
        if not m:
            continue
        try:
            with open(path, "rb") as f:
                outcome = pickle.load(f)[0]
        except Exception:
            outcome = "unreadable"
        out[int(m.group(1))] = outcome if outcome in ("success", "error") else "unreadable"
    return out


def _result_error(folder: Path, job_id: str, rank: int) -> Optional[str]:
    try:
        with open(folder / f"{job_id}_{rank}_result.pkl", "rb") as f:
            outcome, value = pickle.load(f)
        return str(value) if outcome == "error" else None
    except Exception:
        return None


def failed_rank_tail(folder: PathLike, job_id: str, num_tasks: Optional[int] = None,
                     lines: int = 15) -> Optional[Tuple[int, List[str]]]:
    """(rank, last lines) of the first rank that failed: its error result, else the first stderr
    log that shows a traceback or an error. None when no rank shows one."""
    folder = Path(folder)
    outcomes = result_outcomes(folder, job_id)
    for rank in sorted(r for r, o in outcomes.items() if o == "error"):
        text = _result_error(folder, job_id, rank)
        if text:
            return rank, text.rstrip().splitlines()[-lines:]
    ranks = range(num_tasks) if num_tasks else sorted(
        int(m.group(1)) for p in (folder.iterdir() if folder.is_dir() else [])
        if (m := re.match(rf"^{re.escape(str(job_id))}_(\d+)_log\.err$", p.name)))
    for rank in ranks:
        path = folder / f"{job_id}_{rank}_log.err"
        if not path.exists():
            continue
        text = _tail_text(path)
        if re.search(r"Traceback|Error|error:|Killed|CANCELLED", text):
            return rank, text.rstrip().splitlines()[-lines:]
    return None


def _tail_text(path: Path, max_bytes: int = 65536) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        return f.read().decode(errors="replace")


def last_metrics(run_dir: PathLike) -> Tuple[Optional[int], Optional[float], Optional[Dict[str, Any]]]:
    """(last iteration, last lm_loss, last summary record) from ``<run_dir>/metrics.jsonl``."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return None, None, None
    iteration = loss = summary = None
    for line in reversed(_tail_text(path, 1 << 20).splitlines()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(rec, dict):
            continue
        if summary is None and rec.get("event") == "summary":
            summary = rec
        # Per-iteration records only: a summary of a job that resumed a finished run has no loss (NaN).
        if iteration is None and "iteration" in rec and "lm_loss" in rec and "event" not in rec:
            iteration, loss = rec["iteration"], rec["lm_loss"]
        if iteration is not None and summary is not None:
            break
    return iteration, loss, summary


def _local_alive(pid: str) -> bool:
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


# ---- status of a job / a run ---------------------------------------------------------------------

def job_status(job_id: str, cluster: str, folder: Optional[PathLike] = None, num_tasks: Optional[int] = None,
               events: Sequence[Dict[str, Any]] = ()) -> JobStatus:
    """Combine SLURM's view (``scontrol``), submitit's result files and the run's events."""
    job_id = str(job_id)
    # Ask the scheduler / the process first, read result files second: a job that ends in between
    # has written its results before it is seen as ended, never the other way round.
    st: Optional[JobStatus] = slurm_job_status(job_id) if cluster == "slurm" else None
    alive = cluster == "local" and st is None and _local_alive(job_id)
    outcomes = result_outcomes(folder, job_id) if folder else {}
    own_events = [e for e in events if str(e.get("job_id")) == job_id]
    stopped = any(e.get("event") == "stopped" for e in own_events)
    complete = bool(num_tasks) and len(outcomes) >= num_tasks
    if st is None:
        st = JobStatus(state="unknown", job_id=job_id, cluster=cluster)
        if alive and not complete:
            st.state = "running"
    st.results = outcomes
    errors = sorted(r for r, o in outcomes.items() if o != "success")
    if errors:
        st.state, st.detail = "failed", f"rank {errors[0]} raised an exception"
    elif complete and st.state not in ("cancelled", "failed"):
        st.state = "completed"
    elif st.state == "unknown" and outcomes and not num_tasks:
        st.state = "completed"
    elif stopped and st.state in ("failed", "unknown"):
        st.state, st.detail = "stopped", "stopped after saving a checkpoint (not requeued)"
    elif st.state == "completed" and num_tasks and not complete and folder:
        st.detail = f"result files from {len(outcomes)} of {num_tasks} ranks"
    elif st.state == "unknown" and cluster == "local":
        st.state, st.detail = "failed", "the local job ended without result files"
    return st


def _status_of_submitit_job(job) -> Tuple[str, str, Path, int]:
    cluster = "local" if type(job).__name__ == "LocalJob" else "slurm"
    return str(job.job_id), cluster, Path(job.paths.folder), int(getattr(job, "num_tasks", 1) or 1)


@dataclass
class RunStatus:
    """One run directory: its latest job, state and progress."""

    run_dir: str
    job: Optional[JobStatus]
    iteration: Optional[int] = None
    lm_loss: Optional[float] = None
    jobs: int = 0
    failure: Optional[Tuple[int, List[str]]] = None

    @property
    def state(self) -> str:
        return self.job.state if self.job else "unknown"


def run_status(run_dir: PathLike) -> RunStatus:
    """State of the latest job of a run, its progress and (failed) the failing rank's last lines."""
    records = read_records(run_dir)
    submissions = [r for r in records if r.get("event") == "submitted"]
    iteration, loss, summary = last_metrics(run_dir)
    rs = RunStatus(run_dir=str(run_dir), job=None, iteration=iteration, lm_loss=loss, jobs=len(submissions))
    if not submissions:
        if summary is not None:  # a run without records (older runs, direct runtime use)
            state = {"completed": "completed", "stopped": "stopped", "exited": "stopped"}.get(summary.get("status"), "unknown")
            rs.job = JobStatus(state=state, job_id="-", cluster="?")
        return rs
    last = submissions[-1]
    job_id, cluster = str(last.get("job_id")), str(last.get("cluster", "slurm"))
    folder = last.get("folder")
    st = job_status(job_id, cluster, folder, last.get("num_tasks"), events=records)
    if st.state == "unknown" and summary is not None and summary.get("status") == "completed":
        st.state = "completed"
    requeues = sum(1 for r in records if r.get("event") == "requeued" and str(r.get("job_id")) == job_id)
    st.restarts = max(st.restarts, requeues)
    rs.job = st
    if st.state == "failed" and folder:
        rs.failure = failed_rank_tail(folder, job_id, last.get("num_tasks"))
    return rs


def find_runs(root: PathLike) -> List[Path]:
    """Run directories under ``root`` (those holding jobs.jsonl or metrics.jsonl), sorted."""
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if JOBS_FILE in filenames or METRICS_FILE in filenames:
            found.append(Path(dirpath))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in ("checkpoints", "submitit"))
    return sorted(found)


# ---- bounded wait --------------------------------------------------------------------------------

def wait_for_job(job, timeout_s: float, poll_s: float = 2.0,
                 on_change: Optional[Callable[[JobStatus], None]] = None,
                 result_grace_s: float = 15.0) -> JobStatus:
    """Wait until a submitit job ends; return its :class:`JobStatus`. Never waits past ``timeout_s``.

    Ends when every rank's result file is there, or when SLURM (``scontrol``) reports the job ended
    — completed, failed, timed out, or cancelled with ``scancel`` — so a job killed outside our
    control is reported within about ``poll_s`` of SLURM noticing (SLURM marks a cancelled job at
    once; its tasks are killed after ``KillWait``). A requeued job keeps the wait going
    (``on_change`` sees ``requeued``). A local job ends when its process does. Raises
    :class:`SubmissionError` after ``timeout_s`` (the job is left running; cancel it if you must).
    """
    job_id, cluster, folder, num_tasks = _status_of_submitit_job(job)
    deadline = time.monotonic() + timeout_s
    last_key = None
    ended_at: Optional[float] = None
    while True:
        running = False
        if cluster == "local":
            try:
                running = not job.done()  # before reading result files (see job_status)
            except Exception:  # pragma: no cover - defensive
                pass
        st = job_status(job_id, cluster, folder, num_tasks)
        if running and st.state in ("unknown", "running", "failed") and len(st.results) < num_tasks \
                and not any(o != "success" for o in st.results.values()):
            st.state, st.detail = "running", ""
        key = (st.state, st.slurm_state, st.restarts)
        if on_change is not None and key != last_key:
            on_change(st)
        last_key = key
        if len(st.results) >= num_tasks:
            return st
        if st.ended:
            # SLURM says it is over, but result files can lag behind (shared filesystems): a short grace.
            if st.state != "completed":
                return st
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at >= result_grace_s:
                st.state = "failed"
                st.detail = f"SLURM reports COMPLETED but only {len(st.results)} of {num_tasks} ranks left a result"
                return st
        if time.monotonic() >= deadline:
            raise SubmissionError(
                f"job {job_id} is still {st.describe()} after {timeout_s:.0f} s; it was left running. "
                f"Check it with `python -m orchestrator.status` or stop it with "
                f"`{'scancel ' + job_id if cluster == 'slurm' else 'kill ' + job_id}`"
            )
        time.sleep(poll_s)


# ---- CLI -----------------------------------------------------------------------------------------

def _fmt_loss(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def format_table(statuses: Sequence[RunStatus], root: Optional[Path] = None) -> str:
    rows = [("RUN", "STATE", "JOB", "CLUSTER", "REQUEUES", "ITER", "LOSS")]
    for s in statuses:
        name = str(Path(s.run_dir).relative_to(root)) if root and Path(s.run_dir) != root else str(s.run_dir)
        j = s.job
        rows.append((name or ".", j.describe() if j else "unknown", j.job_id if j else "-", j.cluster if j else "-",
                     str(j.restarts) if j else "-", "-" if s.iteration is None else str(s.iteration),
                     _fmt_loss(s.lm_loss)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for s in statuses:
        if s.failure:
            rank, tail = s.failure
            lines.append("")
            lines.append(f"{s.run_dir}: rank {rank} failed; last lines:")
            lines.extend("    " + t for t in tail)
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.status",
                                     description="List runs with their job state, last iteration and last loss.")
    parser.add_argument("runs_root", nargs="?", default="runs", help="directory holding run directories (default: runs)")
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    args = parser.parse_args(argv)
    root = Path(args.runs_root)
    if not root.exists():
        print(f"error: {root} does not exist", file=sys.stderr)
        return 2
    statuses = [run_status(d) for d in find_runs(root)]
    if args.json:
        for s in statuses:
            d = asdict(s)
            d["state"] = s.state
            print(json.dumps(d, default=str))
        return 0
    if not statuses:
        print(f"no runs under {root}")
        return 0
    print(format_table(statuses, root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
