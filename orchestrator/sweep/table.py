"""The results table of a sweep, rebuilt from the sweep directory alone.

:func:`write_summary` reads every ``<sweep dir>/<num>/point.json`` (written by
:mod:`orchestrator.sweep.points`; what it holds: :mod:`orchestrator.sweep.records`) and the point's ``metrics.jsonl`` and writes ``summary.csv``,
``summary.md`` and ``summary.png`` atomically. It needs nothing from the process that ran the
sweep, so it works at any time: a point still running is read from its ``metrics.jsonl`` (and its
job's state from :mod:`orchestrator.status`); a point whose sweep process is gone is
``interrupted``; points Hydra has not started yet (reproduced from ``multirun.yaml``) are
``pending``.

Statuses: ``completed``, ``planned`` (``plan=true``/``dry_run=true``: nothing ran),
``invalid``, ``skipped_oom_predicted``, ``failed``, ``interrupted``, ``stopped`` (preempted and
not requeued), and while the sweep runs ``pending``, ``running``, ``submitted``.

Measured numbers come only from the point's ``metrics.jsonl`` (its final ``summary`` record, or
the per-iteration records while it runs); predicted ones only from :mod:`orchestrator.planner`:

* step time: median over the iterations after ``training.timing_warmup_iters`` (seconds);
* tokens/s = tokens per step (GBS x seq_length) / step time; samples/s = GBS / step time;
* TFLOP/s per device = model FLOPs per step / step time / world size / 1e12, with model FLOPs
  per step from :func:`orchestrator.planner.flops_per_step`: 3 x the forward FLOPs (backward =
  2 x forward), causal attention core (as Megatron-LM counts it), no recomputation counted -- for a
  standard GPT 72 B s l h^2 (1 + s/(12h) +
  V/(12 l h)). Source: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM" (SC'21, arXiv:2104.04473), section 5.1, which reports per-GPU
  throughput this way (their 96 B s l h^2 variant adds the extra forward of full recomputation);
* peak memory per rank (measured): the largest ``peak_rss_mb_per_rank`` (process max RSS, MiB;
  while running, the logging rank's ``max_rss_mb``); predicted memory: the planner's worst stage on
  the device that ran (``point.json``'s ``plan``: ``cpu`` for CPU runs, else the ``gpu`` preset),
  with its calibrated device profile when one is stored (:mod:`orchestrator.plan.profile`);
  memory error % = 100 x (predicted - measured) / measured, measured = torch's peak allocated on
  GPU runs, else the peak RSS;
* predicted step time: the same plan's (seconds); step-time error % = 100 x (predicted - measured) / measured;
* bubble fraction: the planner's (p-1)/(v m + p-1) (Narayanan et al. 2021, section 2.2); measured bubble: the
  traced iteration's idle share, mean over stages (``sweep.trace_iteration``, runtime.training.trace).

Completed (and still running) points are ranked by measured tokens/s, fastest first; the rest follow
in point order (a failed, interrupted or stopped point shows what it measured, unranked).
The table as text (CSV, Markdown, the printed report): :mod:`orchestrator.sweep.render`.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.io import write_atomic
from orchestrator.sweep.records import FINAL, POINT_FILE, UNFINISHED, job_id_in, measured, status_of_summary
from orchestrator.sweep.render import SUMMARY_CSV, SUMMARY_MD, SUMMARY_PNG, to_csv, to_markdown

MiB = 2**20


def _error_pct(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    return 100.0 * (predicted - measured) / measured if predicted is not None and measured else None


def _split(override: str) -> Tuple[str, str]:
    key, _, value = override.partition("=")
    return key, value


def expected_points(sweep_dir: Path) -> Tuple[List[List[str]], List[str]]:
    """(override list per point number, swept keys) reproduced from ``multirun.yaml``, as Hydra's
    basic sweeper expands them; ([], []) when that is not possible (another sweeper, globs)."""
    path = Path(sweep_dir) / "multirun.yaml"
    if not path.exists():
        return [], []
    try:
        from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
        from hydra.core.override_parser.overrides_parser import OverridesParser
        from omegaconf import OmegaConf

        conf = OmegaConf.load(path)
        args = list(OmegaConf.select(conf, "hydra.overrides.task", default=[]) or [])
        params = OmegaConf.select(conf, "hydra.sweeper.params", default=None)
        if params:
            args = [f"{k}={v}" for k, v in OmegaConf.to_container(params).items()] + args
        parsed = OverridesParser.create().parse_overrides(args)
        swept = [o.get_key_element() for o in parsed if o.is_sweep_override()]
        batches = BasicSweeper.split_arguments(parsed, None)
        return (batches[0] if batches else []), swept
    except Exception:
        return [], []


def _pid_alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except (TypeError, ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _live_status(run_dir: Path) -> Tuple[Optional[str], str]:
    """(state, detail) of the point's job from :mod:`orchestrator.status` (None if unknown)."""
    try:
        from orchestrator.submit.status import run_status
    except ImportError:
        return None, ""
    try:
        rs = run_status(run_dir)
    except Exception:
        return None, ""
    state = rs.state
    detail = "\n".join(rs.failure[1]) if getattr(rs, "failure", None) else (rs.job.detail if rs.job else "")
    return (None if state == "unknown" else state), detail


def _resolve_status(point: Dict[str, Any], run_dir: Path, meas: Dict[str, Any]) -> Tuple[str, str]:
    """The status a row shows: final statuses as recorded; for unfinished ones, what the job and
    its metrics say now."""
    status, reason = point.get("status", "running"), point.get("reason", "")
    if status in FINAL:
        return status, reason
    if meas.get("source") == "summary":
        return status_of_summary({"status": meas.get("job_status"), "iteration": meas.get("iteration")})
    state, detail = _live_status(run_dir)
    if state in ("failed", "cancelled"):
        return "failed", detail or f"job {state}"
    if state == "stopped":
        return "stopped", detail
    if state in ("pending", "running", "requeued"):
        return ("submitted" if state == "pending" else state), reason
    driver = point.get("driver") or {}
    if driver.get("host") == socket.gethostname() and not _pid_alive(driver.get("pid")) and state is None:
        return "interrupted", f"the sweep process (pid {driver.get('pid')}) ended before this point finished"
    return status, reason


def _number(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def collect(sweep_dir: Path) -> Tuple[List[Dict[str, Any]], List[str]]:
    """One row per point (ranked: measured points by tokens/s, fastest first, then the rest by
    point number) and the swept keys."""
    sweep_dir = Path(sweep_dir)
    expected, swept = expected_points(sweep_dir)
    dirs = (
        {int(p.name): p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()} if sweep_dir.is_dir() else {}
    )
    points: Dict[int, Dict[str, Any]] = {}
    for num in sorted(set(dirs) | set(range(len(expected)))):
        path = dirs.get(num, sweep_dir / str(num)) / POINT_FILE
        try:
            points[num] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            started = num in dirs
            points[num] = {
                "point": num,
                "overrides": expected[num] if num < len(expected) else [],
                "status": "running" if started else "pending",
                "run_dir": str(sweep_dir / str(num)),
            }
    if not swept:  # no multirun.yaml: the keys whose values differ between points
        values: Dict[str, set] = {}
        for p in points.values():
            for k, v in map(_split, p.get("overrides", [])):
                values.setdefault(k, set()).add(v)
        swept = [k for k, vs in values.items() if len(vs) > 1 or len(points) == 1]
    rows = [_row(num, p, swept) for num, p in points.items()]
    # Ranked: completed points, and points still running (a live view); a failed, interrupted or stopped
    # point keeps its partial measurements in the table but no rank.
    rankable = [r for r in rows if r["tokens_per_s"] is not None and r["status"] in ("completed", *UNFINISHED)]
    ranked = sorted(rankable, key=lambda r: -r["tokens_per_s"])
    for i, r in enumerate(ranked, 1):
        r["rank"] = i
    rest = [r for r in rows if r not in ranked]
    return ranked + rest, swept


def _row(num: int, point: Dict[str, Any], swept: List[str]) -> Dict[str, Any]:
    run_dir = Path(point.get("run_dir") or "")
    lay, pl = point.get("layout") or {}, point.get("plan") or {}
    warmup = (point.get("training") or {}).get("timing_warmup_iters", 0)
    meas = measured(run_dir, warmup) if point.get("status") not in ("invalid", "skipped_oom_predicted") else {}
    status, reason = _resolve_status(point, run_dir, meas)
    ov = dict(map(_split, point.get("overrides", [])))
    step = _number(meas.get("step_time_median_s"))
    predicted_mib = pl["peak_bytes"] / MiB if _number(pl.get("peak_bytes")) else None
    predicted_step = _number(pl.get("step_time_s"))
    measured_mib = _number(meas.get("peak_gpu_mib")) or _number(meas.get("peak_rss_mib"))
    tokens_per_step = _number(meas.get("tokens_per_step")) or _number(lay.get("tokens_per_step"))
    gbs, world, flops = (
        _number(lay.get("global_batch_size")),
        _number(lay.get("world_size")),
        _number(pl.get("model_flops")),
    )
    row: Dict[str, Any] = {
        "rank": None,
        "point": num,
        "overrides": " ".join(f"{k}={ov[k]}" for k in swept if k in ov) or " ".join(point.get("overrides", [])),
        "job_id": point.get("job_id") or job_id_in(run_dir),
        "status": status,
        "step_time_median_s": step,
        "tokens_per_s": tokens_per_step / step if step and tokens_per_step else None,
        "samples_per_s": gbs / step if step and gbs else None,
        "tflops_per_device": flops / step / world / 1e12 if step and flops and world else None,
        "peak_rss_mib": _number(meas.get("peak_rss_mib")),
        "peak_gpu_mib": _number(meas.get("peak_gpu_mib")),  # GPU runs: torch.cuda.max_memory_allocated
        "predicted_mib": predicted_mib,
        "memory_error_pct": _error_pct(predicted_mib, measured_mib),
        "predicted_step_time_s": predicted_step,
        "step_time_error_pct": _error_pct(predicted_step, step),
        "bubble_fraction": _number(pl.get("bubble_fraction")),
        "measured_bubble_fraction": _number(meas.get("measured_bubble")),
        "reason": reason or "",
        "timed_iterations": meas.get("timed_iterations"),
        "iteration": meas.get("iteration"),
        "lm_loss": _number(meas.get("lm_loss")),
        "world_size": lay.get("world_size"),
        "global_batch_size": lay.get("global_batch_size"),
        "tokens_per_step": tokens_per_step,
        "model_flops_per_step": flops,
        "gpu": pl.get("gpu"),
        "run_dir": str(run_dir),
    }
    if status == "running" and meas.get("source") == "running" and not row["reason"]:
        row["reason"] = (
            f"running: iteration {meas.get('iteration')}/{(point.get('training') or {}).get('train_iters')}"
            " (memory: logging rank so far)"
        )
    for k in swept:
        row[k] = ov.get(k)
    return row


def write_summary(sweep_dir: Path) -> Tuple[List[Dict[str, Any]], List[str]]:
    """Rebuild summary.csv, summary.md and summary.png from the sweep directory; return (rows, swept keys)."""
    sweep_dir = Path(sweep_dir)
    rows, swept = collect(sweep_dir)
    gpus = sorted({r["gpu"] for r in rows if r.get("gpu")})
    write_atomic(sweep_dir / SUMMARY_CSV, to_csv(rows, swept))
    md = (
        f"# Sweep {sweep_dir}\n\nRanked by measured tokens/s (median step time after warm-up). "
        f"Swept: {', '.join(swept) or '-'}.\n\n" + to_markdown(rows, ", ".join(gpus) or None)
    )
    write_atomic(sweep_dir / SUMMARY_MD, md)
    from orchestrator.sweep.plot import plot

    plot(rows, swept, sweep_dir / SUMMARY_PNG, title=f"{sweep_dir.parent.name}/{sweep_dir.name}")
    return rows, swept
