"""The pipeline schedule megatron-core runs, predicted: which forward and backward step each stage runs
when, and the idle time (bubble) that leaves.

Pure Python (no torch). :func:`stage_order` is megatron-core's own order of steps on one pipeline rank,
read from ``megatron/core/pipeline_parallel/schedules.py`` (0.16.1):

* no pipelining (PP = 1): F0 B0 F1 B1 ... (``forward_backward_no_pipelining``);
* 1F1B (``forward_backward_pipelining_without_interleaving``): rank r runs ``min(PP - r - 1, m)``
  warm-up forwards, then alternates one forward and one backward (steady state), then the remaining
  backwards (cool-down);
* interleaved 1F1B (``forward_backward_pipelining_with_interleaving``): ``v`` model chunks per rank,
  ``m x v`` virtual micro-batches in the order of megatron's ``get_schedule_table``: micro-batches in
  groups of ``microbatch_group_size_per_vp_stage`` (default PP), each group through chunk 0, then
  chunk 1, ...; warm-up ``(PP - r - 1) x 2 + (v - 1) x group`` forwards (capped at ``m x v``), then
  forward k + warm-up alongside backward k, then the rest of the backwards. Backward k runs chunk
  ``v - 1 - chunk(k)`` on micro-batch ``microbatch(k)`` of the same table.

:func:`predict` times that order with a dataflow model: a forward on virtual stage j waits for the
same micro-batch's forward on virtual stage j - 1 (plus one point-to-point transfer), a backward on
j for the backward on j + 1; a stage runs its steps one at a time in megatron's order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

FORWARD, BACKWARD = "F", "B"
Order = List[Tuple[str, int, int]]
"""(kind, micro-batch, model chunk) in the order a stage runs them."""


def schedule_name(pp: int, vpp: int) -> str:
    return "no pipelining" if pp == 1 else ("interleaved 1F1B" if vpp > 1 else "1F1B")


def schedule_table(num_microbatches: int, vpp: int, group: int) -> List[Tuple[int, int]]:
    """Megatron's (micro-batch, chunk) per virtual micro-batch id: groups of ``group`` micro-batches,
    each through every chunk in turn (the last group takes what remains)."""
    table: List[Tuple[int, int]] = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table += [(mb, chunk) for chunk in range(vpp) for mb in range(first, last)]
        if last == num_microbatches:
            break
    return table


def warmup_count(pp: int, stage: int, num_microbatches: int, vpp: int = 1, group: Optional[int] = None) -> int:
    """Forwards stage ``stage`` runs before its first backward (megatron's ``num_warmup_microbatches``)."""
    if pp == 1:
        return 0
    if vpp == 1:
        return min(pp - stage - 1, num_microbatches)
    count = (pp - stage - 1) * 2 + (vpp - 1) * (group or pp)
    return min(count, num_microbatches * vpp)


def stage_order(pp: int, stage: int, num_microbatches: int, vpp: int = 1, group: Optional[int] = None) -> Order:
    """The steps of one training iteration on pipeline rank ``stage``, in megatron-core's order."""
    m = num_microbatches
    if pp == 1:
        return [step for mb in range(m) for step in ((FORWARD, mb, 0), (BACKWARD, mb, 0))]
    table = schedule_table(m, vpp, group or pp) if vpp > 1 else [(mb, 0) for mb in range(m)]
    total = len(table)
    warmup = warmup_count(pp, stage, m, vpp, group)

    def fwd(k: int) -> Tuple[str, int, int]:
        return FORWARD, table[k][0], table[k][1]

    def bwd(k: int) -> Tuple[str, int, int]:
        return BACKWARD, table[k][0], vpp - 1 - table[k][1]

    order = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [fwd(k + warmup), bwd(k)]
    order += [bwd(k) for k in range(total - warmup, total)]
    return order


@dataclass(frozen=True)
class Step:
    """One forward or backward of one micro-batch through one model chunk on one pipeline stage."""

    stage: int
    microbatch: int
    chunk: int
    kind: str
    """"F" (forward) or "B" (backward)."""
    start: float
    end: float

    @property
    def label(self) -> str:
        return f"{self.microbatch}" if self.chunk == 0 else f"{self.microbatch}.{self.chunk}"


@dataclass
class Schedule:
    """A schedule of one iteration: its steps with times (seconds, or relative units), per stage."""

    pp: int
    vpp: int
    num_microbatches: int
    steps: List[Step]
    source: str = "predicted"
    """"predicted" (:func:`predict`) or "measured" (a traced run)."""
    span: Optional[Tuple[float, float]] = None
    """The iteration's window (start, end); None: first start to last end of the steps."""
    extra: Dict[str, object] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return schedule_name(self.pp, self.vpp)

    @property
    def window(self) -> Tuple[float, float]:
        if self.span is not None:
            return self.span
        return min(s.start for s in self.steps), max(s.end for s in self.steps)

    def on(self, stage: int) -> List[Step]:
        return sorted((s for s in self.steps if s.stage == stage), key=lambda s: s.start)

    def order(self, stage: int) -> Order:
        return [(s.kind, s.microbatch, s.chunk) for s in self.on(stage)]

    def busy(self, stage: int) -> float:
        return sum(s.end - s.start for s in self.steps if s.stage == stage)

    def idle_share(self) -> List[float]:
        """Per stage: idle time / the iteration's window (the measured 'fraction')."""
        lo, hi = self.window
        return [max(0.0, 1.0 - self.busy(r) / (hi - lo)) for r in range(self.pp)]

    def bubble_overhead(self) -> List[float]:
        """Per stage: idle time / busy time, the measured counterpart of (p-1)/(v m)."""
        lo, hi = self.window
        return [((hi - lo) - b) / b if b > 0 else 0.0 for b in (self.busy(r) for r in range(self.pp))]

    def formula(self) -> Tuple[float, float]:
        """(p-1)/(v m) and (p-1)/(v m + p-1), as :func:`orchestrator.plan.cost.bubble` computes them."""
        from orchestrator.plan.cost import bubble

        return bubble(self.pp, self.num_microbatches, self.vpp)


def predict(
    pp: int,
    num_microbatches: int,
    vpp: int = 1,
    forward: Sequence[float] = (1.0,),
    backward_ratio: float = 2.0,
    comm: float = 0.0,
    group: Optional[int] = None,
    backward: Optional[Sequence[float]] = None,
    gap: Sequence[float] = (0.0,),
) -> Schedule:
    """The schedule megatron-core runs, timed by the dataflow model of the module docstring.

    ``forward``: time of one micro-batch's forward through one whole stage (all its chunks), one value
    for every stage or one per stage; a chunk takes 1/v of it. ``backward_ratio``: backward / forward
    (2; 3 with full recomputation), unless ``backward`` gives the backward times as ``forward`` does.
    ``comm``: one point-to-point transfer between stages. ``gap``: what a stage spends after each step
    before it can start the next (its send/recv calls and the schedule's own code), one value or one per stage.
    """
    fwd = list(forward) if len(forward) == pp else [forward[0]] * pp
    bwd = (
        [f * backward_ratio for f in fwd]
        if backward is None
        else (list(backward) if len(backward) == pp else [backward[0]] * pp)
    )
    gaps = list(gap) if len(gap) == pp else [gap[0]] * pp
    orders = [stage_order(pp, r, num_microbatches, vpp, group) for r in range(pp)]
    last_virtual = pp * vpp - 1
    done: Dict[Tuple[str, int, int], float] = {}  # (kind, micro-batch, virtual stage) -> end
    free, pos, steps = [0.0] * pp, [0] * pp, []
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, mb, chunk = orders[r][pos[r]]
                j = chunk * pp + r
                if kind == FORWARD:
                    dep = (FORWARD, mb, j - 1) if j > 0 else None
                else:
                    dep = (BACKWARD, mb, j + 1) if j < last_virtual else (FORWARD, mb, j)
                if dep is not None and dep not in done:
                    break
                # a dependency on another virtual stage (always another rank) waits for one transfer
                ready = 0.0 if dep is None else done[dep] + (comm if dep[2] != j else 0.0)
                start = max(free[r], ready)
                cost = (fwd[r] if kind == FORWARD else bwd[r]) / vpp
                steps.append(Step(r, mb, chunk, kind, start, start + cost))
                done[(kind, mb, j)] = start + cost
                free[r] = start + cost + gaps[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"schedule order deadlocks: pp={pp} m={num_microbatches} vpp={vpp}")
    return Schedule(pp, vpp, num_microbatches, steps)


def predict_for_plan(plan) -> Schedule:
    """:func:`predict` in seconds of ``plan``'s device (an :class:`orchestrator.plan.memory.Plan`): a stage's
    forward is a third of its busy time per micro-batch (a quarter with full recomputation, whose
    backward reruns the forward), one transfer is the PP communication time per message."""
    lay = plan.layout
    p, m, v = lay.pipeline_model_parallel_size, lay.num_microbatches, lay.vpp
    full = plan.recipe.recompute_granularity == "full"
    per_microbatch = (plan.compute_s + plan.tp_comm_s + plan.framework_s) / m
    forward = per_microbatch / (4.0 if full else 3.0)
    messages = 2 * m * v if p > 1 else 1
    return predict(
        p,
        m,
        v,
        forward=(forward,),
        backward_ratio=3.0 if full else 2.0,
        comm=plan.pp_comm_s / messages if p > 1 else 0.0,
    )


def measured_schedule(ranks: List[dict], pp: int, vpp: int, num_microbatches: int) -> Schedule:
    """A traced iteration (``schedule.json``'s ``ranks``: each rank's pp/dp/tp rank and events) as the
    :class:`Schedule` of data-parallel replica 0, tensor-parallel rank 0, in seconds since the ranks'
    barrier; its window is the longest ``forward_backward`` call of its stages, its send/recv calls go
    to ``extra["waits"]``."""
    steps, ends, waits = [], [], []
    for r in ranks:
        if r["dp_rank"] != 0 or r["tp_rank"] != 0:
            continue
        for e in r["events"]:
            if e["kind"] in (FORWARD, BACKWARD):
                steps.append(Step(r["pp_rank"], e["microbatch"], e["chunk"], e["kind"], e["start"], e["end"]))
            elif e["kind"] == "iteration":
                ends.append((e["start"], e["end"]))
            elif e["kind"] != "param-gather":  # a dispatch (runtime.training.trace), not a wait
                waits.append({"stage": r["pp_rank"], "kind": e["kind"], "start": e["start"], "end": e["end"]})
    span = (min(s for s, _ in ends), max(e for _, e in ends)) if ends else None
    return Schedule(pp, vpp, num_microbatches, steps, source="measured", span=span, extra={"waits": waits})


def mean_cost(schedule: Schedule, kind: str, stage: Optional[int] = None) -> float:
    """Mean duration of ``kind`` steps (on ``stage``, or all), 0.0 when there is none."""
    times = [s.end - s.start for s in schedule.steps if s.kind == kind and stage in (None, s.stage)]
    return sum(times) / len(times) if times else 0.0


def predict_like(measured: Schedule) -> Schedule:
    """The predicted schedule of a measured one's layout, timed with its own mean costs: each stage's
    mean forward (x v: a whole stage), the mean backward / forward ratio, free transfers."""
    f = mean_cost(measured, FORWARD)
    forward = [measured.vpp * (mean_cost(measured, FORWARD, r) or f) for r in range(measured.pp)]
    return predict(
        measured.pp,
        measured.num_microbatches,
        measured.vpp,
        forward=forward,
        backward_ratio=mean_cost(measured, BACKWARD) / f if f > 0 else 2.0,
    )


def _dependency(step: Step, pp: int, vpp: int) -> Optional[Tuple[str, int, int]]:
    """(kind, micro-batch, virtual stage) of the step on another stage that ``step`` waits for, or None."""
    j = step.chunk * pp + step.stage
    if step.kind == FORWARD:
        return (FORWARD, step.microbatch, j - 1) if j > 0 else None
    return (BACKWARD, step.microbatch, j + 1) if j < pp * vpp - 1 else None


def _mean(xs: List[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def measured_costs(measured: Schedule) -> Dict[str, object]:
    """What one traced iteration says each operation costs, in seconds: per stage the mean forward and
    backward of a micro-batch through the whole stage (the mean step x v), the ``gap`` after a step when
    the next one's input was already there (its send/recv calls and the schedule's code), and ``comm``: the
    time from a step's end on one stage to the start of the step it feeds on the next, over those the
    consumer waited for (its stage idle before the input came): one transfer. Means throughout, so the
    stage's busy time and its own overheads add up to the measured ones."""
    p, v = measured.pp, measured.vpp
    ends = {(s.kind, s.microbatch, s.chunk * p + s.stage): s.end for s in measured.steps}
    waits, gaps = [], [[] for _ in range(p)]  # type: List[float], List[List[float]]
    for r in range(p):
        steps = measured.on(r)
        for prev, step in zip([None] + steps[:-1], steps):
            dep = _dependency(step, p, v)
            ready = ends.get(dep) if dep is not None else None
            if ready is not None and (prev is None or ready > prev.end):
                waits.append(step.start - ready)  # idle until the input came: start - its producer's end
            elif prev is not None:
                gaps[r].append(step.start - prev.end)
    f_all = mean_cost(measured, FORWARD)
    return {
        "forward": [v * (mean_cost(measured, FORWARD, r) or f_all) for r in range(p)],
        "backward": [v * (mean_cost(measured, BACKWARD, r) or 2 * f_all) for r in range(p)],
        "gap": [max(0.0, _mean(g)) for g in gaps],
        "comm": max(0.0, _mean(waits)),
    }


def predict_measured(measured: Schedule) -> Schedule:
    """The schedule of a traced iteration's layout predicted from its own measured operations
    (:func:`measured_costs`): per-stage forward and backward, the gap after each step, one transfer
    between stages; bench/bubble.py compares its bubble with the measured one."""
    c = measured_costs(measured)
    return predict(
        measured.pp,
        measured.num_microbatches,
        measured.vpp,
        forward=c["forward"],  # type: ignore[arg-type]
        backward=c["backward"],
        comm=float(c["comm"]),
        gap=c["gap"],
    )  # type: ignore[arg-type]
