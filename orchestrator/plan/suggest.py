"""Suggestions: the nearest valid layouts that fit, ranked by the planner's estimated step time.

Pure Python, like :mod:`orchestrator.planner`, whose :func:`~orchestrator.planner.plan_layout`
prices every candidate. Entry points: :func:`suggest` and :func:`format_suggestions`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from orchestrator.config.layout import ParallelLayout
from orchestrator.errors import ConfigError
from orchestrator.plan.memory import (
    DEFAULT_MFU,
    LARGE_BUBBLE,
    GiB,
    ModelShape,
    Plan,
    Recipe,
    device_for,
    gpus_per_node,
    layout_from_config,
    plan_layout,
    recipe_of,
    recipe_problems,
    vocab_size_of,
)
from orchestrator.text import table


@dataclass
class Suggestion:
    """A valid layout that fits, with the Hydra overrides that select it."""

    plan: Plan
    overrides: List[str]

    @property
    def changes(self) -> int:
        return len(self.overrides)


def _overrides(cfg, layout: ParallelLayout, recipe: Recipe) -> List[str]:
    def show(v):
        return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)

    p, m, o, t = cfg.parallelism, cfg.model, cfg.optimizer, cfg.training
    pairs = [
        ("parallelism.tensor_model_parallel_size", p.tensor_model_parallel_size, layout.tensor_model_parallel_size),
        (
            "parallelism.pipeline_model_parallel_size",
            p.pipeline_model_parallel_size,
            layout.pipeline_model_parallel_size,
        ),
        (
            "parallelism.virtual_pipeline_model_parallel_size",
            p.virtual_pipeline_model_parallel_size,
            layout.virtual_pipeline_model_parallel_size,
        ),
        ("parallelism.sequence_parallel", p.sequence_parallel, layout.sequence_parallel),
        ("parallelism.data_parallel_size", p.data_parallel_size, layout.stated_data_parallel_size),
        ("training.micro_batch_size", t.micro_batch_size, layout.micro_batch_size),
        ("model.recompute_granularity", m.recompute_granularity, recipe.recompute_granularity),
        ("model.recompute_method", m.recompute_method, recipe.recompute_method),
        ("model.recompute_num_layers", m.recompute_num_layers, recipe.recompute_num_layers),
        ("optimizer.use_distributed_optimizer", o.use_distributed_optimizer, recipe.use_distributed_optimizer),
    ]
    return [f"{key}={show(new)}" for key, old, new in pairs if old != new]


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    layout: ParallelLayout,
    recipe: Recipe,
    max_tp: int = 8,
    allow_distributed_optimizer: bool = True,
    state_dp: bool = False,
    allow_sequence_parallel: bool = True,
):
    """Valid (layout, recipe) pairs over the same world size, GBS, CP and EP.

    Varies TP (<= ``max_tp``, sequence parallel whenever TP > 1 and ``allow_sequence_parallel``: a CPU job has
    none, megatron-core's sequence parallel needs GPUs), PP, VPP (null or 2..8 chunks),
    MBS (powers of two and the current one), recomputation (none / selective / full uniform 1 /
    the current one) and the distributed optimizer. Each layout passes ``ParallelLayout.problems()``.
    DP stays stated (set to the derived value) when the config stated it or ``state_dp``.
    """
    state_dp = state_dp or layout.stated_data_parallel_size is not None
    world, cp = layout.world_size, layout.context_parallel_size
    mbs_options = sorted({1, 2, 4, 8, 16, 32, layout.micro_batch_size})
    recomputes = {
        (None, None, None),
        ("selective", None, None),
        ("full", "uniform", 1),
        (recipe.recompute_granularity, recipe.recompute_method, recipe.recompute_num_layers),
    }
    distopts = (
        {recipe.use_distributed_optimizer, True} if allow_distributed_optimizer else {recipe.use_distributed_optimizer}
    )
    kept = {recipe.use_distributed_optimizer}  # at DP 1 the distributed optimizer shards nothing: no change
    for tp in _divisors(world):
        if tp > max_tp or (world // tp) % cp:
            continue
        for pp in _divisors(world // (tp * cp)):
            if layout.num_layers % pp:
                continue
            vpps = [None] + [v for v in range(2, 9) if pp > 1 and layout.num_layers % (pp * v) == 0]
            for vpp in vpps:
                for mbs in mbs_options:
                    cand = replace(
                        layout,
                        tensor_model_parallel_size=tp,
                        pipeline_model_parallel_size=pp,
                        virtual_pipeline_model_parallel_size=vpp,
                        sequence_parallel=tp > 1 and allow_sequence_parallel,
                        micro_batch_size=mbs,
                        stated_data_parallel_size=None,
                    )
                    if state_dp:
                        cand = replace(cand, stated_data_parallel_size=cand.data_parallel_size)
                    if cand.problems():
                        continue
                    for g, method, n in recomputes:
                        for distopt in distopts if cand.data_parallel_size > 1 else kept:
                            rec = replace(
                                recipe,
                                recompute_granularity=g,
                                recompute_method=method,
                                recompute_num_layers=n,
                                use_distributed_optimizer=distopt,
                            )
                            if not recipe_problems(rec, cand):
                                yield cand, rec


def suggest(
    cfg,
    gpu: Optional[str] = None,
    limit: int = 5,
    vocab_size: Optional[int] = None,
    mfu: Optional[float] = None,
    always: bool = False,
) -> List[Suggestion]:
    """Up to ``limit`` nearby layouts that fit, fastest first (then fewest changes, least memory).

    Runs when the config is invalid, does not fit, is tight (above ``plan_headroom`` of the device's
    memory) or idles more than ``LARGE_BUBBLE`` of the step in the pipeline bubble (or ``always``);
    every suggestion fits within ``plan_headroom``; when the config already does, only faster layouts
    are returned. The distributed optimizer is proposed only where DP > 1 (at DP 1 it shards nothing). TP stays within a node (``cluster.gpus_per_node``, else 8); the distributed optimizer
    is not proposed for CPU runs either (megatron-core 0.16.1 rejects it there).
    """
    from orchestrator.errors import LayoutError

    layout = layout_from_config(cfg)
    device = device_for(cfg, layout.world_size, gpu)  # as plan() prices it (every candidate keeps the world size)
    if vocab_size is None:
        vocab_size, _ = vocab_size_of(cfg)
    mfu, node = mfu or DEFAULT_MFU, gpus_per_node(cfg)
    shape, recipe = ModelShape.from_model_config(cfg.model, vocab_size), recipe_of(cfg, on_gpu=device.on_gpu)
    on = dict(gpus_per_node=node, profile=device.profile, ranks_per_node=device.ranks_per_node)
    try:
        current: Optional[Plan] = replace(
            plan_layout(layout, shape, recipe, device.preset, mfu, **on), headroom=cfg.plan_headroom
        )
    except (LayoutError, ConfigError):
        current = None
    roomy = current is not None and current.fits and not current.tight
    needed = not roomy or current.bubble_fraction > LARGE_BUBBLE
    if not (needed or always):
        return []
    cpu = cfg.training.device == "cpu" or (cfg.cluster.kind == "local" and not cfg.cluster.gpus_per_node)
    found: Dict[Tuple[str, ...], Suggestion] = {}
    # cluster=local without tasks_per_node takes its world size from TP x PP x CP x DP: keep DP stated.
    local_world = cfg.cluster.kind == "local" and cfg.cluster.tasks_per_node is None
    for cand, rec in candidates(
        layout, recipe, node, allow_distributed_optimizer=not cpu, state_dp=local_world, allow_sequence_parallel=not cpu
    ):
        pl = replace(
            plan_layout(cand, shape, rec, device.preset, mfu, validate=False, **on), headroom=cfg.plan_headroom
        )
        if not pl.fits or pl.tight or (roomy and pl.step_time_s >= 0.99 * current.step_time_s):
            continue
        ov = _overrides(cfg, cand, rec)
        if ov:
            found.setdefault(tuple(ov), Suggestion(pl, ov))
    ranked = sorted(found.values(), key=lambda s: (round(s.plan.step_time_s, 9), s.changes, s.plan.peak_bytes))
    return ranked[:limit]


def format_suggestions(suggestions: Sequence[Suggestion]) -> str:
    """A table of suggestions, each with the Hydra overrides that select it."""
    if not suggestions:
        return "suggestions: none needed (the layout fits and its bubble is small) or none found"
    rows = []
    for i, s in enumerate(suggestions, 1):
        lay, rec, pl = s.plan.layout, s.plan.recipe, s.plan
        rows.append(
            (
                i,
                lay.tensor_model_parallel_size,
                lay.pipeline_model_parallel_size,
                lay.virtual_pipeline_model_parallel_size,
                lay.data_parallel_size,
                lay.micro_batch_size,
                rec.recompute_granularity,
                "yes" if rec.use_distributed_optimizer else "no",
                f"{pl.peak_bytes / GiB:.1f}",
                f"{pl.bubble_fraction:.1%}",
                f"{pl.step_time_s:.3g}",
                f"{pl.tokens_per_s:,.0f}",
            )
        )
    text = table(
        ["#", "TP", "PP", "VPP", "DP", "MBS", "recompute", "distopt", "mem GiB", "bubble", "step s", "tokens/s"],
        rows,
        title="suggestions (fastest first; each fits within plan_headroom):",
        right=range(12),
    )
    return text + "\n" + "\n".join(f"  #{i}: {' '.join(s.overrides)}" for i, s in enumerate(suggestions, 1))
