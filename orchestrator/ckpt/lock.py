"""The run lock: one live run per run directory (``<run_dir>/orchestrator.lock``).

The job's rank 0 holds it for the job's life (local or SLURM, waited on or detached; see
:mod:`orchestrator.runtime.start.job`); a requeued attempt of the same SLURM job takes it over. The
launcher only :meth:`~RunLock.probe` s it, to refuse early when a live run holds the directory. A job
submitted but whose rank 0 has not decided on the lock yet (starting, or pending in SLURM's queue) holds
the directory too: its submission record in ``jobs.jsonl`` carries a ``claim`` (:func:`submission_claim`:
the local job's pid and start time, or the SLURM job id) that :meth:`~RunLock.probe` reads like the lock's
own record, until ``<run_dir>/submitit/<job_id>_lock.json`` (:func:`decision_path`) says rank 0 decided.
No torch import.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from pathlib import Path
from typing import Optional

from orchestrator.ckpt.rundir import JOBS_FILE, LOCK_FILE, SUBMITIT_DIR
from orchestrator.errors import RunLockedError
from orchestrator.io import read_jsonl
from orchestrator.slurm import JOB_ID_VAR

CLAIMS_READ = 4
"""How many of the newest submissions :meth:`RunLock.probe` reads for an undecided claim."""


def decision_path(run_dir: "str | os.PathLike", job_id: str) -> Path:
    """Where rank 0 of job ``job_id`` writes its lock decision (``{"ok": ..., "attempt": ...}``)."""
    return Path(run_dir) / SUBMITIT_DIR / f"{job_id}_lock.json"


def submission_claim(cluster_kind: str, job_id: str) -> dict:
    """The ``claim`` a launcher records with a local or SLURM submission: a holder record as the lock's
    (:meth:`RunLock.stale_reason` reads it) for the gap before the job's rank 0 takes the lock. Local: the
    job's pid (submitit's local job id) on this host with its start time; SLURM: the job id."""
    import psutil

    claim: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "submitted": str(job_id)}
    if cluster_kind == "slurm":
        return {**claim, "job_id": str(job_id)}
    claim.update(pid=int(job_id), host=socket.gethostname())
    try:
        claim["create_time"] = psutil.Process(int(job_id)).create_time()
    except psutil.NoSuchProcess:
        claim["create_time"] = 0.0  # already ended: stale
    return claim


class RunLock:
    """``<run_dir>/orchestrator.lock``: one live run per run directory.

    Taken by linking a fully written temporary file into place (atomic, NFS-safe). A second
    holder gets RunLockedError naming the holder's pid, host and SLURM job id; the holder is
    never disturbed. A lock is stale (and taken over) when its pid is dead on this host, when
    the pid was reused (start time differs), when it belongs to an earlier attempt of this
    same SLURM job (requeue), or when ``squeue`` says its job no longer exists.
    """

    NAME = LOCK_FILE

    def __init__(self, run_dir: "str | os.PathLike"):
        self.path = Path(run_dir) / self.NAME
        self.token: Optional[str] = None

    def holder(self) -> Optional[dict]:
        """The holder's record, None when unlocked ({} when unreadable)."""
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}

    def _me(self) -> dict:
        import psutil

        return {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "job_id": os.environ.get("SLURM_JOB_ID"),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "create_time": psutil.Process().create_time(),
            "token": uuid.uuid4().hex,
            "launch_id": os.environ.get(JOB_ID_VAR),
        }

    def stale_reason(self, holder: dict) -> Optional[str]:
        """Why ``holder`` is dead, or None when it may be alive.

        In order: its pid alive on this host (same start time) means alive; an earlier attempt of
        this same SLURM job is stale (requeue); a SLURM job that ``squeue`` still lists is alive,
        even when its pid is gone (requeued and pending again), one it no longer lists is stale;
        otherwise a pid dead (or reused) on this host is stale, and a holder on another host
        without a SLURM job is taken as alive.
        """
        import psutil

        me = self._me()
        pid, host, job = holder.get("pid"), holder.get("host"), holder.get("job_id")
        pid_gone: Optional[str] = None
        if host == me["host"] and isinstance(pid, int):
            try:
                proc = psutil.Process(pid)
                if proc.status() == psutil.STATUS_ZOMBIE:
                    pid_gone = f"pid {pid} on {host} has exited"
                elif abs(proc.create_time() - float(holder.get("create_time") or 0)) > 1:
                    pid_gone = f"pid {pid} on {host} is now another process"
                else:
                    return None
            except psutil.NoSuchProcess:
                pid_gone = f"pid {pid} on {host} is dead"
        if job and job == me["job_id"]:
            return f"earlier attempt of this SLURM job {job} (requeued)"
        if job and shutil.which("squeue"):
            try:
                r = subprocess.run(
                    ["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=15
                )
            except (OSError, subprocess.SubprocessError):
                return pid_gone
            if (r.returncode == 0 and not r.stdout.strip()) or "Invalid job id" in r.stderr:
                return f"SLURM job {job} no longer exists"
            if r.returncode == 0:
                return None  # listed: running elsewhere, or requeued and pending
        return pid_gone

    def _refusal(self, holder: dict) -> RunLockedError:
        if holder.get("submitted"):  # a claim: submitted, its rank 0 not yet holding the lock
            job, local = holder["submitted"], bool(holder.get("pid"))
            where = f"pid {holder['pid']} on host {holder.get('host')}" if local else "queued in SLURM"
            return RunLockedError(
                f"run.dir: {self.path.parent} is in use by another run (job {job}, {where}, submitted "
                f"{holder.get('started')}, not yet started); fix: wait for it or use another run.name / run.dir, "
                f"or end that job ({'kill' if local else 'scancel'} {job})"
            )
        return RunLockedError(
            f"run.dir: {self.path.parent} is in use by another run (pid {holder.get('pid')} on host "
            f"{holder.get('host')}, SLURM job {holder.get('job_id') or '-'}, since {holder.get('started')}); "
            f"fix: wait for it or use another run.name / run.dir; if that run is dead, remove {self.path}"
        )

    def pending_claims(self) -> list:
        """The claims (:func:`submission_claim`) of the newest submissions whose rank 0 has not decided on
        the lock yet (no :func:`decision_path` file), newest first; their liveness is not checked here."""
        records = read_jsonl(self.path.parent / JOBS_FILE)
        submitted = [r for r in records if r.get("event") == "submitted" and isinstance(r.get("claim"), dict)]
        return [
            r["claim"]
            for r in reversed(submitted[-CLAIMS_READ:])
            if not decision_path(self.path.parent, str(r.get("job_id"))).exists()
        ]

    def probe(self) -> None:
        """Raise RunLockedError naming the holder when a live run holds the lock, or a live job submitted to
        this directory has not decided on it yet (:meth:`pending_claims`); take nothing."""
        holder = self.holder()
        if holder is not None and self.stale_reason(holder) is None:
            raise self._refusal(holder)
        for claim in self.pending_claims():
            if self.stale_reason(claim) is None:
                raise self._refusal(claim)

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = self._me()
        tmp = self.path.with_name(f".{self.NAME}.{me['token']}")
        tmp.write_text(json.dumps(me))
        try:
            for _ in range(5):
                try:
                    os.link(tmp, self.path)
                    self.token = me["token"]
                    return self
                except FileExistsError:
                    pass
                holder = self.holder()
                if holder is None:
                    continue  # released meanwhile
                reason = self.stale_reason(holder) if holder else None
                if reason is None:
                    raise self._refusal(holder)
                self._break(holder)
            raise RunLockedError(f"{self.path}: could not take the lock (contended); try again")
        finally:
            tmp.unlink(missing_ok=True)

    def _break(self, holder: dict) -> None:
        tomb = self.path.with_name(f".{self.NAME}.stale.{uuid.uuid4().hex}")
        try:
            os.rename(self.path, tomb)
        except FileNotFoundError:
            return
        try:
            taken = json.loads(tomb.read_text())
        except (OSError, ValueError):
            taken = {}
        if taken.get("token") != holder.get("token"):  # a fresh lock slipped in: put it back
            try:
                os.link(tomb, self.path)
            except FileExistsError:
                pass
        tomb.unlink(missing_ok=True)

    def release_for(self, launch_id: str) -> bool:
        """Remove the lock when a rank of the agent-started job ``launch_id`` holds it (its launcher saw every
        agent end, so no rank lives on: a rank killed outright leaves it); True when removed."""
        holder = self.holder()
        if holder and holder.get("launch_id") == launch_id:
            self._break(holder)
            return True
        return False

    def release(self) -> None:
        holder = self.holder()
        if self.token and holder and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)
        self.token = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
