"""Hydra multirun sweeps: every point a complete job, one results table whatever happens.

``python -m orchestrator -m +experiment=gpt_pp2_dp2 training.micro_batch_size=1,2,4 training.train_iters=20``
``python -m orchestrator.sweep summarize <sweep dir>``

* Hydra's basic sweeper expands the cartesian product of the ``a,b,c`` overrides (several keys
  at once work the same: ``training.micro_batch_size=1,2 parallelism.virtual_pipeline_model_parallel_size=null,2``)
  and its basic launcher calls the task function once per point, one after another, in this
  process. Each point gets its own run directory ``<sweep dir>/<num>`` (``hydra.sweep.subdir``),
  hence its own ``metrics.jsonl``, ``submitit/`` logs and ``checkpoints/``: points never share a
  checkpoint.
* :func:`run_point` is the task function in multirun mode. In order: compose (a config error:
  ``invalid``), validate the layout (``invalid``, with the validation message), plan (memory
  predicted on the device that runs -- ``cpu`` with this machine's memory per rank for CPU ranks, else
  the ``gpu`` preset -- pipeline bubble, model FLOPs). A point predicted not to fit is recorded
  ``skipped_oom_predicted`` unless ``sweep.run_predicted_oom=true``. Otherwise the point
  runs the single-run pipeline (prepare data, preflight, launch); a crash is recorded ``failed``
  with the error's last lines. Nothing a point does is raised into Hydra (Hydra re-raises a failed
  job only after the whole batch and then skips ``on_multirun_end``), so every point runs and is
  recorded; the entry point exits with :func:`finish`'s code after the last point.
* The benchmark is bounded by the point's own ``training.train_iters``; the first
  ``training.timing_warmup_iters`` iterations are excluded from the step-time median.
* Local (``cluster.kind=local``): the driver waits for each point's job before the next starts, so
  points never share the CPUs/GPUs. Consecutive points with the same world size run on the same
  warm rank processes (``sweep.warm_pool``, :mod:`orchestrator.submit.pool`): torch/megatron import
  and the process group are paid once, megatron's parallel state, model and data are built per
  point as in a fresh job (``<sweep dir>/.pool/`` holds their files). SLURM: each point's job is submitted without waiting, so every
  point is queued at once, like the tasks of an array, but as its own job (own job id, run
  directory, submitit folder, jobs.jsonl, requeue/resume). Why not one ``--array``: points may
  differ in world size (a PP or TP sweep), which one array request cannot express, and an array
  shares one submitit folder. Why not hydra-submitit-launcher: it would run our task function
  (itself a launcher) inside an allocation. After the last point the driver waits for every job
  (each bounded like a single run's wait) and records each one as it ends; ``cluster.wait=false``
  skips that wait (summarize later).
* Each point writes ``<point dir>/point.json`` atomically (overrides, status, reason, job id, run
  dir, layout, planner numbers and, once finished, the measured numbers). After every point the
  summary (``summary.csv``, ``summary.md``, ``summary.png``) is rebuilt from the sweep directory
  alone by :func:`orchestrator.sweep_table.write_summary`, so it exists whatever happens to later
  points; the columns and their formulas are documented there.

Exit code of a sweep: 1 if any point failed, was interrupted or stopped, 2 if none did but some
point was invalid, else 0 (points skipped as predicted OOM are a decision, not a failure).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from orchestrator.errors import OneLineArgumentParser, OrchestratorError
from orchestrator.io import write_atomic
from orchestrator.plan.profile import device_of
from orchestrator.sweep.table import (
    COLUMNS,
    FINAL,
    POINT_FILE,
    exit_code,
    format_report,
    job_id_in,
    layout_record,
    measured,
    plan_record,
    short_reason,
    status_of_summary,
    write_summary,
)

__all__ = [
    "COLUMNS",
    "Point",
    "current_point",
    "detached",
    "exit_code",
    "finish",
    "main",
    "measured",
    "run_point",
    "write_summary",
]


def say(message: str) -> None:
    try:
        print("\n".join(f"[sweep] {line}" for line in message.splitlines()), flush=True)
    except OSError:  # the terminal is gone (a SIGHUP): the point files and the table still say it
        pass


def _tail(text: str, lines: int = 15) -> str:
    """The error's last lines, after its first line (which usually names the job and rank)."""
    all_lines = str(text).rstrip().splitlines()
    if len(all_lines) <= lines:
        return "\n".join(all_lines)
    return "\n".join([all_lines[0], "..."] + all_lines[-(lines - 1) :])


# ====================================================================== one point (in the driver)
@dataclass
class Point:
    """Where a multirun point lives and how Hydra composed it."""

    sweep_dir: Path
    run_dir: Path
    num: int
    overrides: List[str]


@dataclass
class _Driver:
    """What this process learned while Hydra ran the points (read by :func:`finish`)."""

    sweep_dir: Optional[Path] = None
    submitted: List[Tuple[Point, Any, int, str]] = field(default_factory=list)
    """(point, JobConfig, world size, job id) of SLURM jobs submitted without waiting."""
    wait_at_end: bool = True
    pool: Any = None
    """The warm ranks of local points (orchestrator.submit.pool.PoolLauncher), made by the first one."""
    points: Optional[int] = None
    """How many points the sweep has (:func:`announce`), for "point 2 of 3"."""
    signals: Any = None
    """From the first queued SLURM point to the last wait: a signal detaches from all (submit.signals.DetachSignals)."""

    def launcher(self, cfg: Any) -> Any:
        """How a point runs: warm ranks (local, ``sweep.warm_pool``) or None (a fresh job)."""
        if cfg.cluster.kind != "local" or not cfg.sweep.warm_pool:
            return None
        if self.pool is None:
            from orchestrator.submit.pool import PoolLauncher

            self.pool = PoolLauncher(Path(self.sweep_dir) / ".pool")
        return self.pool

    def close_pool(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None


_DRIVER = _Driver()


def announce(points: int, swept: List[str], cluster_kind: str) -> None:
    """The sweep's first line (Hydra's own launcher lines are off: conf/config.yaml)."""
    _DRIVER.points = points
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


def _write_point(point: Point, record: Dict[str, Any]) -> None:
    point.run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(point.run_dir / POINT_FILE, json.dumps(record, indent=1, default=str) + "\n")


def _rebuild(sweep_dir: Path) -> None:
    """Rebuild the summary; a broken summary never takes the sweep down."""
    try:
        write_summary(sweep_dir)
    except Exception as exc:  # pragma: no cover - diagnostics only
        say(f"warning: could not rebuild the summary of {sweep_dir}: {exc!r}")


def _record(
    point: Point, record: Dict[str, Any], status: str, reason: str = "", quiet: bool = False, **extra: Any
) -> None:
    """Write the point's status (``quiet``: no line, no table: a detach says one line for all points)."""
    record.update(status=status, reason=reason, **extra)
    if status in FINAL:
        record["ended"] = time.time()
        if status in ("completed", "stopped"):
            record["measured"] = measured(point.run_dir, record.get("training", {}).get("timing_warmup_iters", 0))
    record["job_id"] = record.get("job_id") or job_id_in(point.run_dir)
    _write_point(point, record)
    if quiet:
        return
    if status != "running":
        line = f"point {point.num}: {status}" + (f" -- {short_reason(reason)}" if reason else "")
        say(line)
    _rebuild(point.sweep_dir)


def run_point(dcfg: Any, point: Point, run_fn: Callable[[Any], Optional[dict]]) -> Optional[float]:
    """Hydra's task function for one multirun point: decide, run, record; never raises (except Ctrl-C).

    ``run_fn`` is the single-run pipeline (``orchestrator.__main__.run``): JobConfig in, the
    logging rank's summary out (None for plan/dry-run).
    """
    from orchestrator.config.checks import validate, validate_planned
    from orchestrator.config.schema import to_job_config
    from orchestrator.plan import memory as planner

    _DRIVER.sweep_dir = point.sweep_dir
    of = f" ({point.num + 1} of {_DRIVER.points})" if _DRIVER.points else ""
    say(f"point {point.num}{of}: {' '.join(point.overrides)} -> {point.run_dir}")
    record: Dict[str, Any] = {
        "point": point.num,
        "overrides": point.overrides,
        "status": "running",
        "reason": "",
        "job_id": None,
        "run_dir": str(point.run_dir),
        "driver": {"pid": os.getpid(), "host": socket.gethostname()},
        "started": time.time(),
    }
    try:
        cfg = to_job_config(dcfg)
        if cfg.sweep.trace_iteration:  # the table's measured bubble (runtime.training.trace)
            cfg.training.trace_iteration = cfg.sweep.trace_iteration
        layout = validate_planned(cfg)[0] if cfg.plan and not cfg.dry_run else validate(cfg)  # as pipeline.run
        record["training"] = {
            "train_iters": cfg.training.train_iters,
            "timing_warmup_iters": cfg.training.timing_warmup_iters,
        }
        record["layout"] = layout_record(layout)
        record["cluster"] = cfg.cluster.kind
        plan = planner.plan(cfg)
    except OrchestratorError as exc:  # validate's one line (ConfigError, LayoutError) is the reason
        _record(point, record, "invalid", str(exc))
        return None
    # "plan": the device that runs (cpu for CPU runs, with this machine's memory per rank; its calibrated
    # profile when stored): shown in the table, and it decides skipped_oom_predicted; "plan_preset": the
    # gpu preset, for reference.
    device = device_of(cfg)
    runs_on = plan if device == cfg.gpu else planner.plan(cfg, gpu=device)
    record["plan"] = plan_record(runs_on)
    record["plan_preset"] = plan_record(plan)
    if not runs_on.fits and not cfg.sweep.run_predicted_oom:
        fix = "gpu=<a larger preset>" if device == cfg.gpu else "fewer ranks on this machine, or a smaller model"
        _record(
            point,
            record,
            "skipped_oom_predicted",
            f"{runs_on.reason}; to run it anyway: sweep.run_predicted_oom=true (or {fix})",
        )
        return None
    if cfg.cluster.kind in ("local", "hosts"):
        cfg.cluster.wait = True  # one point at a time on this machine (on these hosts)
    else:
        _DRIVER.wait_at_end = cfg.cluster.wait
        cfg.cluster.wait = False  # queue every point now; finish() waits for all of them
    launcher = _DRIVER.launcher(cfg)
    if launcher is not None and not (cfg.plan or cfg.dry_run):
        launcher.prestart(cfg, layout.world_size)  # the ranks import torch while this process prepares
    _record(point, record, "running")
    from orchestrator.submit.signals import Detached

    try:
        summary = run_fn(cfg, launcher) if launcher is not None else run_fn(cfg)
    except Detached:  # other points are queued: they run on (detached), and this one if sbatch took it already
        _queued(point, record, cfg, layout.world_size, job_id_in(point.run_dir), detaching=True)
        raise
    except KeyboardInterrupt:
        _record(point, record, "interrupted", "interrupted (KeyboardInterrupt) while running")
        raise
    except OrchestratorError as exc:
        _record(point, record, "failed", _tail(f"{type(exc).__name__}: {exc}"), job_id=_job_id_from_message(str(exc)))
        return None
    except Exception as exc:
        _record(point, record, "failed", _exception_reason(exc))
        return None
    if summary is None:
        _record(point, record, "planned", "plan/dry_run: nothing ran")
        return None
    job_id = str(summary.get("job_id")) if summary.get("job_id") is not None else None
    if summary.get("status") == "submitted":
        _queued(point, record, cfg, layout.world_size, job_id)
        return None
    status, reason = status_of_summary(summary)
    _record(point, record, status, reason, job_id=job_id)
    loss = summary.get("lm_loss")
    return float(loss) if isinstance(loss, (int, float)) else None


def _queued(
    point: Point, record: Dict[str, Any], cfg: Any, world_size: int, job_id: Optional[str], detaching: bool = False
) -> None:
    """A SLURM point's job is queued (``job_id``; None: ``detaching`` came first): waited on at the end, detachable."""
    from orchestrator.submit.signals import DetachSignals

    if job_id:
        _DRIVER.submitted.append((point, cfg, world_size, job_id))
        _DRIVER.signals = _DRIVER.signals or DetachSignals().hold()
    if detaching:
        _record(
            point,
            record,
            "submitted" if job_id else "interrupted",
            "" if job_id else "not queued: the launcher detached from the sweep's queued points before this one was",
            quiet=True,
        )
    else:
        _record(point, record, "submitted", job_id=job_id)


def _exception_reason(exc: BaseException, frames: int = 6, message_lines: int = 8) -> str:
    """An unexpected exception's last frames, then its type and message (the message first lines)."""
    tb = traceback.format_tb(exc.__traceback__)[-frames:]
    message = "".join(traceback.format_exception_only(type(exc), exc)).rstrip().splitlines()
    if len(message) > message_lines:
        message = message[:message_lines] + ["..."]
    return "".join(tb).rstrip() + "\n" + "\n".join(message)


def _job_id_from_message(message: str) -> Optional[str]:
    m = re.search(r"\bjob (\d+(?:_\d+)?)\b", message)
    return m.group(1) if m else None


def _wait_submitted(point: Point, cfg: Any, world_size: int, job_id: str) -> None:
    """Wait (bounded, as a single run's wait) for one SLURM point's job and record how it ended."""
    import submitit

    from orchestrator.ckpt.rundir import SUBMITIT_DIR
    from orchestrator.submit.signals import Detached
    from orchestrator.submit.wait import wait

    record = json.loads((point.run_dir / POINT_FILE).read_text())
    job = submitit.SlurmJob(folder=point.run_dir / SUBMITIT_DIR, job_id=job_id, tasks=tuple(range(world_size)))
    try:
        summaries = wait(
            job, cfg, world_size, progress=None, own_signals=not (_DRIVER.signals and _DRIVER.signals.held)
        )
    except Detached:  # the launcher leaves; the jobs run on (submit.signals): detached() records the open points
        raise
    except KeyboardInterrupt:
        _record(point, record, "interrupted", f"interrupted while waiting for job {job_id}")
        raise
    except OrchestratorError as exc:
        _record(point, record, "failed", _tail(f"{type(exc).__name__}: {exc}"))
        return
    best = next((s for s in summaries if isinstance(s, dict) and s.get("logging_rank")), None) or {}
    status, reason = status_of_summary(best)
    _record(point, record, status, reason)


def finish() -> Optional[int]:
    """After Hydra's last point: wait for queued SLURM points, rebuild and print the ranked table.

    Returns the sweep's exit code, or None when no multirun point ran in this process.
    """
    sweep_dir = _DRIVER.sweep_dir
    if sweep_dir is None:
        return None
    if _DRIVER.pool is not None:
        _DRIVER.pool.stop()  # the warm ranks exit while the table is built
    if _DRIVER.submitted and _DRIVER.wait_at_end:
        from orchestrator.submit.signals import raise_if_interrupted

        say(
            f"waiting for {len(_DRIVER.submitted)} SLURM job(s): "
            + ", ".join(f"point {p.num} = job {j}" for p, _, _, j in _DRIVER.submitted)
        )
        for point, cfg, world_size, job_id in _DRIVER.submitted:
            raise_if_interrupted()  # a detach a callee swallowed (as Python does in at-fork hooks)
            _wait_submitted(point, cfg, world_size, job_id)
    if _DRIVER.signals is not None:
        _DRIVER.signals.release()
    rows, swept = write_summary(sweep_dir)
    print(format_report(sweep_dir, rows, swept), flush=True)
    _DRIVER.close_pool()
    if _DRIVER.submitted and not _DRIVER.wait_at_end:
        say(f"jobs queued (cluster.wait=false); later: python -m orchestrator.sweep summarize {sweep_dir}")
    return exit_code(rows, unfinished_ok=bool(_DRIVER.submitted) and not _DRIVER.wait_at_end)


def detached(exc: BaseException) -> None:
    """A signal detached the launcher from a SLURM sweep (``_Driver.signals``; else nothing): an ended point is
    recorded, the others stay ``submitted``, saying so; one line names their jobs and the commands for them."""
    from orchestrator.ckpt.rundir import SUBMITIT_DIR
    from orchestrator.submit.signals import Detached, say_detached

    held = _DRIVER.signals
    if held is None or held.release() is None or not isinstance(exc, Detached) or _DRIVER.sweep_dir is None:
        return
    name, sweep_dir = signal.Signals(held.signum).name, _DRIVER.sweep_dir

    open_ = []
    for point, cfg, world_size, job_id in _DRIVER.submitted:
        record = json.loads((point.run_dir / POINT_FILE).read_text())
        if record.get("status") in FINAL:
            continue
        if len(list((point.run_dir / SUBMITIT_DIR).glob(f"{job_id}_*_result.pkl"))) >= world_size:
            _wait_submitted(point, cfg, world_size, job_id)  # it has ended: every rank's result is there, read now
        else:
            open_.append((point, job_id))
            _record(
                point,
                record,
                "submitted",
                f"the launcher detached ({name}); job {job_id} runs on; "
                f"`python -m orchestrator.sweep summarize {sweep_dir}` reads it",
                quiet=True,
            )
    jobs = ", ".join(f"{job_id} (point {point.num})" for point, job_id in open_) or "none left"
    exc.line = (
        f"detached ({name}) from the sweep: SLURM job(s) {jobs} run on, untouched; follow them with "
        f"`python -m orchestrator status {sweep_dir}`; the table once they have ended: "
        f"`python -m orchestrator.sweep summarize {sweep_dir}`; stop one with "
        f"`python -m orchestrator stop {sweep_dir}/<point>` (saves first; --now: at once)"
    )
    exc.signum, exc.job_id = held.signum, ",".join(job_id for _, job_id in open_)
    _rebuild(sweep_dir)
    say_detached(exc, {str(point.run_dir): job_id for point, job_id in open_})


# ====================================================================== CLI
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineArgumentParser(prog="python -m orchestrator.sweep", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("summarize", help="rebuild summary.csv/.md/.png of a sweep directory and print the ranking")
    s.add_argument("sweep_dir", type=Path)
    args = parser.parse_args(argv)
    if not args.sweep_dir.is_dir():
        print(
            f"error: {args.sweep_dir} is not a directory (expected <run.root>/sweeps/<run.name>/<time>)",
            file=sys.stderr,
        )
        return 2
    rows, swept = write_summary(args.sweep_dir)
    if not rows:
        print(
            f"error: no sweep points under {args.sweep_dir} (no numbered point directories, no multirun.yaml)",
            file=sys.stderr,
        )
        return 2
    print(format_report(args.sweep_dir, rows, swept), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
