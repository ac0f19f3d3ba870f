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
  alone by :func:`orchestrator.sweep.table.write_summary`, so it exists whatever happens to later
  points; the columns and their formulas are documented there.

Exit code of a sweep: 1 if any point failed, was interrupted or stopped, 2 if none did but some
point was invalid, else 0 (points skipped as predicted OOM are a decision, not a failure).

Rooms: a point's evaluation (:func:`evaluate_point`) and launch (:func:`launch_point`) here; each point's
record and the driver's state in :mod:`orchestrator.sweep.points`; SLURM points queued and waited on at the
end (:func:`finish`, :func:`detached`) in :mod:`orchestrator.sweep.queue`.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from orchestrator.errors import OneLineArgumentParser, OrchestratorError
from orchestrator.plan.profile import device_of, planned_device
from orchestrator.sweep.points import (
    DRIVER,
    Point,
    announce,
    current_point,
    exception_reason,
    job_id_from_message,
    record_point,
    say,
    tail,
)
from orchestrator.sweep.queue import detached, finish, queued
from orchestrator.sweep.records import exit_code, job_id_in, layout_record, measured, plan_record, status_of_summary
from orchestrator.sweep.render import COLUMNS, format_report
from orchestrator.sweep.table import write_summary

__all__ = [
    "COLUMNS",
    "Point",
    "announce",
    "current_point",
    "detached",
    "exit_code",
    "finish",
    "main",
    "measured",
    "run_point",
    "write_summary",
]


def run_point(dcfg: Any, point: Point, run_fn: Callable[[Any], Optional[dict]]) -> Optional[float]:
    """Hydra's task function for one multirun point: decide, run, record; never raises (except Ctrl-C).

    ``run_fn`` is the single-run pipeline (``orchestrator.__main__.run``): JobConfig in, the
    logging rank's summary out (None for plan/dry-run). Returns the point's lm loss (None: none).
    """
    DRIVER.sweep_dir = point.sweep_dir
    of = f" ({point.num + 1} of {DRIVER.points})" if DRIVER.points else ""
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
    evaluated = evaluate_point(dcfg, point, record)
    if evaluated is None:
        return None
    return launch_point(*evaluated, point, record, run_fn)


def evaluate_point(dcfg: Any, point: Point, record: Dict[str, Any]) -> Optional[Tuple[Any, Any]]:
    """A point's evaluation before anything runs: compose, validate the layout, plan; ``(JobConfig,
    ParallelLayout)`` to launch, or None once recorded ``invalid`` or ``skipped_oom_predicted``."""
    from orchestrator.config.checks import validate, validate_planned
    from orchestrator.config.schema import to_job_config
    from orchestrator.plan import memory as planner

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
        record_point(point, record, "invalid", str(exc))
        return None
    # "plan": the device that runs (cpu for CPU runs, with this machine's memory per rank; its calibrated
    # profile when stored): shown in the table, and it decides skipped_oom_predicted; "plan_preset": the
    # gpu preset, for reference.
    device = device_of(cfg)
    runs_on = plan if device == planned_device(cfg) else planner.plan(cfg, gpu=device)
    record["plan"] = plan_record(runs_on)
    record["plan_preset"] = plan_record(plan)
    if not runs_on.fits and not cfg.sweep.run_predicted_oom:
        fix = (
            "gpu=<a larger preset>"
            if device == planned_device(cfg)
            else "fewer ranks on this machine, or a smaller model"
        )
        record_point(
            point,
            record,
            "skipped_oom_predicted",
            f"{runs_on.reason}; to run it anyway: sweep.run_predicted_oom=true (or {fix})",
        )
        return None
    return cfg, layout


def launch_point(
    cfg: Any, layout: Any, point: Point, record: Dict[str, Any], run_fn: Callable[[Any], Optional[dict]]
) -> Optional[float]:
    """Launch an evaluated point (``run_fn``: the single-run pipeline) and record how it went; its lm loss."""
    if cfg.cluster.kind in ("local", "hosts"):
        cfg.cluster.wait = True  # one point at a time on this machine (on these hosts)
    else:
        DRIVER.wait_at_end = cfg.cluster.wait
        cfg.cluster.wait = False  # queue every point now; finish() waits for all of them
    launcher = DRIVER.launcher(cfg)
    if launcher is not None and not (cfg.plan or cfg.dry_run):
        launcher.prestart(cfg, layout.world_size)  # the ranks import torch while this process prepares
    record_point(point, record, "running")
    from orchestrator.submit.signals import Detached

    try:
        summary = run_fn(cfg, launcher) if launcher is not None else run_fn(cfg)
    except Detached:  # other points are queued: they run on (detached), and this one if sbatch took it already
        queued(point, record, cfg, layout.world_size, job_id_in(point.run_dir), detaching=True)
        raise
    except KeyboardInterrupt:
        record_point(point, record, "interrupted", "interrupted (KeyboardInterrupt) while running")
        raise
    except OrchestratorError as exc:
        record_point(
            point, record, "failed", tail(f"{type(exc).__name__}: {exc}"), job_id=job_id_from_message(str(exc))
        )
        return None
    except Exception as exc:
        record_point(point, record, "failed", exception_reason(exc))
        return None
    if summary is None:
        record_point(point, record, "planned", "plan/dry_run: nothing ran")
        return None
    job_id = str(summary.get("job_id")) if summary.get("job_id") is not None else None
    if summary.get("status") == "submitted":
        queued(point, record, cfg, layout.world_size, job_id)
        return None
    status, reason = status_of_summary(summary)
    record_point(point, record, status, reason, job_id=job_id)
    loss = summary.get("lm_loss")
    return float(loss) if isinstance(loss, (int, float)) else None


# ====================================================================== CLI
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineArgumentParser(prog="python -m orchestrator sweep", description=__doc__.split("\n")[0])
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
