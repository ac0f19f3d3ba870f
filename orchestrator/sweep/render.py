"""A sweep's table as text: its columns, ``summary.csv`` (full precision), the Markdown table of
``summary.md`` and the report printed at the end of a sweep. The rows: :mod:`orchestrator.sweep.table`.
"""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

SUMMARY_CSV, SUMMARY_MD, SUMMARY_PNG = "summary.csv", "summary.md", "summary.png"


COLUMNS = [
    "rank",
    "point",
    "overrides",
    "job_id",
    "status",
    "step_time_median_s",
    "tokens_per_s",
    "samples_per_s",
    "tflops_per_device",
    "peak_rss_mib",
    "predicted_mib",
    "memory_error_pct",
    "predicted_step_time_s",
    "step_time_error_pct",
    "bubble_fraction",
    "measured_bubble_fraction",
    "reason",
]
"""The results table; summary.csv adds one column per swept key and the details in EXTRA_COLUMNS."""


EXTRA_COLUMNS = [
    "peak_gpu_mib",
    "timed_iterations",
    "iteration",
    "lm_loss",
    "world_size",
    "global_batch_size",
    "tokens_per_step",
    "model_flops_per_step",
    "gpu",
    "run_dir",
]


def _cell(v: Any) -> str:
    return "" if v is None else str(v)


def to_csv(rows: Sequence[Dict[str, Any]], swept: Sequence[str]) -> str:
    """CSV with full-precision numbers (Python's repr: they round-trip to the metrics' values)."""
    buf = io.StringIO()
    cols = COLUMNS + [k for k in swept if k not in COLUMNS] + EXTRA_COLUMNS
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(cols)
    for r in rows:
        w.writerow([_cell(r.get(c)) for c in cols])
    return buf.getvalue()


def short_reason(reason: str, width: int = 160) -> str:
    """One line of a multi-line reason: the exception line when there is one, else the first line."""
    lines = [ln.strip() for ln in str(reason).splitlines() if ln.strip() and not ln.strip().startswith("logs:")]
    if not lines:
        return ""
    errors = [ln for ln in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b.*:", ln)]
    text = errors[-1] if errors else lines[0]
    return text if len(text) <= width else text[: width - 1] + "…"


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def to_markdown(rows: Sequence[Dict[str, Any]], gpu: Optional[str] = None) -> str:
    head = [
        "rank",
        "point",
        "overrides",
        "job id",
        "status",
        "step time median (ms)",
        "tokens/s",
        "samples/s",
        "TFLOP/s per device",
        "peak memory per rank (MiB, measured)",
        f"predicted memory (MiB, {gpu or 'planner'})",
        "memory error",
        "predicted step (ms)",
        "step error",
        "bubble",
        "measured bubble",
        "reason",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        cells = [
            _cell(r["rank"]) or "-",
            str(r["point"]),
            f"`{r['overrides']}`" if r["overrides"] else "",
            _cell(r["job_id"]) or "-",
            r["status"],
            _fmt(r["step_time_median_s"] * 1000 if r["step_time_median_s"] is not None else None, ".1f"),
            _fmt(r["tokens_per_s"], ",.0f"),
            _fmt(r["samples_per_s"], ".2f"),
            _fmt(r["tflops_per_device"], ".3g"),
            _fmt(r["peak_rss_mib"], ",.0f"),
            _fmt(r["predicted_mib"], ",.0f"),
            _fmt(r["memory_error_pct"], "+.1f"),
            _fmt(r["predicted_step_time_s"] * 1000 if r["predicted_step_time_s"] is not None else None, ".1f"),
            _fmt(r["step_time_error_pct"], "+.0f"),
            _fmt(r["bubble_fraction"], ".1%"),
            _fmt(r["measured_bubble_fraction"], ".1%"),
            short_reason(r["reason"]),
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def format_report(sweep_dir: Path, rows: Sequence[Dict[str, Any]], swept: Sequence[str]) -> str:
    """The ranked table as printed at the end of a sweep (and by ``summarize``)."""
    gpus = sorted({r["gpu"] for r in rows if r.get("gpu")})
    counts: Dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    lines = [
        f"[sweep] {len(rows)} point(s) in {sweep_dir}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
        "[sweep] ranked by measured tokens/s:",
        to_markdown(rows, ", ".join(gpus) or None).rstrip(),
    ]
    best = min((r for r in rows if r["rank"] and r["status"] == "completed"), key=lambda r: r["rank"], default=None)
    if best is not None:
        lines.append(
            f"[sweep] fastest: point {best['point']} ({best['overrides']}): "
            f"{best['tokens_per_s']:,.0f} tokens/s, median step {best['step_time_median_s'] * 1000:.1f} ms"
        )
    lines.append(f"[sweep] table: {sweep_dir / SUMMARY_CSV}, {sweep_dir / SUMMARY_MD}; plot: {sweep_dir / SUMMARY_PNG}")
    return "\n".join(lines)
