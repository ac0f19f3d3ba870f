"""What a plan says: the :class:`Plan` of one layout (parameters, memory per stage, bubble, FLOPs, step time) and
its verdict against the device's memory. Built by :func:`orchestrator.plan.memory.plan_layout`. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from orchestrator.config.layout import ParallelLayout
from orchestrator.config.schema import JobConfig
from orchestrator.plan.inputs import GpuPreset, ModelShape, Recipe, gib
from orchestrator.plan.profile import DeviceProfile, StepTerms
from orchestrator.plan.stage_memory import StageMemory

HEADROOM: float = JobConfig.plan_headroom
"""The default share of device memory a plan may use and still say "fits" (``plan_headroom``)."""


@dataclass
class Plan:
    """Everything :func:`format_plan` prints; units in each field's name or docstring."""

    layout: ParallelLayout
    shape: ModelShape
    recipe: Recipe
    gpu: GpuPreset
    mfu_assumed: float
    padded_vocab_size: int
    params_total: int
    params_per_layer: int
    params_embedding: int
    params_per_stage: List[int]
    """Parameters of each pipeline stage before TP sharding (tied output copy included)."""
    stages: List[StageMemory]
    activations_by_recompute: Dict[str, float]
    """Worst-stage activation bytes under no / selective / full recomputation."""
    bubble_overhead: float
    """[N21] 2.2: bubble time / ideal time = (p-1)/(v*m)."""
    bubble_fraction: float
    """Share of the step the pipeline idles: (p-1)/(v*m + p-1)."""
    compute_s: float
    """Busy compute time of the slowest stage at the assumed MFU."""
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    model_flops: float
    """Per optimizer step, without recomputation ([K22] section 6: "model FLOPs")."""
    hardware_flops: float
    """Per optimizer step, with recomputation ('hardware FLOPs')."""
    notes: List[str] = field(default_factory=list)
    framework_s: float = 0.0
    """Framework time of the pipelined part (layer and chunk passes); only with a device profile."""
    fixed_s: float = 0.0
    """Fixed framework time per step; only with a device profile."""
    profile: Optional[DeviceProfile] = None
    """The device profile whose constants priced this plan (None: the preset's assumptions)."""
    terms: Optional[StepTerms] = None
    """The amounts of work of a step that a device profile prices (calibration samples use them)."""
    idle_overhead: Optional[float] = None
    """The bubble's share of the pipelined part as priced (:meth:`~orchestrator.plan.profile.StepTerms.stretch`;
    below ``bubble_overhead`` when ranks share cores, CPU: a stage's idle pipeline time runs other ranks);
    None: ``bubble_overhead``."""
    vocab_source: str = ""
    """Where ``shape.vocab_size`` came from, in words (:func:`~orchestrator.plan.inputs.vocab_source`)."""
    headroom: float = HEADROOM
    """Share of device memory a plan may use and still say "fits" (``plan_headroom``); above it, "tight"."""

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.total)

    @property
    def peak_bytes(self) -> float:
        return self.worst.total

    @property
    def fits(self) -> bool:
        """The worst stage's estimate is within the device's memory (above it: out of memory, predicted)."""
        return self.peak_bytes <= self.gpu.memory_bytes

    @property
    def tight(self) -> bool:
        """It fits, but above ``headroom`` of the device's memory: the allocator's cache and fragmentation
        the estimate leaves out may not fit (Fujii et al. 2024, arXiv 2411.06465: no OOM in 454 runs whose
        estimate was below 80% of memory)."""
        return self.fits and self.peak_bytes > self.headroom * self.gpu.memory_bytes

    @property
    def bubble_s(self) -> float:
        idle = self.bubble_overhead if self.idle_overhead is None else self.idle_overhead
        return (self.compute_s + self.tp_comm_s + self.pp_comm_s + self.framework_s) * idle

    @property
    def step_time_s(self) -> float:
        """(compute + TP comm + PP comm + framework) x (1 + (p-1)/(v m)) + DP comm + fixed, seconds."""
        return (
            self.compute_s
            + self.tp_comm_s
            + self.pp_comm_s
            + self.framework_s
            + self.bubble_s
            + self.dp_comm_s
            + self.fixed_s
        )

    @property
    def mfu_predicted(self) -> float:
        """Model FLOPs / (world size x peak x step time)."""
        return self.model_flops / (
            self.layout.world_size * self.gpu.peak_flops(self.recipe.precision) * self.step_time_s
        )

    @property
    def tokens_per_s(self) -> float:
        return self.layout.tokens_per_step / self.step_time_s

    @property
    def reason(self) -> str:
        w, cap = self.worst, self.gpu.memory_bytes
        parts = {
            "weights": w.weights,
            "gradients": w.gradients,
            "optimizer state": w.optimizer,
            "activations": w.activations,
        }
        biggest = max(parts, key=parts.get)
        largest = f"largest part: {biggest} {gib(parts[biggest])}"
        if self.tight:
            return (
                f"tight: stage {w.stage} needs {gib(w.total)} of {gib(cap)} on {self.gpu.name} "
                f"({100 * w.total / cap:.0f}%), above plan_headroom={self.headroom:g} ({gib(self.headroom * cap)}; "
                f"the allocator's cache and fragmentation are not in the estimate); {largest}"
            )
        verdict = "fits" if self.fits else "does not fit"
        rel = "<=" if self.fits else ">"
        return (
            f"{verdict}: stage {w.stage} needs {gib(w.total)} {rel} {gib(cap)} on {self.gpu.name} "
            f"({100 * w.total / cap:.0f}%); {largest}"
        )

    def as_dict(self) -> dict:
        """Key numbers for results tables (bytes, FLOPs, seconds)."""
        return {
            "gpu": self.gpu.name,
            "fits": self.fits,
            "peak_bytes": self.peak_bytes,
            "params_total": self.params_total,
            "bubble_fraction": self.bubble_fraction,
            "bubble_overhead": self.bubble_overhead,
            "model_flops": self.model_flops,
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "mfu_predicted": self.mfu_predicted,
        }
