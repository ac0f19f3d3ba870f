"""What a sweep point records and what it measured: ``<point dir>/point.json``'s layout and planner
numbers, its statuses, its job id, the status a job's summary means, and the numbers of its
``metrics.jsonl`` (:func:`measured`). The table built from them: :mod:`orchestrator.sweep.table`.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

from orchestrator.ckpt.rundir import METRICS_FILE
from orchestrator.io import read_jsonl

POINT_FILE = "point.json"


FINAL = ("completed", "planned", "invalid", "skipped_oom_predicted", "failed", "interrupted", "stopped")


FAILURES = ("failed", "interrupted", "stopped")


UNFINISHED = ("pending", "running", "submitted", "requeued")


def layout_record(layout) -> Dict[str, Any]:
    """The layout numbers a point records (a :class:`~orchestrator.config.layout.ParallelLayout` in)."""
    return {
        "world_size": layout.world_size,
        "tensor_model_parallel_size": layout.tensor_model_parallel_size,
        "pipeline_model_parallel_size": layout.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": layout.virtual_pipeline_model_parallel_size,
        "data_parallel_size": layout.data_parallel_size,
        "micro_batch_size": layout.micro_batch_size,
        "global_batch_size": layout.global_batch_size,
        "num_microbatches": layout.num_microbatches,
        "tokens_per_step": layout.tokens_per_step,
    }


def plan_record(plan) -> Dict[str, Any]:
    """The planner numbers a point records (an :class:`~orchestrator.plan.memory.Plan` in)."""
    return {
        "gpu": plan.gpu.name,
        "fits": plan.fits,
        "peak_bytes": plan.peak_bytes,
        "bubble_fraction": plan.bubble_fraction,
        "model_flops": plan.model_flops,
        "step_time_s": plan.step_time_s,
        "verdict": plan.reason,
        "profile": plan.profile.device if plan.profile is not None else None,
        "calibrated": bool(plan.profile is not None and plan.profile.calibrated),
    }


def job_id_in(run_dir: Path) -> Optional[str]:
    """The newest job id of a run: the latest submission in ``jobs.jsonl`` (a point on warm ranks names the
    pool's job there), else the newest ``<run_dir>/submitit/<id>_submitted.pkl``."""
    from orchestrator.ckpt.rundir import JOBS_FILE

    submitted = [r for r in read_jsonl(Path(run_dir) / JOBS_FILE) if r.get("event") == "submitted"]
    if submitted:
        return str(submitted[-1].get("job_id"))
    folder = Path(run_dir) / "submitit"
    if not folder.is_dir():
        return None
    found = [(p.stat().st_mtime, p.name.split("_")[0]) for p in folder.glob("*_submitted.pkl")]
    return max(found)[1] if found else None


def status_of_summary(summary: Dict[str, Any]) -> Tuple[str, str]:
    s = summary.get("status")
    if s == "completed":
        return "completed", ""
    if s == "exited":
        return "completed", f"stopped early at iteration {summary.get('iteration')} (training.exit_after_iters)"
    if s == "stopped":
        return "stopped", f"stopped by a signal at iteration {summary.get('iteration')} and not requeued"
    return "failed", f"the job ended with status {s!r}"


def exit_code(rows: Sequence[Dict[str, Any]], unfinished_ok: bool = False) -> int:
    """1 if a point failed (or is unfinished, unless ``unfinished_ok``), 2 if one was invalid, else 0."""
    statuses = {r["status"] for r in rows}
    bad = set(FAILURES) | (set() if unfinished_ok else set(UNFINISHED))
    if statuses & bad:
        return 1
    if "invalid" in statuses:
        return 2
    return 0


def error_line(rows: Sequence[Dict[str, Any]], code: int) -> Optional[str]:
    """The one ``error:`` line a sweep ending with ``code`` (:func:`exit_code`) says on stderr, or None for 0: how
    many points failed or were invalid, the first one's overrides and reason (the table has every point's)."""
    if code == 0:
        return None
    kinds = ("invalid",) if code == 2 else (*FAILURES, *UNFINISHED)
    bad = [r for r in rows if r["status"] in kinds]
    if not bad:
        return None
    first = bad[0]
    overrides = first.get("overrides") or "-"
    overrides = overrides if isinstance(overrides, str) else " ".join(overrides)
    what = "invalid" if code == 2 else "did not complete"
    lines = [x.strip() for x in str(first.get("reason") or first["status"]).strip().splitlines() if x.strip()]
    reason = lines[0] if len(lines) == 1 else f"{lines[0].rstrip(':')} ... {lines[-1]}"  # a traceback: its ends
    reason = reason if len(reason) <= 400 else reason[:399] + "…"
    return (
        f"error: sweep: {len(bad)} of {len(rows)} point(s) {what}; point {first['point']} ({overrides}): {reason}"
        + ("" if "fix:" in reason else "; fix: see each point's reason in the table above")
    )


def measured(run_dir: Path, warmup_iters: int) -> Dict[str, Any]:
    """What the point's job measured, from ``<run_dir>/metrics.jsonl`` only.

    Finished job (its last record is the ``summary`` event): that record's step-time median,
    timed iterations, tokens per step, and the largest of ``peak_rss_mb_per_rank``.
    Running job: the per-iteration records after the last event, the first ``warmup_iters`` of
    this job excluded (as the training loop does), median of their ``step_time_s``; memory is the
    logging rank's ``max_rss_mb`` (the only rank that writes records).
    Empty dict when nothing was measured yet.
    """
    records = read_jsonl(Path(run_dir) / METRICS_FILE)
    if not records:
        return {}
    # Job boundaries (start, stopped, summary); an evaluation or a save in the middle of a job is not one.
    last_event = max((i for i, r in enumerate(records) if r.get("event") not in (None, "eval", "saved")), default=-1)
    if last_event >= 0 and records[last_event].get("event") == "summary":
        s = records[last_event]
        per_rank = [x for x in s.get("peak_rss_mb_per_rank") or [] if isinstance(x, (int, float))]
        gpu_rank = [x for x in s.get("peak_gpu_mem_mb_per_rank") or [] if isinstance(x, (int, float))]
        return {
            "source": "summary",
            "job_status": s.get("status"),
            "iteration": s.get("iteration"),
            "lm_loss": s.get("lm_loss"),
            "step_time_median_s": s.get("step_time_median_s"),
            "timed_iterations": s.get("timed_iterations"),
            "tokens_per_step": s.get("tokens_per_step"),
            "peak_rss_mib": max(per_rank) if per_rank else None,
            "peak_gpu_mib": max(gpu_rank) if gpu_rank else None,
            "measured_bubble": statistics.mean(x)
            if (x := (s.get("schedule_trace") or {}).get("measured_idle_share"))
            else None,
        }
    start = int(records[last_event].get("iteration") or 0) if last_event >= 0 else 0
    iters = [r for r in records[last_event + 1 :] if "step_time_s" in r and "iteration" in r]
    if not iters:
        return {}
    timed = [r["step_time_s"] for r in iters if r["iteration"] - start > warmup_iters]
    rss = [r["max_rss_mb"] for r in iters if isinstance(r.get("max_rss_mb"), (int, float))]
    return {
        "source": "running",
        "job_status": "running",
        "iteration": iters[-1]["iteration"],
        "lm_loss": iters[-1].get("lm_loss"),
        "step_time_median_s": statistics.median(timed) if timed else None,
        "timed_iterations": len(timed),
        "tokens_per_step": None,
        "peak_rss_mib": max(rss) if rss else None,
    }
