"""Pictures of a pipeline: the schedule as a Gantt chart and the memory per stage as stacked bars.

matplotlib (Agg) is imported when drawing, never at import, so ``plan=true`` stays torch-free and
imports matplotlib only when ``plan_picture=`` asks for a file. Colours are Okabe–Ito's colour-blind-safe
palette; blocks carry their micro-batch (and chunk) as text when it fits, idle time is the hatched grey
under them.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

from orchestrator.plan.pipeline_schedule import FORWARD, Schedule

# Okabe & Ito (2008): forward blue / sky blue, backward vermillion / orange, per chunk parity
_FORWARD = ("#0072B2", "#56B4E9")
_BACKWARD = ("#D55E00", "#E69F00")
_TEXT = {"#0072B2": "white", "#56B4E9": "black", "#D55E00": "white", "#E69F00": "black"}
_IDLE = "#E8E8E8"
_MEMORY = (
    ("weights", "#0072B2"),
    ("gradients", "#56B4E9"),
    ("optimizer state", "#009E73"),
    ("activations", "#E69F00"),
    ("overhead", "#999999"),
)


def _figure(width: float, height: float):
    """A matplotlib Figure on the Agg canvas, without pyplot (no global figure state, a lighter import)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def bubble_title(s: Schedule) -> str:
    """``PP4, m=8, v=2 (interleaved 1F1B): bubble (p-1)/(v·m) = 3/(2·8) = 18.8%``."""
    overhead, fraction = s.formula()
    return (
        f"PP{s.pp}, m={s.num_microbatches}, v={s.vpp} ({s.name}): bubble (p-1)/(v·m) = "
        f"{s.pp - 1}/({s.vpp}·{s.num_microbatches}) = {overhead:.1%} of ideal, {fraction:.1%} of the step"
    )


def _label(step, width_pt: float, vpp: int, fontsize: float) -> str:
    """The longest label that fits ``width_pt``: "3 c1", "3", or nothing."""
    for text in ((f"{step.microbatch} c{step.chunk}",) if vpp > 1 else ()) + (f"{step.microbatch}",):
        if len(text) * fontsize * 0.62 + 2 <= width_pt:
            return text
    return ""


def draw_gantt(
    ax, schedule: Schedule, title: str, unit: str = "ms", scale: float = 1e3, axis_span: Optional[float] = None
) -> None:
    """One row per pipeline rank (rank 0 on top), forward and backward blocks, idle hatched; the time
    axis runs to ``axis_span`` (default: this schedule's window) so schedules drawn together compare."""
    lo, hi = schedule.window
    span = (hi - lo) * scale
    axis_span = max(axis_span or span, span)
    fig = ax.figure
    width_in = ax.get_position().width * fig.get_figwidth()
    pt_per_unit = width_in * 72 / axis_span if axis_span > 0 else 0.0
    fontsize = 7.5
    for r in range(schedule.pp):  # one collection per row (hundreds of patches draw slowly)
        y = schedule.pp - 1 - r
        ax.broken_barh([(0, span)], (y - 0.4, 0.8), facecolors=_IDLE, hatch="///", edgecolor="#BBBBBB", linewidth=0)
        steps = schedule.on(r)
        colours = [(_FORWARD if st.kind == FORWARD else _BACKWARD)[st.chunk % 2] for st in steps]
        ax.broken_barh(
            [((st.start - lo) * scale, (st.end - st.start) * scale) for st in steps],
            (y - 0.4, 0.8),
            facecolors=colours,
            edgecolor="white",
            linewidth=0.6 if steps and pt_per_unit * span / len(steps) > 6 else 0.0,
        )  # dense: no seams
        for st, colour in zip(steps, colours):
            x, w = (st.start - lo) * scale, (st.end - st.start) * scale
            text = _label(st, w * pt_per_unit, schedule.vpp, fontsize)
            if text:
                ax.text(x + w / 2, y, text, ha="center", va="center", fontsize=fontsize, color=_TEXT[colour])
    waits: Dict[int, list] = {}
    for wait in schedule.extra.get("waits", []):  # type: ignore[union-attr]
        waits.setdefault(schedule.pp - 1 - int(wait["stage"]), []).append(
            ((wait["start"] - lo) * scale, (wait["end"] - wait["start"]) * scale)
        )
    for y, ranges in waits.items():
        ax.broken_barh(ranges, (y - 0.49, 0.08), facecolors="black", linewidth=0)
    idle = schedule.idle_share()
    ax.set_yticks(range(schedule.pp))
    ax.set_yticklabels([f"rank {r}\nidle {idle[r]:.0%}" for r in reversed(range(schedule.pp))], fontsize=8.5)
    ax.set_xlim(0, axis_span)
    ax.set_ylim(-0.6, schedule.pp - 0.4)
    ax.set_xlabel(f"time ({unit})" if unit else "time (forward of one stage = 1)", fontsize=9)
    ax.set_title(title, fontsize=10, loc="left")
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _legend(ax, vpp: int, waits: bool) -> None:
    """The block colours, under ``ax`` (below its axis label)."""
    from matplotlib.patches import Patch

    def which(c: int) -> str:  # colours alternate with the chunk: 0, 2, ... and 1, 3, ...
        members = list(range(c, vpp, 2))
        if vpp == 1:
            return ""
        if len(members) == 1:
            return f", chunk {c}"
        return ", chunks " + ", ".join(map(str, members[:2])) + (", …" if len(members) > 2 else "")

    chunks = range(min(vpp, 2))
    handles = [Patch(color=_FORWARD[c], label=f"forward{which(c)}") for c in chunks]
    handles += [Patch(color=_BACKWARD[c], label=f"backward{which(c)}") for c in chunks]
    handles.append(Patch(facecolor=_IDLE, hatch="///", edgecolor="#BBBBBB", label="idle (bubble)"))
    if waits:
        handles.append(Patch(color="black", label="send/recv call"))
    ax.legend(
        handles=handles,
        loc="upper center",
        ncol=len(handles),
        fontsize=8.5,
        frameon=False,
        bbox_to_anchor=(0.5, -0.28 if ax.get_subplotspec().get_gridspec().nrows == 1 else -0.32),
    )


def draw_memory(ax, plan) -> None:
    """Stacked bars per stage (GiB) against the device's memory and the plan's headroom line (``plan_headroom``)."""
    gib = 2.0**30
    stages = plan.stages
    xs = list(range(len(stages)))
    bottom = [0.0] * len(stages)
    for (name, colour), attr in zip(_MEMORY, ("weights", "gradients", "optimizer", "activations", "overhead")):
        vals = [getattr(st, attr) / gib for st in stages]
        ax.bar(xs, vals, bottom=bottom, color=colour, label=name, width=0.6, edgecolor="white", linewidth=0.5)
        bottom = [b + v for b, v in zip(bottom, vals)]
    mem = plan.gpu.memory_bytes / gib
    ax.axhline(mem, color="black", linewidth=1.2, label=f"{plan.gpu.name}: {mem:.3g} GiB")
    ax.axhline(
        plan.headroom * mem,
        color="black",
        linewidth=1.0,
        linestyle="--",
        label=f"plan_headroom {plan.headroom:.0%} of it",
    )
    ax.set_ylim(0, max(max(bottom), mem) * 1.08)
    ax.set_xlim(-0.6, len(stages) - 0.4)
    ax.set_xticks(xs)
    ax.set_xticklabels([f"stage {r}" if len(xs) <= 4 else str(r) for r in xs], fontsize=8.5)
    if len(xs) > 4:
        ax.set_xlabel("pipeline stage", fontsize=9)
    ax.set_ylabel("GiB per GPU", fontsize=9)
    ax.set_title(f"memory per stage (peak {max(bottom):.3g} GiB)", fontsize=10, loc="left")
    ax.legend(
        fontsize=8,
        loc="upper center",
        frameon=False,
        ncol=2,
        bbox_to_anchor=(0.5, -0.12),
        handlelength=1.5,
        columnspacing=0.8,
    )
    ax.tick_params(axis="y", labelsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _save(fig, path: str) -> None:
    """The PNG, written atomically, straight from the canvas (one encode), into a directory that exists (no
    directory is made: config.checks refuses a plan_picture's missing one). Not palette-quantized: that maps a
    colour seen only in a legend onto a frequent neighbour."""
    from PIL import Image  # matplotlib's own dependency

    fig.canvas.draw()
    image = Image.frombuffer("RGBA", fig.canvas.get_width_height(), fig.canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    tmp = f"{path}.tmp"
    image.convert("RGB").save(tmp, format="PNG")
    os.replace(tmp, path)


def draw_plan(path: str, plan, schedule: Schedule) -> None:
    """``plan=true plan_picture=PATH``: the predicted schedule beside the memory per stage."""
    fig = _figure(13, 2.2 + 0.55 * max(schedule.pp, 4))
    gantt, memory = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3.2, 1]})
    fig.subplots_adjust(left=0.07, right=0.985, top=0.83, bottom=0.30, wspace=0.18)
    draw_gantt(gantt, schedule, f"predicted schedule, one iteration ({plan.gpu.name} device costs)")
    draw_memory(memory, plan)
    fig.suptitle(bubble_title(schedule), fontsize=11.5, x=0.07, ha="left")
    _legend(gantt, schedule.vpp, waits=False)
    _save(fig, path)


def draw_schedules(path: str, schedules: Sequence[Schedule], titles: List[str], suptitle: Optional[str] = None) -> None:
    """Schedules stacked one above the other on their own time axes (a traced run: predicted, measured)."""
    rows = sum(max(s.pp, 2) for s in schedules)
    height = 1.5 + 0.5 * rows + 0.7 * len(schedules)
    fig = _figure(12, height)
    axes = fig.subplots(len(schedules), 1, squeeze=False)
    fig.subplots_adjust(left=0.09, right=0.985, top=1 - 0.75 / height, bottom=1.0 / height, hspace=0.55)
    longest = max((s.window[1] - s.window[0]) * 1e3 for s in schedules)
    for ax, s, title in zip(axes[:, 0], schedules, titles):
        draw_gantt(ax, s, title, axis_span=longest)
    fig.suptitle(suptitle or bubble_title(schedules[0]), fontsize=11.5, x=0.09, ha="left")
    _legend(axes[-1, 0], schedules[0].vpp, waits=any(s.extra.get("waits") for s in schedules))
    _save(fig, path)
