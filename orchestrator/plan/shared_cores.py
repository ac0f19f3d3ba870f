"""Ranks that share a host's cores: the step time of megatron-core's pipeline order (:func:`~orchestrator.plan.pipeline_schedule.stage_order`)
when more ranks than cores time-share them (processor sharing), priced by :class:`~orchestrator.plan.step_terms.StepTerms`.
"""

from __future__ import annotations

from typing import Optional

from orchestrator.plan.pipeline_schedule import BACKWARD, FORWARD, stage_order


def shared_core_stretch(
    pp: int,
    num_microbatches: int,
    vpp: int,
    replicas: int,
    cores: int,
    backward_ratio: float = 2.0,
    group: Optional[int] = None,
) -> float:
    """Step time / one rank's own work when ``replicas`` x ``pp`` ranks share ``cores`` cores.

    Each of ``replicas`` identical pipelines (the TP x DP ranks of a stage do the same work) runs
    megatron-core's order (:func:`stage_order`) on its stages: a forward of a whole stage costs 1
    core-second per micro-batch (1/v a chunk), a backward ``backward_ratio``; a step waits for its input
    as in :func:`predict` (transfers free). The ranks whose next step is ready share the cores equally
    (processor sharing, each at most one core): with more ranks than cores and nothing waiting this is
    ranks / cores; the pipeline's fill and drain, when fewer ranks than cores can run, add to it
    (the bubble that the time-sharing does not hide). Dimensionless.
    """
    orders = [stage_order(pp, s, num_microbatches, vpp, group) for s in range(pp)]
    ranks = [(rep, s) for rep in range(replicas) for s in range(pp)]
    pos = {r: 0 for r in ranks}
    left = {r: None for r in ranks}  # type: Dict[Tuple[int, int], Optional[float]]
    done = set()  # (replica, kind, micro-batch, virtual stage)
    last_virtual, now = pp * vpp - 1, 0.0
    while True:
        running = []
        for rep, s in ranks:
            if pos[(rep, s)] >= len(orders[s]):
                continue
            kind, mb, chunk = orders[s][pos[(rep, s)]]
            j = chunk * pp + s
            dep = (
                ((FORWARD, mb, j - 1) if j > 0 else None)
                if kind == FORWARD
                else ((BACKWARD, mb, j + 1) if j < last_virtual else (FORWARD, mb, j))
            )
            if dep is None or (rep, *dep) in done:
                if left[(rep, s)] is None:
                    left[(rep, s)] = (1.0 if kind == FORWARD else backward_ratio) / vpp
                running.append((rep, s))
        if not running:
            if any(pos[r] < len(orders[r[1]]) for r in ranks):
                raise RuntimeError(f"schedule order deadlocks: pp={pp} m={num_microbatches} vpp={vpp}")
            break
        rate = min(1.0, cores / len(running))
        dt = min(left[r] for r in running) / rate  # type: ignore[type-var]
        now += dt
        for r in running:
            left[r] -= dt * rate  # type: ignore[operator]
            if left[r] <= 1e-12:  # type: ignore[operator]
                kind, mb, chunk = orders[r[1]][pos[r]]
                done.add((r[0], kind, mb, chunk * pp + r[1]))
                pos[r], left[r] = pos[r] + 1, None
    return now / (num_microbatches * (1.0 + backward_ratio))
