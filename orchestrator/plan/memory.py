"""Plan before you spend: parameters, memory per GPU, pipeline bubble, FLOPs and step time.

Pure Python (no torch, no megatron import), so a login node answers in milliseconds
whether a layout is valid, whether it fits a GPU and what each step costs.
All sizes are bytes, FLOPs are floating-point operations (a multiply-add is 2),
times are seconds. Sources:

* [N21] Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM" (arXiv:2104.04473): pipeline bubble (section 2.2),
  FLOPs per iteration (section 5.1 and its appendix).
* [K22] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (arXiv:2205.05198): activation memory per layer (section 4), pipeline
  in-flight factor (section 4.2.3), selective/full recomputation (section 5), model vs
  hardware FLOPs utilisation (section 6).
* [M] Megatron-Core's distributed-optimizer guide: bytes per parameter for weights,
  gradients and optimizer state, with and without sharding over DP.

Entry points: :func:`plan` (a :class:`~orchestrator.config.schema.JobConfig` in, a :class:`Plan`
out), :func:`plan_layout` (a :class:`~orchestrator.config.layout.ParallelLayout` + :class:`ModelShape`
+ :class:`Recipe`) and the plain-text :func:`format_plan`. Nearby layouts that fit are found by
:mod:`orchestrator.suggest`. Every function here is a pure function of its arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.config.layout import ParallelLayout, layout_from_config, padded_vocab_size, vpp_no_op
from orchestrator.config.model_rules import recompute_problems
from orchestrator.config.schema import JobConfig
from orchestrator.errors import ConfigError
from orchestrator.plan.cost import bubble, comm_seconds, flops_per_step  # noqa: F401
from orchestrator.plan.inputs import (  # noqa: F401
    BUS_EFFICIENCY,
    BYTE_TOKENIZER_VOCAB,
    CPU_PRESET,
    DEFAULT_MFU,
    FRAMEWORK_OVERHEAD_BYTES,
    GPU_PRESETS,
    LARGE_BUBBLE,
    GiB,
    GpuPreset,
    ModelShape,
    Recipe,
    _gib,
    gpu_preset,
    gpus_per_node,
    recipe_of,
    vocab_size_of,
    vocab_source,
)
from orchestrator.plan.params import layer_params as _layer_params  # noqa: F401
from orchestrator.plan.params import stage_params as _stage_params
from orchestrator.plan.params import total_params as _total_params
from orchestrator.plan.profile import DeviceProfile, StepTerms, device_profile, step_terms

HEADROOM: float = JobConfig.plan_headroom
"""The default share of device memory a plan may use and still say "fits" (``plan_headroom``)."""


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

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.overhead


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
        largest = f"largest part: {biggest} {_gib(parts[biggest])}"
        if self.tight:
            return (
                f"tight: stage {w.stage} needs {_gib(w.total)} of {_gib(cap)} on {self.gpu.name} "
                f"({100 * w.total / cap:.0f}%), above plan_headroom={self.headroom:g} ({_gib(self.headroom * cap)}; "
                f"the allocator's cache and fragmentation are not in the estimate); {largest}"
            )
        verdict = "fits" if self.fits else "does not fit"
        rel = "<=" if self.fits else ">"
        return (
            f"{verdict}: stage {w.stage} needs {_gib(w.total)} {rel} {_gib(cap)} on {self.gpu.name} "
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


# ---- activations ([K22] section 4) ----------------------------------------------------------


def layer_activation_bytes(shape: ModelShape, layout: ParallelLayout, elem: int, selective: bool = False) -> float:
    """Bytes one transformer layer keeps for backward, per GPU, for one micro-batch.

    Generalises [K22] eq. 1-2: with 2-byte activations, dropout on, f = 4h and GELU it is
    exactly sbh(34 + 5as/h) without parallelism, sbh(10 + 24/t + 5as/(ht)) with TP, and
    sbh/t (34 + 5as/h) with TP + sequence parallel; selective recomputation drops the
    5as^2b attention-score term ([K22] section 5). ``elem`` is 2 (bf16/fp16) or 4 (fp32);
    dropout masks (1 byte per element) only count when the dropout probability is > 0.
    s = seq_length / CP, b = micro_batch_size, a = heads, t = TP.
    """
    s = shape.seq_length / layout.context_parallel_size
    b, h, a, t = (
        layout.micro_batch_size,
        shape.hidden_size,
        shape.num_attention_heads,
        layout.tensor_model_parallel_size,
    )
    sbh = s * b * h
    hmask, amask = float(shape.hidden_dropout > 0), float(shape.attention_dropout > 0)
    topk = shape.moe_router_topk if shape.num_moe_experts else 1
    gate = 2 if shape.activation == "swiglu" else 1
    # Kept whole on every TP rank unless sequence parallel: 2 norm inputs, QKV input, fc1 input, 2 masks.
    replicated = 4 * elem * sbh + 2 * hmask * sbh
    # Split over TP: Q, K, V, projection input; MLP activation input and fc2 input (per routed expert).
    sharded = 4 * elem * sbh + topk * elem * s * b * shape.ffn * (gate + 1)
    if not selective:  # softmax output, its dropout mask and dropout output: a s^2 b terms
        sharded += a * s * shape.seq_length * b * (elem + amask * (1 + elem))
    if layout.sequence_parallel:
        return (replicated + sharded) / t
    return replicated + sharded / t


def _in_flight(layout: ParallelLayout, stage: int) -> int:
    """Micro-batch chunks alive at a stage's peak (Megatron's warm-up count + 1, capped at the total).

    1F1B: min(p - r, m) whole micro-batches ([N21] 2.2.1). Interleaved with v chunks:
    min(2(p - r - 1) + (v - 1)p + 1, m v) chunks of L/(p v) layers; on stage 0 that is
    L(1 + (p-1)/(p v)) layers' worth, [K22] section 4.2.3.
    """
    p, m, v = layout.pipeline_model_parallel_size, layout.num_microbatches, layout.vpp
    if p == 1:
        return 1
    if not layout.interleaved:
        return min(p - stage, m)
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)


def _stage_activations(
    shape: ModelShape, layout: ParallelLayout, recipe: Recipe, stage: int, vp: int, granularity: Optional[str]
) -> Tuple[float, int]:
    """(bytes, in-flight chunks) of activations on one GPU of ``stage`` at its peak.

    Stored activations of the in-flight chunks ([K22]) plus a working set that [K22] does not
    count: while one layer runs backward, gradients of its activations live next to them, taken
    as one layer's full activations (and, with full recomputation, the rebuilt layers on top).
    """
    e, t = recipe.param_bytes, layout.tensor_model_parallel_size
    p, chunk_layers = layout.pipeline_model_parallel_size, layout.layers_per_virtual_stage
    full = layer_activation_bytes(shape, layout, e, selective=False)
    sbh = shape.seq_length / layout.context_parallel_size * layout.micro_batch_size * shape.hidden_size
    sbh_local = sbh / t if layout.sequence_parallel else sbh
    flight = _in_flight(layout, stage)
    transient = full  # backward working set of one layer
    if granularity == "full":
        n = max(1, min(recipe.recompute_num_layers or 1, chunk_layers))
        if recipe.recompute_method == "block":  # first n layers keep only their input
            per_chunk = n * e * sbh_local + (chunk_layers - n) * full
            transient += full
        else:  # uniform: one stored input per group of n layers; a group is rebuilt in backward
            per_chunk = math.ceil(chunk_layers / n) * e * sbh_local
            transient += n * full
    else:
        per_chunk = chunk_layers * layer_activation_bytes(shape, layout, e, selective=granularity == "selective")
    total = flight * per_chunk + transient
    if stage == 0 and shape.hidden_dropout > 0:  # embedding dropout mask
        total += flight * sbh_local
    if stage == p - 1:  # final norm + output-layer inputs; logits and fp32 softmax of one micro-batch
        total += 2 * e * sbh_local + (e + 4) * sbh / shape.hidden_size * vp / t
    return total, flight


# ---- the plan -----------------------------------------------------------------------------


def recipe_problems(recipe: Recipe, layout: ParallelLayout) -> List[str]:
    """Megatron's recomputation rules (:func:`orchestrator.config.model_rules.recompute_problems`, the one copy)."""
    return recompute_problems(
        recipe.recompute_granularity, recipe.recompute_method, recipe.recompute_num_layers, layout.layers_per_stage
    )


def plan_layout(
    layout: ParallelLayout,
    shape: ModelShape,
    recipe: Recipe,
    gpu: GpuPreset,
    mfu: float = DEFAULT_MFU,
    validate: bool = True,
    gpus_per_node: int = 8,
    profile: Optional[DeviceProfile] = None,
    ranks_per_node: Optional[int] = None,
) -> Plan:
    """Plan one layout. Raises LayoutError / ConfigError when a Megatron rule is broken.

    With a ``profile`` (:mod:`orchestrator.plan.profile`) its constants replace the assumptions:
    framework overhead, states and activation factors for memory; achieved FLOP/s, link bandwidths,
    call latency and framework time per pass for the step time (``mfu`` is then unused).

    ``mfu`` is the assumed model-FLOPs utilisation of busy compute time (no bubble, no
    recomputation, no communication). Step time, in seconds:
    compute = max over stages of hardware FLOPs / (GPUs per stage x peak x mfu);
    step = (compute + TP comm + PP comm) x (1 + (p-1)/(v m)) + DP comm  (see :func:`comm_seconds`).
    The predicted MFU is model FLOPs / (world size x peak x step).
    """
    if validate:
        layout.validate()
        problems = recipe_problems(recipe, layout)
        if problems:
            raise ConfigError("invalid recomputation settings: " + "; ".join(problems))
    t, p = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    ep = layout.expert_model_parallel_size
    vp = padded_vocab_size(shape.vocab_size, shape.make_vocab_size_divisible_by, t)
    per_stage = _stage_params(shape, layout, vp)
    dp = layout.data_parallel_size
    edp = max(1, layout.world_size // (t * ep * p))
    ob = recipe.optimizer_bytes
    stages = []
    for r, (_, dense, expert, count) in enumerate(per_stage):
        act, flight = _stage_activations(shape, layout, recipe, r, vp, recipe.recompute_granularity)
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
    alt_full = (
        recipe
        if recipe.recompute_granularity == "full"
        else replace(recipe, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    )
    ends = {0, p - 1}  # middle stages hold fewer micro-batches and neither embedding nor logits
    act_factor = profile.activation_factor if profile is not None else 1.0
    by_recompute = {
        name: act_factor * max(_stage_activations(shape, layout, rec, r, vp, g)[0] for r in ends)
        for name, rec, g in (("none", recipe, None), ("selective", recipe, "selective"), ("full", alt_full, "full"))
    }
    overhead, fraction = bubble(p, layout.num_microbatches, layout.vpp)
    model, hardware, stage_flops = flops_per_step(shape, layout, recipe, vp)
    peak = gpu.peak_flops(recipe.precision)
    compute = max(stage_flops) / (layout.world_size / p * peak * mfu)
    tp_s, pp_s, dp_s = comm_seconds(shape, layout, recipe, gpu, max(st.params for st in stages), gpus_per_node)
    framework = fixed = 0.0
    terms = step_terms(shape, layout, recipe, vp, max(st.params for st in stages), gpus_per_node, ranks_per_node)
    idle = None
    if profile is not None:
        sec = terms.seconds(profile)
        compute, tp_s, pp_s, dp_s, framework, fixed = (
            sec[k] for k in ("compute", "tp", "pp", "dp", "framework", "fixed")
        )
        idle = sec["idle"]
    rep, sh, erep, esh = _layer_params(shape)
    pos = (
        (shape.max_position_embeddings or shape.seq_length)
        if shape.position_embedding_type == "learned_absolute"
        else 0
    )
    notes = []
    if profile is not None and terms.ranks_per_core(profile.cores):
        notes.append(
            f"{terms.ranks_per_node} ranks share {profile.cores} cores: a stage's idle pipeline time runs "
            f"other ranks (each rank's work is stretched by ranks per core; the bubble is the schedule's "
            f"fill and drain with fewer ranks than cores: {idle:.1%})"
        )
    if recipe.precision == "fp32" and profile is None:
        notes.append(f"fp32: peak is {gpu.peak_flops_fp32 / 1e12:g} TFLOP/s (no TF32); activations 4 bytes/element")
    return Plan(
        layout=layout,
        shape=shape,
        recipe=recipe,
        gpu=gpu,
        mfu_assumed=mfu,
        padded_vocab_size=vp,
        params_total=_total_params(shape, layout, vp),
        params_per_layer=rep + sh + erep + esh,
        params_embedding=(vp + pos) * shape.hidden_size,
        params_per_stage=[s[0] for s in per_stage],
        stages=stages,
        activations_by_recompute=by_recompute,
        bubble_overhead=overhead,
        bubble_fraction=fraction,
        compute_s=compute,
        tp_comm_s=tp_s,
        pp_comm_s=pp_s,
        dp_comm_s=dp_s,
        model_flops=model,
        hardware_flops=hardware,
        notes=notes,
        framework_s=framework,
        fixed_s=fixed,
        profile=profile,
        terms=terms,
        idle_overhead=idle,
    )


def plan(
    cfg, gpu: Optional[str] = None, vocab_size: Optional[int] = None, mfu: Optional[float] = None, profile: Any = "auto"
) -> Plan:
    """Plan a :class:`~orchestrator.config.schema.JobConfig` on ``gpu`` (default ``cfg.gpu``; ``cpu``: this machine).

    ``profile``: "auto" = the device's stored calibration profile when one exists (the plan's notes say
    which), a :class:`~orchestrator.plan.profile.DeviceProfile`, or None for the preset's assumptions.
    Raises :class:`~orchestrator.errors.LayoutError` for a broken Megatron rule and
    :class:`~orchestrator.errors.ConfigError` for an unknown GPU preset.
    """
    layout = layout_from_config(cfg)
    preset = gpu_preset(
        gpu if gpu is not None else cfg.gpu, ranks_on_host=layout.world_size // max(1, cfg.cluster.nodes)
    )
    if isinstance(profile, str):
        profile = device_profile(preset, cfg.data.cache_dir)
    note = None
    if vocab_size is None:
        vocab_size, note = vocab_size_of(cfg)
    shape = ModelShape.from_model_config(cfg.model, vocab_size)
    ranks_per_node = layout.world_size // max(1, cfg.cluster.nodes) if preset.name == CPU_PRESET else None
    result = plan_layout(
        layout,
        shape,
        recipe_of(cfg),
        preset,
        mfu or DEFAULT_MFU,
        gpus_per_node=gpus_per_node(cfg),
        profile=profile,
        ranks_per_node=ranks_per_node,
    )
    result.headroom, result.vocab_source = cfg.plan_headroom, vocab_source(cfg, vocab_size)
    if vpp_no_op(cfg):
        result.notes.append(vpp_no_op(cfg))
    if note:
        result.notes.append(note)
    if profile is not None:
        result.notes.append(f"device profile {profile.summary()}")
        if not profile.calibrated:
            result.notes.append(
                "to calibrate it on this device: python -m orchestrator tune <overrides> "
                "(every completed trial is a calibration sample)"
            )
    if preset.name == CPU_PRESET:
        result.notes.append(
            f"planned for this machine's CPU: {_gib(preset.memory_bytes)} of memory per rank "
            f"({layout.world_size // max(1, cfg.cluster.nodes)} ranks on this host)"
        )
    elif cfg.training.device == "cpu" or (cfg.cluster.kind == "local" and not cfg.cluster.gpus_per_node):
        result.notes.append(
            f"this config runs on CPU; memory and time are for the {preset.name} preset "
            "(gpu=cpu plans for this machine's CPU)"
        )
    return result
