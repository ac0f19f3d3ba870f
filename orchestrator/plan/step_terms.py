"""What one optimizer step costs, in the units a device profile's constants price (:class:`StepTerms`:
FLOPs, bytes per link, messages, framework passes, the schedule's idle share); :meth:`StepTerms.seconds`
times them with a :class:`~orchestrator.plan.profile.DeviceProfile`. Formulas: :mod:`orchestrator.plan.profile`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.config.layout import ParallelLayout
from orchestrator.plan.cost import CommVolume, bubble, comm_volumes, flops_per_step
from orchestrator.plan.inputs import ModelShape, Recipe
from orchestrator.plan.shared_cores import shared_core_stretch


@dataclass(frozen=True)
class StepTerms:
    """Amounts of work of one optimizer step on the slowest GPU; :meth:`features` x constants = seconds."""

    flops: float
    """Hardware FLOPs of the slowest stage, per GPU."""
    tp: CommVolume
    pp: CommVolume
    dp: CommVolume
    layer_passes: float
    """Forward-equivalent layer passes: micro-batches x layers per stage x (3, +1 with full recompute)."""
    chunk_passes: float
    """Micro-batches x model chunks per stage."""
    bubble_overhead: float
    """(p-1)/(v m): the pipelined part is stretched by 1 + this (when the bubble idles)."""
    ranks_per_node: int = 1
    """Ranks on one host (node)."""
    flops_mean: float = 0.0
    """Hardware FLOPs of the mean stage, per GPU: what ranks time-sharing cores cost (0: ``flops``)."""
    schedule: Tuple[int, int, int, float, int] = (1, 1, 1, 2.0, 1)
    """(PP, micro-batches, VPP, backward / forward, ranks per stage = world / PP) for :meth:`stretch`."""

    def ranks_per_core(self, cores: int) -> float:
        """Ranks per core when more ranks than ``cores`` share a host, else 0 (each rank has its own device)."""
        return self.ranks_per_node / cores if cores and self.ranks_per_node > cores else 0.0

    def stretch(self, cores: int = 0) -> Tuple[float, float]:
        """(share, idle): a rank's pipelined work takes share x (1 + idle) x its own time, DP communication share x.

        One device per rank: (1, (p-1)/(v m)). Ranks sharing ``cores`` (CPU): share = ranks per core, and idle
        = what megatron's schedule leaves when fewer ranks than cores can run (its fill and drain), from
        :func:`~orchestrator.plan.pipeline_schedule.shared_core_stretch` when the job is on one host, else 0.
        """
        shared = self.ranks_per_core(cores)
        if not shared:
            return 1.0, self.bubble_overhead
        pp, m, vpp, ratio, per_stage = self.schedule
        if pp == 1 or pp * per_stage > self.ranks_per_node:
            return shared, 0.0
        return shared, _shared_stretch(pp, m, vpp, per_stage, cores, ratio) / shared - 1.0

    def stage_flops(self, cores: int = 0) -> float:
        """The FLOPs that set the pace: the slowest stage's with a device per rank, the mean stage's when ranks
        time-share cores (every rank's work then queues for the same cores)."""
        return (self.flops_mean or self.flops) if self.ranks_per_core(cores) else self.flops

    def features(self, cores: int = 0) -> List[float]:
        """Per :data:`TIME_CONSTANTS`: FLOPs, intra- and inter-node bytes, calls, layer passes, chunk passes, 1."""
        d, idle = self.stretch(cores)
        b = d * (1.0 + idle)  # pipelined work
        intra = inter = 0.0
        for vol, mult in ((self.tp, b), (self.pp, b), (self.dp, d)):
            if vol.intra_node:
                intra += mult * vol.bytes
            else:
                inter += mult * vol.bytes
        calls = b * (self.tp.calls + self.pp.calls) + d * self.dp.calls
        return [b * self.stage_flops(cores), intra, inter, calls, b * self.layer_passes, b * self.chunk_passes, 1.0]

    def seconds(self, profile: Any) -> Dict[str, float]:  # a plan.profile.DeviceProfile (profile imports this room)
        """compute, tp, pp, dp, framework and fixed seconds (not stretched by the bubble), and
        ``idle``: the bubble's share of the pipelined part (:meth:`stretch`)."""
        mult, idle = self.stretch(profile.cores)

        def comm(v: CommVolume) -> float:
            return mult * (v.bytes / profile.bandwidth(v.intra_node) + v.calls * profile.latency_s)

        return {
            "compute": mult * self.stage_flops(profile.cores) / profile.flops_per_s,
            "tp": comm(self.tp),
            "pp": comm(self.pp),
            "dp": comm(self.dp),
            "framework": mult * (self.layer_passes * profile.layer_pass_s + self.chunk_passes * profile.chunk_pass_s),
            "fixed": profile.step_s,
            "idle": idle,
        }


_shared_stretch = functools.lru_cache(maxsize=1024)(shared_core_stretch)
"""Every candidate is re-priced after each tune trial: simulate each schedule once."""


def step_terms(
    shape: ModelShape,
    layout: ParallelLayout,
    recipe: Recipe,
    vp: int,
    params_per_gpu: int,
    gpus_per_node: int = 8,
    ranks_per_node: Optional[int] = None,
) -> StepTerms:
    """The :class:`StepTerms` of one layout (``vp`` = padded vocabulary; ``ranks_per_node`` default:
    min(world size, ``gpus_per_node``))."""
    _, _, stage_flops = flops_per_step(shape, layout, recipe, vp)
    p, m = layout.pipeline_model_parallel_size, layout.num_microbatches
    tp, pp, dp = comm_volumes(shape, layout, recipe, params_per_gpu, gpus_per_node)
    per_layer = 3 + (1 if recipe.recompute_granularity == "full" else 0)
    per_gpu = layout.world_size // p
    return StepTerms(
        flops=max(stage_flops) / per_gpu,
        flops_mean=sum(stage_flops) / p / per_gpu,
        tp=tp,
        pp=pp,
        dp=dp,
        layer_passes=m * layout.layers_per_stage * per_layer,
        chunk_passes=m * layout.vpp,
        bubble_overhead=bubble(p, m, layout.vpp)[0],
        ranks_per_node=ranks_per_node or min(layout.world_size, gpus_per_node),
        schedule=(p, m, layout.vpp, per_layer - 1.0, layout.world_size // p),
    )
