"""SLURM points of a sweep: each point's job is queued at once (like an array's tasks, each its own job);
after Hydra's last point the driver waits for every one and records how it ended (:func:`finish`), or a
signal detaches it from all of them (:func:`detached`). The points' records: :mod:`orchestrator.sweep.points`.
"""

from __future__ import annotations

import json
import signal
import sys
from typing import Any, Dict, Optional

from orchestrator.errors import OrchestratorError
from orchestrator.sweep.points import DRIVER, Point, rebuild, record_point, say, tail
from orchestrator.sweep.records import FINAL, POINT_FILE, error_line, exit_code, status_of_summary
from orchestrator.sweep.render import format_report
from orchestrator.sweep.table import write_summary


def queued(
    point: Point, record: Dict[str, Any], cfg: Any, world_size: int, job_id: Optional[str], detaching: bool = False
) -> None:
    """A SLURM point's job is queued (``job_id``; None: ``detaching`` came first): waited on at the end, detachable."""
    from orchestrator.submit.signals import DetachSignals

    if job_id:
        DRIVER.submitted.append((point, cfg, world_size, job_id))
        DRIVER.signals = DRIVER.signals or DetachSignals().hold()
    if detaching:
        record_point(
            point,
            record,
            "submitted" if job_id else "interrupted",
            "" if job_id else "not queued: the launcher detached from the sweep's queued points before this one was",
            quiet=True,
        )
    else:
        record_point(point, record, "submitted", job_id=job_id)


def wait_submitted(point: Point, cfg: Any, world_size: int, job_id: str) -> None:
    """Wait (bounded, as a single run's wait) for one SLURM point's job and record how it ended."""
    import submitit

    from orchestrator.ckpt.rundir import SUBMITIT_DIR
    from orchestrator.submit.signals import Detached
    from orchestrator.submit.wait import wait

    record = json.loads((point.run_dir / POINT_FILE).read_text())
    job = submitit.SlurmJob(folder=point.run_dir / SUBMITIT_DIR, job_id=job_id, tasks=tuple(range(world_size)))
    try:
        summaries = wait(job, cfg, world_size, progress=None, own_signals=not (DRIVER.signals and DRIVER.signals.held))
    except Detached:  # the launcher leaves; the jobs run on (submit.signals): detached() records the open points
        raise
    except KeyboardInterrupt:
        record_point(point, record, "interrupted", f"interrupted while waiting for job {job_id}")
        raise
    except OrchestratorError as exc:
        record_point(point, record, "failed", tail(f"{type(exc).__name__}: {exc}"))
        return
    best = next((s for s in summaries if isinstance(s, dict) and s.get("logging_rank")), None) or {}
    status, reason = status_of_summary(best)
    record_point(point, record, status, reason)


def finish() -> Optional[int]:
    """After Hydra's last point: wait for queued SLURM points, rebuild and print the ranked table.

    Returns the sweep's exit code, or None when no multirun point ran in this process.
    """
    sweep_dir = DRIVER.sweep_dir
    if sweep_dir is None:
        return None
    if DRIVER.pool is not None:
        DRIVER.pool.stop()  # the warm ranks exit while the table is built
    if DRIVER.submitted and DRIVER.wait_at_end:
        from orchestrator.submit.signals import raise_if_interrupted

        say(
            f"waiting for {len(DRIVER.submitted)} SLURM job(s): "
            + ", ".join(f"point {p.num} = job {j}" for p, _, _, j in DRIVER.submitted)
        )
        for point, cfg, world_size, job_id in DRIVER.submitted:
            raise_if_interrupted()  # a detach a callee swallowed (as Python does in at-fork hooks)
            wait_submitted(point, cfg, world_size, job_id)
    if DRIVER.signals is not None:
        DRIVER.signals.release()
    rows, swept = write_summary(sweep_dir)
    print(format_report(sweep_dir, rows, swept), flush=True)
    DRIVER.close_pool()
    if DRIVER.submitted and not DRIVER.wait_at_end:
        say(f"jobs queued (cluster.wait=false); later: python -m orchestrator sweep summarize {sweep_dir}")
    code = exit_code(rows, unfinished_ok=bool(DRIVER.submitted) and not DRIVER.wait_at_end)
    line = error_line(rows, code)
    if line:
        print(line, file=sys.stderr, flush=True)
    return code


def detached(exc: BaseException) -> None:
    """A signal detached the launcher from a SLURM sweep (``Driver.signals``; else nothing): an ended point is
    recorded, the others stay ``submitted``, saying so; one line names their jobs and the commands for them."""
    from orchestrator.ckpt.rundir import SUBMITIT_DIR
    from orchestrator.submit.signals import Detached, say_detached

    held = DRIVER.signals
    if held is None or held.release() is None or not isinstance(exc, Detached) or DRIVER.sweep_dir is None:
        return
    name, sweep_dir = signal.Signals(held.signum).name, DRIVER.sweep_dir

    open_ = []
    for point, cfg, world_size, job_id in DRIVER.submitted:
        record = json.loads((point.run_dir / POINT_FILE).read_text())
        if record.get("status") in FINAL:
            continue
        if len(list((point.run_dir / SUBMITIT_DIR).glob(f"{job_id}_*_result.pkl"))) >= world_size:
            wait_submitted(point, cfg, world_size, job_id)  # it has ended: every rank's result is there, read now
        else:
            open_.append((point, job_id))
            record_point(
                point,
                record,
                "submitted",
                f"the launcher detached ({name}); job {job_id} runs on; "
                f"`python -m orchestrator sweep summarize {sweep_dir}` reads it",
                quiet=True,
            )
    jobs = ", ".join(f"{job_id} (point {point.num})" for point, job_id in open_) or "none left"
    exc.line = (
        f"detached ({name}) from the sweep: SLURM job(s) {jobs} run on, untouched; follow them with "
        f"`python -m orchestrator status {sweep_dir}`; the table once they have ended: "
        f"`python -m orchestrator sweep summarize {sweep_dir}`; stop one with "
        f"`python -m orchestrator stop {sweep_dir}/<point>` (saves first; --now: at once)"
    )
    exc.signum, exc.job_id = held.signum, ",".join(job_id for _, job_id in open_)
    rebuild(sweep_dir)
    say_detached(exc, {str(point.run_dir): job_id for point, job_id in open_})
