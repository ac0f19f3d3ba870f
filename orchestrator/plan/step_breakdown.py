"""A step's time by category per pipeline stage, from every rank's section totals: the numbers the
training loop's breakdown (:mod:`orchestrator.runtime.training.breakdown`) records, and their one-line form
(the job's log, the launcher's last lines, ``status --detail``). Pure Python (no torch)."""

from __future__ import annotations

from typing import Dict, List, Optional

CATEGORIES = ("compute", "bubble", "dp_comm", "optimizer", "data", "sync", "cpu_wait")
"""Measured categories, in record order; ``other`` is the step time less their sum."""
LABELS = {
    "compute": "compute",
    "bubble": "pipeline bubble",
    "dp_comm": "DP comm",
    "optimizer": "optimizer",
    "data": "data",
    "sync": "loop sync",
    "cpu_wait": "CPU wait",
    "other": "other",
}


def per_stage(rows: List[List[float]], mfu: Optional[Dict[str, object]] = None) -> Dict[str, object]:
    """Per stage, from every rank's [stage, iterations, step seconds, seconds per :data:`CATEGORIES`]: the
    mean step (s) and the mean over its ranks of each category's share of the step (``other``: 1 less their
    sum), and ``mfu`` on a GPU (``mfu``: {"stage_flops": per-GPU model FLOPs per step per stage, "peak"})."""
    stages: Dict[int, List[List[float]]] = {}
    for row in rows:
        if row[1] > 0 and row[2] > 0:
            stages.setdefault(int(row[0]), []).append(row)
    out = []
    for stage in sorted(stages):
        shares = [{c: row[3 + i] / row[2] for i, c in enumerate(CATEGORIES)} for row in stages[stage]]
        mean = {c: sum(s[c] for s in shares) / len(shares) for c in CATEGORIES}
        step = sum(row[2] / row[1] for row in stages[stage]) / len(stages[stage])
        rec: Dict[str, object] = {
            "stage": stage,
            "ranks": len(shares),
            "step_s": step,
            **mean,
            "other": 1.0 - sum(mean.values()),
        }
        rec["mfu"] = (
            mfu["stage_flops"][stage] / (step * mfu["peak"])  # type: ignore[index]
            if mfu and stage < len(mfu["stage_flops"])
            else None
        )  # type: ignore[arg-type]
        out.append(rec)
    return {"stages": out}


def percent(share: float, digits: int = 0) -> str:
    """``share`` (a fraction) as a percentage with ``digits`` decimals; a share that rounds to zero is ``0%``,
    never ``-0%`` (``other`` is 1 less the measured sum, a hair below zero when they fill the step)."""
    text = f"{share:.{digits}%}"
    return text[1:] if text.startswith("-") and float(text[1:-1]) == 0 else text


def describe(result: Dict[str, object], what: str) -> str:
    """One line: ``what``, then per stage its step and each category's share (and MFU on a GPU)."""
    parts = []
    for s in result["stages"]:  # type: ignore[union-attr]
        shares = " ".join(f"{LABELS[c]} {percent(s[c])}" for c in (*CATEGORIES, "other"))
        mfu = f" MFU {s['mfu']:.1%}" if s.get("mfu") is not None else ""
        parts.append(f"stage {s['stage']} ({1e3 * s['step_s']:.1f} ms/step): {shares}{mfu}")
    return f"step breakdown {what}: " + "; ".join(parts)
