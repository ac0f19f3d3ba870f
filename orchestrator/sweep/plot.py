"""The sweep table's picture: ``summary.png`` (tokens/s and peak memory per rank against the swept value).

Rows are :func:`orchestrator.sweep.table.collect`'s; matplotlib is imported only here (the Agg backend,
no display needed).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from orchestrator.io import write_atomic


def _as_float(v: Any) -> Optional[float]:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def plot(rows: Sequence[Dict[str, Any]], swept: Sequence[str], path: Path, title: str = "") -> None:
    """PNG: tokens/s and peak memory per rank (measured, and the planner's prediction) against the
    first swept key; one line per combination of the other swept keys."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xkey = swept[0] if swept else "point"
    others = list(swept[1:])
    xs_raw = [r.get(xkey) if swept else r["point"] for r in sorted(rows, key=lambda r: r["point"])]
    numeric = all(_as_float(v) is not None for v in xs_raw) and bool(xs_raw)
    categories = list(dict.fromkeys(str(v) for v in xs_raw))

    def xpos(r: Dict[str, Any]) -> float:
        v = r.get(xkey) if swept else r["point"]
        return _as_float(v) if numeric else float(categories.index(str(v)))

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in others), []).append(r)
    for key, members in groups.items():
        label = " ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in zip(others, key)) or None
        color = None
        got = sorted((r for r in members if r["tokens_per_s"] is not None), key=xpos)
        if got:
            line = ax_t.plot([xpos(r) for r in got], [r["tokens_per_s"] for r in got], marker="o", label=label)[0]
            color = line.get_color()
            mem = [r for r in got if r["peak_rss_mib"] is not None]
            ax_m.plot(
                [xpos(r) for r in mem],
                [r["peak_rss_mib"] for r in mem],
                marker="o",
                color=color,
                label=f"measured peak RSS {label or ''}".strip(),
            )
        pred = sorted((r for r in members if r["predicted_mib"] is not None), key=xpos)
        if pred:
            ax_m.plot(
                [xpos(r) for r in pred],
                [r["predicted_mib"] for r in pred],
                linestyle="--",
                marker="s",
                alpha=0.7,
                color=color,
                label=f"predicted ({pred[0].get('gpu')}) {label or ''}".strip(),
            )
        for r in members:
            if r["tokens_per_s"] is None:
                ax_t.scatter([xpos(r)], [0], marker="x", color="red")
                ax_t.annotate(
                    r["status"],
                    (xpos(r), 0),
                    textcoords="offset points",
                    xytext=(3, 6),
                    fontsize=7,
                    rotation=45,
                    color="red",
                )
    _format_axes((ax_t, ax_m), xkey, numeric, categories, xs_raw)
    speeds = [r["tokens_per_s"] for r in rows if r["tokens_per_s"] is not None]
    if speeds:
        ax_t.set_ylim(0, 1.1 * max(speeds))
    n_meas = sum(1 for r in rows if r["tokens_per_s"] is not None)
    fig.suptitle(f"{title} -- {n_meas} of {len(rows)} points measured".strip(" -"))
    import warnings

    with warnings.catch_warnings():  # long category labels: a cramped layout is still a plot
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def _format_axes(axes: Tuple[Any, Any], xkey: str, numeric: bool, categories: List[str], xs_raw: List[Any]) -> None:
    """Labels, grid, x ticks (categories, or the swept values; a log-2 axis for 1, 2, 4, 8) and legends."""
    ax_t, ax_m = axes
    for ax, ylabel in ((ax_t, "tokens/s (median step after warm-up)"), (ax_m, "peak memory per rank, MiB")):
        ax.set_xlabel(xkey)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if not numeric:
            ax.set_xticks(range(len(categories)), categories, rotation=20)
        else:
            ticks = sorted({_as_float(v) for v in xs_raw})
            if len(ticks) > 2 and all(t > 0 and t.is_integer() and (int(t) & (int(t) - 1)) == 0 for t in ticks):
                ax.set_xscale("log", base=2)  # 1, 2, 4, 8: evenly spaced
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
