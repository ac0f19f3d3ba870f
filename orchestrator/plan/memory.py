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

from dataclasses import dataclass, replace
from typing import Any, List, Optional

from orchestrator.config.layout import ParallelLayout, layout_from_config, padded_vocab_size, vpp_no_op
from orchestrator.config.model_rules import recompute_problems
from orchestrator.errors import ConfigError
from orchestrator.plan.activations import activations_by_recompute, layer_activation_bytes  # noqa: F401
from orchestrator.plan.cost import bubble, comm_seconds, flops_per_step  # noqa: F401
from orchestrator.plan.inputs import (  # noqa: F401
    ATTENTION_KERNELS,
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
    attention_kernel,
    gib,
    gpu_preset,
    gpus_per_node,
    recipe_of,
    vocab_size_of,
    vocab_source,
)
from orchestrator.plan.params import layer_params as _layer_params  # noqa: F401
from orchestrator.plan.params import stage_params as _stage_params
from orchestrator.plan.params import total_params as _total_params
from orchestrator.plan.profile import DeviceProfile, StepTerms, device_profile, planned_device, step_terms
from orchestrator.plan.result import HEADROOM, Plan  # noqa: F401 - the plan's names, where callers read them
from orchestrator.plan.stage_memory import StageMemory, stage_memories  # noqa: F401

# ---- activations ([K22] section 4) ----------------------------------------------------------


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
    vp = padded_vocab_size(shape.vocab_size, shape.make_vocab_size_divisible_by, t)
    per_stage = _stage_params(shape, layout, vp)
    stages = stage_memories(shape, layout, recipe, vp, per_stage, profile)
    by_recompute = activations_by_recompute(shape, layout, recipe, vp, profile)
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
    notes = _notes(terms, profile, idle, recipe, gpu)
    return Plan(
        layout=layout,
        shape=shape,
        recipe=recipe,
        gpu=gpu,
        mfu_assumed=mfu,
        padded_vocab_size=vp,
        params_total=_total_params(shape, layout, vp),
        params_per_layer=sum(_layer_params(shape)),
        params_embedding=(vp + _positions(shape)) * shape.hidden_size,
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


@dataclass(frozen=True)
class Device:
    """What a plan of a config runs on: the preset, its device profile (None: the preset's assumptions) and, on a
    CPU, the ranks sharing this host. One reading for :func:`plan` and the suggestions
    (:func:`orchestrator.plan.suggest.suggest`), so that both price a layout alike."""

    preset: GpuPreset
    profile: Optional[DeviceProfile]
    ranks_per_node: Optional[int]

    @property
    def on_gpu(self) -> bool:
        """Planned on a GPU preset (not this machine's CPU): decides the attention kernel (:func:`recipe_of`)."""
        return self.preset.name != CPU_PRESET


def device_for(cfg, world_size: int, gpu: Optional[str] = None, profile: Any = "auto") -> Device:
    """The :class:`Device` a plan of ``cfg`` at ``world_size`` ranks uses: ``gpu`` (default
    :func:`~orchestrator.plan.profile.planned_device`), ``profile`` as in :func:`plan`. ConfigError: unknown preset."""
    on_host = world_size // max(1, cfg.cluster.nodes)
    preset = gpu_preset(gpu if gpu is not None else planned_device(cfg), ranks_on_host=on_host)
    if isinstance(profile, str):
        profile = device_profile(preset, cfg.data.cache_dir)
    return Device(preset, profile, on_host if preset.name == CPU_PRESET else None)


def attention_note(result: Plan, transformer_impl: str) -> str:
    """The attention kernel ``result`` assumed, why (``model.transformer_impl`` and the device), and the
    worst stage's activations at the plan's recomputation under the other kernel."""
    rec, lay, sh = result.recipe, result.layout, result.shape
    other = "unfused" if rec.attention == "flash" else "flash"
    alt = activations_by_recompute(sh, lay, replace(rec, attention=other), result.padded_vocab_size, result.profile)
    alt_bytes = gib(alt[rec.recompute_granularity if rec.recompute_granularity in ("selective", "full") else "none"])
    if rec.attention == "flash":
        return (
            f"attention: flash/fused (Transformer Engine's TEDotProductAttention, model.transformer_impl="
            f"{transformer_impl} on a GPU): no a*s^2 scores stored (Dao et al. 2022); with the local spec's "
            f"unfused attention (model.transformer_impl=local) activations would be {alt_bytes}"
        )
    why = "model.transformer_impl=local" if transformer_impl == "local" else "on CPU: no Transformer Engine"
    return (
        f"attention: unfused ({why}; megatron-core's DotProductAttention stores the a*s^2 scores, "
        f"Korthikanti et al. 2022); with Transformer Engine's flash attention activations would be {alt_bytes}"
    )


def plan(
    cfg,
    gpu: Optional[str] = None,
    vocab_size: Optional[int] = None,
    mfu: Optional[float] = None,
    profile: Any = "auto",
    layout: Optional[ParallelLayout] = None,
) -> Plan:
    """Plan a :class:`~orchestrator.config.schema.JobConfig` on ``gpu`` (default :func:`~orchestrator.plan.profile.planned_device`: ``cfg.gpu``, else the device the job runs on; ``cpu``: this machine).

    ``profile``: "auto" = the device's stored calibration profile when one exists (the plan's notes say
    which), a :class:`~orchestrator.plan.profile.DeviceProfile`, or None for the preset's assumptions.
    ``layout``: the validated layout when the caller carries it (a rank: the launcher's); else derived from ``cfg``.
    Raises :class:`~orchestrator.errors.LayoutError` for a broken Megatron rule and
    :class:`~orchestrator.errors.ConfigError` for an unknown GPU preset.
    """
    layout = layout if layout is not None else layout_from_config(cfg)
    device = device_for(cfg, layout.world_size, gpu, profile)
    preset, profile = device.preset, device.profile
    note = None
    if vocab_size is None:
        vocab_size, note = vocab_size_of(cfg)
    shape = ModelShape.from_model_config(cfg.model, vocab_size)
    result = plan_layout(
        layout,
        shape,
        recipe_of(cfg, on_gpu=device.on_gpu),
        preset,
        mfu or DEFAULT_MFU,
        gpus_per_node=gpus_per_node(cfg),
        profile=profile,
        ranks_per_node=device.ranks_per_node,
    )
    result.headroom, result.vocab_source = cfg.plan_headroom, vocab_source(cfg, vocab_size)
    result.notes.append(attention_note(result, cfg.model.transformer_impl))
    if cfg.training.fp8:
        result.notes.append(fp8_note(cfg, preset.name))
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
            f"planned for this machine's CPU{'' if cfg.gpu else ' (the job runs on CPU; gpu=NAME plans a GPU preset)'}: "
            f"{gib(preset.memory_bytes)} of memory per rank ({layout.world_size // max(1, cfg.cluster.nodes)} ranks "
            "on this host)"
        )
    elif cfg.training.device == "cpu" or (cfg.cluster.kind == "local" and not cfg.cluster.gpus_per_node):
        result.notes.append(
            f"this config runs on CPU; memory and time are for the {preset.name} preset "
            f"(gpu={preset.name}; without gpu= the plan is for this machine's CPU)"
        )
    return result


def _notes(terms: StepTerms, profile: Optional[DeviceProfile], idle: Optional[float], recipe: Recipe, gpu: GpuPreset):
    """What a plan adds below its verdict: ranks sharing cores, fp32's peak."""
    notes = []
    if profile is not None and terms.ranks_per_core(profile.cores):
        notes.append(
            f"{terms.ranks_per_node} ranks share {profile.cores} cores: a stage's idle pipeline time runs "
            f"other ranks (each rank's work is stretched by ranks per core; the bubble is the schedule's "
            f"fill and drain with fewer ranks than cores: {idle:.1%})"
        )
    if recipe.precision == "fp32" and profile is None:
        notes.append(f"fp32: peak is {gpu.peak_flops_fp32 / 1e12:g} TFLOP/s (no TF32); activations 4 bytes/element")
    return notes


def fp8_note(cfg, preset: str) -> str:
    """What a plan with ``training.fp8`` counted (:mod:`orchestrator.plan.fp8`) and what not; A100s have no FP8."""
    t = cfg.training
    where = (
        f"; {preset} has no FP8 tensor cores (compute capability 8.0; Transformer Engine's FP8 needs 8.9+: H100, "
        "H200, L40S): the job would fail there"
        if preset.startswith("A100")
        else ""
    )
    return (
        f"fp8: training.fp8={t.fp8} ({t.fp8_recipe}, amax history {t.fp8_amax_history_len}) adds 2 B per GEMM weight "
        "(Transformer Engine's FP8 cast and its transpose) and the amax buffers; step time and activations are "
        f"planned as bf16's{where}"
    )


def _positions(shape: ModelShape) -> int:
    """Rows of the learned position embedding (0 for RoPE)."""
    if shape.position_embedding_type != "learned_absolute":
        return 0
    return shape.max_position_embeddings or shape.seq_length
