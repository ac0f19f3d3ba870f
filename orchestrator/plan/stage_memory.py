"""Memory per GPU of each pipeline stage: weights, gradients, optimizer state (sharded over DP with the distributed
optimizer: Megatron-LM's 6 + 12/DP bytes per parameter), activations at the stage's peak, the framework's overhead,
FP8's weight copies and amax buffers (:mod:`orchestrator.plan.fp8`);
scaled by a calibrated device profile when there is one. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

from orchestrator.config.layout import ParallelLayout
from orchestrator.plan.activations import stage_activations
from orchestrator.plan.fp8 import layer_fp8_bytes
from orchestrator.plan.inputs import FRAMEWORK_OVERHEAD_BYTES, ModelShape, Recipe
from orchestrator.plan.profile import DeviceProfile


def stage_memories(
    shape: ModelShape,
    layout: ParallelLayout,
    recipe: Recipe,
    vp: int,
    per_stage: List[tuple],
    profile: Optional[DeviceProfile],
) -> List["StageMemory"]:
    """One :class:`StageMemory` per pipeline stage, bytes per GPU. ``per_stage``: (params, dense, expert, count) of
    each stage (:func:`orchestrator.plan.params.stage_params`); ``vp``: the padded vocabulary."""
    t, p = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    dp, ep = layout.data_parallel_size, layout.expert_model_parallel_size
    edp = max(1, layout.world_size // (t * ep * p))
    ob = recipe.optimizer_bytes
    stages = []
    for r, (_, dense, expert, count) in enumerate(per_stage):
        act, flight = stage_activations(shape, layout, recipe, r, vp, recipe.recompute_granularity)
        unsharded, sharded = count * ob, dense * ob / dp + expert * ob / edp
        stages.append(
            StageMemory(
                stage=r,
                params=count,
                weights=count * recipe.param_bytes,
                gradients=count * recipe.grad_bytes,
                optimizer=sharded if recipe.use_distributed_optimizer else unsharded,
                optimizer_unsharded=unsharded,
                optimizer_sharded=sharded,
                activations=act,
                in_flight=flight,
                overhead=FRAMEWORK_OVERHEAD_BYTES,
                fp8=layout.layers_per_stage * layer_fp8_bytes(shape, layout, recipe),
            )
        )
    if profile is not None:  # calibrated memory: overhead + factors x the planner's terms
        sf, af = profile.states_factor, profile.activation_factor
        stages = [
            replace(
                st,
                weights=sf * st.weights,
                gradients=sf * st.gradients,
                optimizer=sf * st.optimizer,
                optimizer_unsharded=sf * st.optimizer_unsharded,
                optimizer_sharded=sf * st.optimizer_sharded,
                activations=af * st.activations,
                overhead=profile.memory_overhead_bytes,
            )
            for st in stages
        ]
    return stages


@dataclass(frozen=True)
class StageMemory:
    """Memory of one GPU of one pipeline stage, in bytes."""

    stage: int
    params: int
    """Parameters held by this GPU (after TP and EP sharding)."""
    weights: float
    gradients: float
    optimizer: float
    optimizer_unsharded: float
    optimizer_sharded: float
    activations: float
    in_flight: int
    """Micro-batch chunks whose activations are alive at this stage's peak."""
    overhead: float
    fp8: float = 0.0
    """``training.fp8``: FP8 weight copies and amax buffers of the stage's layers (:mod:`orchestrator.plan.fp8`)."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.overhead + self.fp8
