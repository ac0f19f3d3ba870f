"""A goodput account said and drawn: ``status --goodput RUN`` (the table), the job's end line, and
``status --timeline RUN out.png`` (one row per attempt, time on x, each cause coloured, failures marked)."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Union

from orchestrator.ckpt.goodput import CAUSES, PRODUCTIVE, Account

COLOURS: Dict[str, str] = {
    PRODUCTIVE: "#2ca02c",
    "queued": "#c7c7c7",
    "start-up": "#9edae5",
    "data preparation": "#17becf",
    "checkpoint load": "#1f77b4",
    "save blocking": "#ff7f0e",
    "evaluation": "#bcbd22",
    "lost work": "#d62728",
    "failure detection and restart": "#9467bd",
    "hang timeout": "#8c564b",
    "stopped": "#f7f7f7",
    "shutdown": "#aec7e8",
}
"""One colour per cause (training green, lost work red, saving orange, loading blue, down grey/purple)."""


def duration(seconds: float) -> str:
    """``3d 4h``, ``2h 05m``, ``12m 30s``, ``4.2 s``."""
    s = float(seconds)
    if s >= 86400:
        return f"{int(s // 86400)}d {int(s % 86400 // 3600)}h"
    if s >= 3600:
        return f"{int(s // 3600)}h {int(s % 3600 // 60):02d}m"
    if s >= 60:
        return f"{int(s // 60)}m {int(s % 60):02d}s"
    return f"{s:.1f} s"


def one_line(acc: Account) -> str:
    """``goodput: ETTR 87.3% of 2h 05m wall (2 attempts, 1 failure); the rest: lost work 4.1%, ...`` (the three
    largest other causes)."""
    if acc.ettr is None:
        return "goodput: nothing ran yet"
    rest = sorted(((v, c) for c, v in acc.seconds.items() if c != PRODUCTIVE and v > 0), reverse=True)[:3]
    parts = ", ".join(f"{c} {100 * v / acc.wall_s:.1f}%" for v, c in rest)
    n_f = len(acc.failures)
    return (
        f"goodput: ETTR {100 * acc.ettr:.1f}% of {duration(acc.wall_s)} wall ({acc.attempts} attempt"
        f"{'s' if acc.attempts != 1 else ''}, {n_f} failure{'s' if n_f != 1 else ''})"
        + (f"; the rest: {parts}" if parts else "")
    )


def table(acc: Account, run_dir: Union[str, Path]) -> str:
    """The whole account: wall, ETTR, each cause's seconds and share (they sum to the wall), iterations kept and
    lost, and the failures with their causes."""
    state = "live, to now" if acc.live else "ended"
    lines = [
        f"{run_dir}: wall {duration(acc.wall_s)} from the first submission ({state}); {acc.attempts} attempt(s)",
        f"ETTR {100 * (acc.ettr or 0.0):.1f}%  (productive time / wall; Kokolis et al. 2024)",
        f"{'cause':<32}{'time':>12}{'share':>9}",
    ]
    for cause in CAUSES:
        v = acc.seconds.get(cause, 0.0)
        if v > 0 or cause == PRODUCTIVE:
            lines.append(f"{cause:<32}{duration(v):>12}{100 * v / max(acc.wall_s, 1e-9):>8.1f}%")
    total = sum(acc.seconds.values())
    lines.append(f"{'total':<32}{duration(total):>12}{100 * total / max(acc.wall_s, 1e-9):>8.1f}%")
    lines.append(f"iterations kept {acc.kept_iterations}, run again or lost {acc.lost_iterations}")
    for f in acc.failures:
        lines.append(f"failure at +{duration(f.time - acc.t0)} ({f.attempt}): {f.cause} {f.message[:100]}".rstrip())
    return "\n".join(lines)


def draw_timeline(acc: Account, path: Union[str, Path], title: str = "") -> Path:
    """The run's timeline as a PNG: one row per attempt (job id, attempt, in-place restart), hours since the first
    submission on x, each stretch coloured by its cause, failures marked with their cause. Raises OSError when
    ``path`` cannot be written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows: List[str] = []
    for s in acc.segments:
        if s.attempt not in rows:
            rows.append(s.attempt)
    scale, unit = (3600.0, "hours") if acc.wall_s > 7200 else (60.0, "minutes") if acc.wall_s > 120 else (1.0, "s")
    fig, ax = plt.subplots(figsize=(13, 1.6 + 0.45 * len(rows)))
    for s in acc.segments:
        y = rows.index(s.attempt)
        ax.broken_barh([((s.start - acc.t0) / scale, s.seconds / scale)], (y - 0.4, 0.8), color=COLOURS[s.cause])
    for f in acc.failures:
        y = rows.index(f.attempt) if f.attempt in rows else 0
        ax.plot([(f.time - acc.t0) / scale], [y], marker="x", color="black", markersize=9)
        ax.annotate(f.cause, ((f.time - acc.t0) / scale, y + 0.42), fontsize=7, ha="center")
    ax.set_yticks(range(len(rows)), [r or "-" for r in rows])
    ax.set_ylim(-0.6, len(rows) - 0.2)
    ax.set_ylabel("job.attempt")
    ax.set_xlabel(f"{unit} since the first submission")
    used = [c for c in CAUSES if acc.seconds.get(c, 0.0) > 0]
    handles = [Patch(color=COLOURS[c], label=f"{c} {100 * acc.seconds[c] / max(acc.wall_s, 1e-9):.1f}%") for c in used]
    ax.legend(handles=handles, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(title or f"ETTR {100 * (acc.ettr or 0):.1f}% of {duration(acc.wall_s)}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
