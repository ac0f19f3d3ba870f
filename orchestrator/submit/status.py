"""Run status: the latest job of each run directory, its state and progress; the status CLI.

``python -m orchestrator status [runs_root] [--history]`` lists the runs under a directory with
state (and why the latest attempt ended: ``failed (nan)``, ``failed (hang)`` …), job id, requeues,
iteration reached / trained to, last loss, tokens/s (the job summary's median-step figure, or the median of the last records while it runs) and, for a running
job, the ETA (``--json``: ``train_iters``, ``tokens_per_s``, ``eta_s``), then a failed run's own one-line account or its failing rank's error
lines; ``--history`` adds every attempt of each run (job id, start, end, cause, iteration reached);
``--detail`` each run's newest step breakdown per pipeline stage (``--json``: ``breakdown``).
No torch import.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from orchestrator.ckpt import stop
from orchestrator.ckpt.attempts import attempts, format_attempts, iterations_lost, own_records
from orchestrator.ckpt.history import PathLike, read_records
from orchestrator.ckpt.rundir import CHECKPOINTS_DIR, JOBS_FILE, METRICS_FILE, SUBMITIT_DIR
from orchestrator.errors import OneLineArgumentParser
from orchestrator.submit.jobs import JobStatus, failed_rank_tail, job_status
from orchestrator.submit.run_records import last_metrics, latest_breakdown, live_rates, remaining_s, slowness


@dataclass
class RunStatus:
    """One run directory: its latest job, state and progress."""

    run_dir: str
    job: Optional[JobStatus]
    iteration: Optional[int] = None
    lm_loss: Optional[float] = None
    jobs: int = 0
    failure: Optional[Tuple[int, List[str]]] = None
    attempts: List[Dict[str, Any]] = field(default_factory=list)
    """Every attempt of the run (:class:`orchestrator.ckpt.attempts.Attempt` as dicts), oldest first."""
    train_iters: Optional[int] = None
    """The iteration the latest job trains to (``training.train_iters``)."""
    tokens_per_s: Optional[float] = None
    """Tokens/s: the ended job's tokens per step / median step time, or the median of a running job's last records."""
    eta_s: Optional[float] = None
    """A running job's remaining time: samples left x the median recent seconds per sample (a batch ramp's
    iterations grow), or iterations left x the median recent step time (submit.run_records.remaining_s)."""
    slowness: List[str] = field(default_factory=list)
    """The latest job's slow links and named stragglers (``link_check`` / ``straggler`` records), one line each."""
    breakdown: Optional[Dict[str, Any]] = None
    """``--detail``: the newest step breakdown per stage (:func:`latest_breakdown`)."""

    @property
    def state(self) -> str:
        return self.job.state if self.job else "unknown"


def format_breakdown(run: str, b: Dict[str, Any]) -> List[str]:
    """``status --detail``'s lines for one run: a row per pipeline stage, each category's share of the step."""
    from orchestrator.plan.step_breakdown import CATEGORIES, LABELS, percent

    cols = (*CATEGORIES, "other")
    rows = [("STAGE", "STEP MS", *(LABELS[c].upper() for c in cols), "MFU")]
    for st in b["stages"]:
        rows.append(
            (
                str(st["stage"]),
                f"{1e3 * st['step_s']:.1f}",
                *(percent(st[c], 1) for c in cols),
                "-" if st.get("mfu") is None else f"{st['mfu']:.1%}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [f"{run}: step breakdown, {b['what']}"] + [
        "    " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows
    ]


def run_status(run_dir: PathLike, detail: bool = False) -> RunStatus:
    """State of the latest job of a run, its progress and (failed) the failing rank's last lines; ``detail``:
    its newest step breakdown too."""
    if detail:
        rs = run_status(run_dir)
        rs.breakdown = latest_breakdown(run_dir)
        return rs
    records = read_records(run_dir)
    submissions = [r for r in own_records(records) if r.get("event") == "submitted"]
    iteration, loss, summary = last_metrics(run_dir)
    rs = RunStatus(
        run_dir=str(run_dir),
        job=None,
        iteration=iteration,
        lm_loss=loss,
        jobs=len(submissions),
        attempts=[a.as_dict() for a in attempts(records)],
        slowness=slowness(run_dir),
    )
    if not submissions:
        if summary is not None:  # a run without records (older runs, direct runtime use)
            state = {"completed": "completed", "stopped": "stopped", "exited": "stopped"}.get(
                summary.get("status"), "unknown"
            )
            rs.job = JobStatus(state=state, job_id="-", cluster="?")
        return rs
    last = submissions[-1]
    job_id, cluster = str(last.get("job_id")), str(last.get("cluster", "slurm"))
    folder = last.get("folder")
    if last.get("warm_pool"):  # a sweep point or tune trial on warm ranks: its trial's files say how it ended
        rs.job, rs.failure = warm_trial_status(last, records)
        return rs
    rates = live_rates(run_dir, records=records)
    rs.train_iters, rs.tokens_per_s = rates["train_iters"], rates["tokens_per_s"]
    st = job_status(job_id, cluster, folder, last.get("num_tasks"), events=records)
    if st.state == "running" and stop.read(run_dir, job_id) is not None:
        st.state, st.slurm_state = (
            "stopping",
            None,
        )  # asked to (`orchestrator stop`, a signal to its launcher): saving, then exiting
    if st.state == "running" and rates["step_time_s"] and rs.train_iters and iteration is not None:
        rs.eta_s = remaining_s(
            iteration, rs.train_iters, rates["step_time_s"], rates["newest"], rates["train_samples"], rates["sample_s"]
        )
    if st.state == "unknown" and summary is not None and summary.get("status") == "completed":
        st.state = "completed"
    requeues = sum(1 for r in records if r.get("event") == "requeued" and str(r.get("job_id")) == job_id)
    st.restarts = max(st.restarts, requeues)
    rs.job = st
    if st.state == "failed" and folder and not st.message:
        rs.failure = failed_rank_tail(folder, job_id, last.get("num_tasks"))
    return rs


def warm_trial_status(
    submitted: Dict[str, Any], records: Sequence[Dict[str, Any]]
) -> Tuple[JobStatus, Optional[Tuple[int, List[str]]]]:
    """(state, (the failing rank, its last lines)) of a trial run on warm ranks (:mod:`orchestrator.submit.pool`):
    its result file (the logging rank's summary), a rank's error file, else the pool job alive or not.
    Of several error files (a killed rank's peers fail in their broken collectives), the first rank whose
    error is not a broken connection is named, as the launcher does."""
    import json

    from orchestrator.runtime.start.pool import result_path

    job_id, cluster = str(submitted["job_id"]), str(submitted.get("cluster", "local"))
    pool, num, failure = Path(submitted["warm_pool"]), int(submitted.get("trial", 0)), None
    st = JobStatus(state="unknown", job_id=job_id, cluster=cluster)
    try:
        summaries = json.loads(result_path(pool, num).read_text())["summaries"]
    except (OSError, ValueError, KeyError):
        summaries = None
    errors = sorted(pool.glob(f"trial_{num}.rank*.error"), key=_error_rank)
    if summaries:
        best = next((x for x in summaries if isinstance(x, dict) and x.get("logging_rank")), summaries[-1]) or {}
        st.state = {"completed": "completed", "exited": "stopped", "stopped": "stopped"}.get(
            best.get("status"), "unknown"
        )
    elif errors:
        tails = {_error_rank(p): p.read_text(errors="replace").rstrip().splitlines() for p in errors}
        rank = min(tails, key=lambda r: (any("ProcessGroup" in t or "Connection" in t for t in tails[r]), r))
        st.state, st.detail = "failed", f"rank {rank} raised an exception (warm trial {num})"
        failure = (rank, tails[rank][-15:])
    else:
        from orchestrator.submit.jobs import slurm_job_status
        from orchestrator.submit.liveness import pid_alive

        live = pid_alive(job_id) if cluster == "local" else (slurm_job_status(job_id) or st).state == "running"
        st.state, st.detail = ("running", "") if live else ("failed", f"the warm ranks ended before trial {num} did")
    from orchestrator.submit.jobs import attach_cause

    attach_cause(st, records)
    return st, failure


def _error_rank(path: Path) -> int:
    """The rank of a warm trial's error file ``trial_<n>.rank<r>.error`` (:func:`~orchestrator.runtime.start.pool.error_path`)."""
    return int(path.name.split(".")[1][len("rank") :])


def find_runs(root: PathLike) -> List[Path]:
    """Run directories under ``root`` (those holding jobs.jsonl or metrics.jsonl), sorted."""
    root = Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if JOBS_FILE in filenames or METRICS_FILE in filenames:
            found.append(Path(dirpath))
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in (CHECKPOINTS_DIR, SUBMITIT_DIR))
    return sorted(found)


# ---- CLI -----------------------------------------------------------------------------------------


def _fmt_loss(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.4f}"


def _fmt_eta(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    m, sec = divmod(int(round(seconds)), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{sec:02d}s"


def format_table(
    statuses: Sequence[RunStatus], root: Optional[Path] = None, history: bool = False, detail: bool = False
) -> str:
    rows = [("RUN", "STATE", "JOB", "CLUSTER", "REQUEUES", "ITER", "LOSS", "TOK/S", "ETA")]
    for s in statuses:
        name = str(Path(s.run_dir).relative_to(root)) if root and Path(s.run_dir) != root else str(s.run_dir)
        j = s.job
        it = "-" if s.iteration is None else str(s.iteration) + (f"/{s.train_iters}" if s.train_iters else "")
        rows.append(
            (
                name or ".",
                j.describe() if j else "unknown",
                j.job_id if j else "-",
                j.cluster if j else "-",
                str(j.restarts) if j else "-",
                it,
                _fmt_loss(s.lm_loss),
                "-" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}",
                _fmt_eta(s.eta_s),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for s in statuses:
        if s.slowness:
            lines.append("")
            lines.extend(f"{s.run_dir}: {line}" for line in s.slowness)
        if detail:
            lines.append("")
            lines.extend(
                format_breakdown(s.run_dir, s.breakdown)
                if s.breakdown
                else [f"{s.run_dir}: no step breakdown recorded yet (training.breakdown_interval, default 10)"]
            )
        if s.job is not None and s.job.state in ("failed", "stopped") and s.job.message:
            lines.append("")
            cause = "" if s.job.message.startswith(f"{s.job.cause}:") else f"{s.job.cause}: "
            lines.append(f"{s.run_dir}: {cause}{s.job.message}")
        if history and s.attempts:
            from orchestrator.ckpt.attempts import Attempt

            lines.append("")
            items = [Attempt(**a) for a in s.attempts]
            restarts = sum(1 for a in items if a.restart)
            lines.append(
                f"{s.run_dir}: {len(s.attempts)} attempt(s)"
                + (f" ({restarts} in-place restart(s))" if restarts else "")
                + f"; {iterations_lost(items)} iteration(s) lost to failures"
            )
            lines.extend("    " + t for t in format_attempts(items))
        if s.failure:
            rank, tail = s.failure
            lines.append("")
            lines.append(f"{s.run_dir}: rank {rank} failed; last lines:")
            lines.extend("    " + t for t in tail)
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineArgumentParser(
        prog="python -m orchestrator status",
        description="List runs with their job state, last iteration and last loss.",
    )
    parser.add_argument(
        "runs_root", nargs="?", default="runs", help="directory holding run directories (default: runs)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per run")
    parser.add_argument(
        "--history", action="store_true", help="every attempt of each run: job id, start, end, cause, iteration reached"
    )
    parser.add_argument(
        "--detail",
        action="store_true",
        help="each run's newest step breakdown per pipeline stage: compute, pipeline bubble, DP "
        "communication, optimizer, data, other (shares of the step), MFU on a GPU",
    )
    parser.add_argument(
        "--goodput",
        action="store_true",
        help="for RUN (a run directory): the goodput account over all its attempts: ETTR and where the wall went "
        "(--json: one JSON object)",
    )
    parser.add_argument(
        "--timeline", metavar="PNG", help="for RUN (a run directory): draw its timeline (attempts x time, by cause)"
    )
    args = parser.parse_args(argv)
    root = Path(args.runs_root)
    if args.goodput or args.timeline:
        from orchestrator.submit.goodput_cli import goodput_main

        return goodput_main(root, show=args.goodput, timeline=args.timeline, as_json=args.json)
    if not root.exists() and root.name != "runs":  # a path typed that is not there: one line, exit 2
        print(
            f"error: runs_root={root}: no such directory; fix: the run.root of your runs (default: runs), "
            f"e.g. python -m orchestrator status runs",
            file=sys.stderr,
        )
        return 2
    if not root.exists():  # the default run.root before any run: nothing to list, not an error
        if not args.json:
            print(
                f"no runs under {root}: no such directory yet (a run creates run.root/run.name; run.root is "
                f"runs, relative to where it was launched, unless set)"
            )
        return 0
    if not root.is_dir():
        print(
            f"error: runs_root={root}: not a directory; fix: the run.root of your runs (default: runs)", file=sys.stderr
        )
        return 2
    statuses = [run_status(d, detail=args.detail) for d in find_runs(root)]
    if args.json:
        for s in statuses:
            d = asdict(s)
            d["state"] = s.state
            print(json.dumps(d, default=str))
        return 0
    if not statuses:
        print(f"no runs under {root}")
        return 0
    print(format_table(statuses, root, history=args.history, detail=args.detail))
    return 0


if __name__ == "__main__":
    sys.exit(main())
