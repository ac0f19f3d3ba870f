"""One tune trial as a real job: on warm ranks (default) or as a fresh ``python -m orchestrator`` run.

Either way the trial goes through the single-run pipeline (compose, the one ``validate``, data,
preflight, launch) with :func:`trial_overrides` added, writes its own ``metrics.jsonl`` in
``<tune dir>/<n>`` and its launcher output to ``<tune dir>/<n>/tune_trial.log``; :func:`run_trial`
returns the job's summary or the reason it failed.

* warm (``tune.warm_pool=true``): :class:`~orchestrator.submit.pool_launcher.PoolLauncher` keeps one pool
  job (local ranks, or one SLURM allocation holding every trial in sequence) and hands it each
  trial; a failed trial cancels the pool and the next trial starts a fresh one.
* fresh: a subprocess per trial (its own job, its own process start-up), as a user would type it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.errors import OrchestratorError
from orchestrator.io import read_jsonl
from orchestrator.sweep.records import layout_record, measured, plan_record
from orchestrator.sweep.search import Candidate, TuneConfig

LOG = "tune_trial.log"


def trial_overrides(opts: TuneConfig, root: Path, num: int) -> List[str]:
    """What every trial adds: its run directory, few iterations, no evaluation, no checkpoint, a bounded job."""
    return [
        f"run.root={root}",
        f"run.name={num}",
        f"training.train_iters={opts.iters}",
        f"training.timing_warmup_iters={opts.warmup_iters}",
        "training.exit_after_iters=null",
        "training.eval_iters=0",
        "checkpoint.save_interval=null",
        "checkpoint.save_at_end=false",
        "checkpoint.auto_resume=false",
        "checkpoint.init_from=null",
        f"cluster.timeout_min={opts.trial_timeout_min}",
        "cluster.wait=true",
        "plan=false",
        "dry_run=false",
        f"training.trace_iteration={opts.trace_iteration or 'null'}",
    ]


def job_summary(run_dir: Path) -> Optional[Dict[str, Any]]:
    """The job's final ``summary`` record from ``metrics.jsonl`` (None when it wrote none)."""
    records = [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if r.get("event") == "summary"]
    return records[-1] if records else None


def run_cli(args: List[str], log_path: Path, timeout_s: float) -> Tuple[int, float]:
    """``python -m orchestrator ARGS`` with output to ``log_path``; (exit code, seconds).

    Timeout: SIGTERM (the CLI stops its ranks), exit code 124. Ctrl-C: the same, then re-raised.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt) as exc:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
            if isinstance(exc, KeyboardInterrupt):
                raise
            rc = 124
    return rc, time.time() - start


def log_reason(log_path: Path, lines: int = 15) -> str:
    """The CLI's ``error:`` line and what follows it, else the log's last lines."""
    text = log_path.read_text(errors="replace").rstrip().splitlines() if log_path.exists() else []
    start = next((i for i, line in enumerate(text) if line.startswith("error:")), None)
    return "\n".join(text[start : start + lines] if start is not None else text[-lines:])


class PhaseEcho:
    """While a trial runs, its launcher's progress on the tune's console: each new phase line of the trial's log
    (``[orchestrator] ...``, ``iteration k/n | ...``) as ``[tune] trial N: ...``, and at least one line every
    ``every_s`` seconds (the phase and how long it has lasted), so a tune is never silent while a trial starts its
    ranks, builds the model and trains (13-22 s a trial here). ``out``: the console, taken before the trial's
    output is redirected to its log. A context manager; its thread only reads the log."""

    def __init__(self, log_path: Path, num: int, out: Any, every_s: float = 2.5):
        self.log_path, self.num, self.out, self.every_s = Path(log_path), num, out, every_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"tune-trial-{num}", daemon=True)

    def __enter__(self) -> "PhaseEcho":
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(timeout=5)

    def _say(self, text: str) -> None:
        self.out.write(f"[tune] trial {self.num}: {text}\n")
        self.out.flush()

    def _run(self) -> None:
        from orchestrator.submit.progress import Tail

        log, phase = (
            Tail(self.log_path, from_start=True),
            "starting (composing, preparing the data, starting the ranks)",
        )
        began = said = since = time.monotonic()
        self._say(phase)
        starts = ("[orchestrator] ", "iteration ", "... ")
        while True:
            stopping = self.stop.wait(0.5)  # once stopping: one last read, so the trial's last lines are said
            lines = [ln.strip() for ln in log.lines()]
            phases = [ln.removeprefix("[orchestrator] ").removeprefix("... ") for ln in lines if ln.startswith(starts)]
            now = time.monotonic()
            for line in phases:
                phase, since, said = line, now, now
                self._say(line)
            if stopping:
                return
            if now - said >= self.every_s:
                said = now
                self._say(f"{phase} ({now - since:.0f} s in this phase, {now - began:.0f} s in the trial)")


class TrialRunner:
    """Runs trials for one tune session; ``close()`` ends its warm ranks."""

    def __init__(self, opts: TuneConfig, root: Path):
        self.opts, self.root = opts, Path(root)
        self.pool = None
        if opts.warm_pool:
            from orchestrator.submit.pool_launcher import PoolLauncher

            # SLURM: every trial in one allocation, as long as the whole tune may take
            self.pool = PoolLauncher(
                self.root / ".pool", allocation_min=int(math.ceil(opts.max_minutes)) + opts.trial_timeout_min
            )

    def run(self, args: List[str], run_dir: Path) -> Tuple[Optional[Dict[str, Any]], str, float]:
        """(summary of a completed job or None, the failure's reason, wall seconds)."""
        num = int(run_dir.name) if run_dir.name.isdigit() else 0
        if self.pool is None:
            with PhaseEcho(run_dir / LOG, num, sys.stdout):
                rc, wall = run_cli(args, run_dir / LOG, 60 * self.opts.trial_timeout_min + 180)
            summary = job_summary(run_dir)
            if rc == 0 and summary and summary.get("status") == "completed":
                return summary, "", wall
            return (
                None,
                (f"timed out after {wall:.0f} s" if rc == 124 else log_reason(run_dir / LOG)) or f"exit code {rc}",
                wall,
            )
        with PhaseEcho(run_dir / LOG, num, sys.stdout):  # the console, before _warm redirects to the log
            return self._warm(args, run_dir)

    def _warm(self, args: List[str], run_dir: Path) -> Tuple[Optional[Dict[str, Any]], str, float]:
        from submitit.core.logger import get_logger

        from orchestrator.config.compose import compose_config
        from orchestrator.pipeline import run

        get_logger()  # its handler binds to the real stderr now, not to this trial's log (closed after it)
        run_dir.mkdir(parents=True, exist_ok=True)
        start = time.time()
        with (run_dir / LOG).open("w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            try:
                summary = run(compose_config(args), launcher=self.pool)
                reason = (
                    ""
                    if summary and summary.get("status") == "completed"
                    else f"the job ended {(summary or {}).get('status')}"
                )
            except OrchestratorError as exc:
                summary, reason = None, f"error: {exc}"
            except Exception as exc:  # noqa: BLE001 - recorded as the trial's failure
                summary, reason = None, "".join(traceback.format_exception_only(type(exc), exc)).strip()
                traceback.print_exc()
            if reason:
                print(reason, flush=True)
        return (summary if not reason else None), reason, time.time() - start

    def close(self, interrupted: bool = False) -> None:
        if self.pool is not None:
            self.pool.close(interrupted=interrupted)


@dataclass
class Trial:
    """One candidate run as a job."""

    num: int
    cand: Candidate
    predicted_step_s: float
    """At selection (the prospective prediction)."""
    predicted_peak_bytes: float
    calibrated: bool
    """Whether the profile that predicted it was calibrated."""
    predicted_sd: float = 0.0
    """The prediction's relative standard deviation at selection."""
    exploring: bool = False
    """Predicted no faster than the best step measured before it (:class:`~orchestrator.sweep.search.TrialOutcome`)."""
    status: str = "running"
    reason: str = ""
    summary: Optional[Dict[str, Any]] = None
    wall_s: float = 0.0
    started: float = field(default_factory=time.time)

    @property
    def step_s(self) -> Optional[float]:
        return self.summary.get("step_time_median_s") if self.status == "completed" and self.summary else None

    @property
    def startup_s(self) -> Optional[float]:
        """What the trial paid besides its training loop: wall time minus the loop's (s)."""
        train = (self.summary or {}).get("train_wall_s")
        return self.wall_s - train if self.wall_s and isinstance(train, (int, float)) else None


def trial_record(trial: Trial, run_dir: Path, opts: TuneConfig) -> Dict[str, Any]:
    """A tune trial as a sweep point's record (``point.json``: :mod:`orchestrator.sweep.records`)."""
    c = trial.cand
    record = {
        "point": trial.num,
        "overrides": c.overrides,
        "status": trial.status,
        "reason": trial.reason,
        "job_id": (trial.summary or {}).get("job_id"),
        "run_dir": str(run_dir),
        "driver": {"pid": os.getpid(), "host": os.uname().nodename},
        "started": trial.started,
        "training": {"train_iters": opts.iters, "timing_warmup_iters": opts.warmup_iters},
        "layout": layout_record(c.layout),
        "cluster": c.cfg.cluster.kind,
        "plan": plan_record(c.plan),
        "tune": {
            "label": c.label,
            "predicted_step_s": trial.predicted_step_s,
            "predicted_step_sd": trial.predicted_sd,
            "predicted_peak_bytes": trial.predicted_peak_bytes,
            "calibrated": trial.calibrated,
            "exploring": trial.exploring,
            "wall_s": trial.wall_s,
            "startup_s": trial.startup_s,
            "warm": opts.warm_pool,
        },
    }
    if trial.status != "running":
        record["ended"] = time.time()
        record["measured"] = measured(run_dir, opts.warmup_iters)
    return record
