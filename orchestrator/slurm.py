"""SLURM facts every layer reads, defined once: this task's environment and ``scontrol show job``.

* :func:`on_slurm`, :func:`restart_count`, :func:`slurm_job_id` read the task's environment.
* :func:`parse_scontrol_job` turns ``scontrol show job`` output into its ``Key=Value`` fields;
  :func:`scontrol_job` runs it (bounded: 30 s) and returns them (``{}`` when SLURM does not, or no
  longer, know the job, or when ``scontrol`` is missing).

No torch, no third-party import.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Dict, Optional, Tuple

JOB_ID_VAR = "ORCHESTRATOR_JOB_ID"
"""The environment variable that carries the job id to every rank a launcher or an agent starts outside submitit
(torchrun's workers, cluster=hosts sessions, in-place restarts): named once, here."""


def on_slurm() -> bool:
    """Whether this process is a task of a SLURM job (submitit's SLURM executor, or plain srun)."""
    executor = os.environ.get("SUBMITIT_EXECUTOR")
    if executor is not None:
        return executor == "slurm"
    return "SLURM_JOB_ID" in os.environ and "SLURM_PROCID" in os.environ


def restart_count() -> int:
    """How many times SLURM restarted this job (``SLURM_RESTART_COUNT``; 0 when unset)."""
    try:
        return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def slurm_job_id() -> Optional[str]:
    """``SLURM_JOB_ID`` of this task (None outside SLURM)."""
    return os.environ.get("SLURM_JOB_ID")


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


def scontrol_job(job_id: str) -> Dict[str, str]:
    """The fields of ``scontrol show job <job_id>``; ``{}`` when it cannot answer (30 s bound)."""
    if not job_id or shutil.which("scontrol") is None:
        return {}
    try:
        out = subprocess.run(["scontrol", "show", "job", str(job_id)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return parse_scontrol_job(out.stdout) if out.returncode == 0 else {}


def restarts_of(fields: Dict[str, str]) -> Optional[int]:
    """SLURM's ``Restarts`` count in ``scontrol`` fields (None when absent or not a number)."""
    value = fields.get("Restarts", "")
    return int(value) if value.isdigit() else None


UNREADABLE = "UNREADABLE"
"""What :func:`slurm_state` says when neither ``scontrol`` nor ``squeue`` answered (timed out, the controller
unreachable): not an end — the launcher asks again at its next poll, within the wait's own bound."""


def slurm_state(job_id: str, squeue=("squeue",)) -> Tuple[str, int]:
    """(SLURM state, requeues so far) of ``job_id``: from ``scontrol show job``, else from ``squeue``.

    ``("UNKNOWN", 0)`` when SLURM answered that it does not know the job (ended and purged: an end);
    ``(UNREADABLE, 0)`` when neither command answered (a timeout, an error other than an invalid job id),
    which is never taken as the job's end. ``squeue``: the command (a test's stand-in for a hung one).
    """
    fields = scontrol_job(job_id)
    if fields.get("JobState"):
        return fields["JobState"], restarts_of(fields) or 0
    try:
        out = subprocess.run([*squeue, "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return UNREADABLE, 0
    state = out.stdout.strip().splitlines()
    if out.returncode == 0:
        return (state[0].strip(), 0) if state else ("UNKNOWN", 0)
    return ("UNKNOWN", 0) if "invalid job id" in out.stderr.lower() else (UNREADABLE, 0)
