"""The megatron config as data: JSON values of megatron-core's config objects, and which fields are
performance only.

``megatron_config.json`` (every run directory), ``python -m orchestrator megatron-config`` and the
golden files of ``tests/golden/megatron/`` (written by ``tools/megatron_golden.py`` from Megatron-LM's
own parser) all hold ``{"transformer": {...}, "ddp": {...}, "optimizer": {...}}``: every field of
megatron-core's ``TransformerConfig``, ``DistributedDataParallelConfig`` and ``OptimizerConfig`` by its
own name, with :func:`jsonable` values. A resume compares two of them with :func:`split_diff`: a
difference in :data:`PERFORMANCE_FIELDS` only changes speed (kernels, overlaps, recomputation) and is
carried, as are the optimizer's hyperparameters (:data:`CARRIED_SECTIONS`); the layout's fields are the
layout check's (:data:`LAYOUT_FIELDS`); any other difference changes what the model computes and is refused. Pure Python (no torch import: values
are read by duck typing).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
from typing import Any, Dict, List, Tuple

SECTIONS = ("transformer", "ddp", "optimizer")

PERFORMANCE_FIELDS: Dict[str, Tuple[str, ...]] = {
    "transformer": (
        # fused kernels computing the same formula as the unfused path
        "masked_softmax_fusion",
        "bias_dropout_fusion",
        "persist_layer_norm",
        "apply_rope_fusion",
        "gradient_accumulation_fusion",
        "cross_entropy_loss_fusion",
        "cross_entropy_fusion_impl",
        # where and when tensors live, not what they hold
        "use_cpu_initialization",
        "deallocate_pipeline_outputs",
        "batch_p2p_comm",
        "batch_p2p_sync",
        "barrier_with_L1_time",
        "overlap_p2p_comm",
        "tp_comm_overlap",
        "defer_embedding_wgrad_compute",
        # activation recomputation: the forward again in the backward, the same numbers, less memory
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
    ),
    "ddp": (
        "overlap_grad_reduce",
        "overlap_param_gather",
        "align_param_gather",
        "bucket_size",
        "num_buckets",
        "pad_buckets_for_high_nccl_busbw",
        "check_for_nan_in_grad",
        "check_for_large_grads",
        "nccl_ub",
        "fsdp_double_buffer",
    ),
    "optimizer": (
        "overlap_param_gather_with_optimizer_step",
        "timers",
        "log_num_zeros_in_grad",
        "barrier_with_L1_time",
    ),
}
"""Fields whose value changes speed or memory only, never the numbers computed (up to the order of
floating-point sums): kernel fusions, communication overlap, bucketing, placement, checks."""


FP8_FIELDS: Dict[str, Tuple[str, ...]] = {
    "transformer": ("fp8", "fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo"),
    "ddp": (),
    "optimizer": ("fp8_recipe",),
}
"""``training.fp8`` and its recipe: they change the GEMMs' rounding, not the weights a checkpoint holds or their
meaning, so a resume may switch FP8 on or off (a bf16 run finished in FP8, an FP8 run finished in bf16, as
Megatron-LM resumes with other ``--fp8-*`` flags); carried, and said in its own line
(:mod:`orchestrator.ckpt.megatron_resume`)."""


CARRIED_SECTIONS = ("optimizer",)
"""Sections a resume may change and carries, saying so: the optimizer's hyperparameters (learning rate,
weight decay, betas, clipping) are the config's from the resumed step on, as Megatron-LM's own resume
takes them from its flags; the optimizer's kind, the distributed optimizer and the precision, which shape
its state, are the layout check's (:mod:`orchestrator.ckpt.resume`)."""


LAYOUT_FIELDS: Dict[str, Tuple[str, ...]] = {
    "transformer": (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "sequence_parallel",
        "microbatch_group_size_per_vp_stage",
        "num_layers_in_first_pipeline_stage",
        "num_layers_in_last_pipeline_stage",
        "pipeline_model_parallel_layout",
        "hierarchical_context_parallel_sizes",
        "cp_comm_type",
        "transformer_impl",  # the layer spec: judged with the layout (orchestrator.ckpt.compare), named once
    ),
    "ddp": ("use_distributed_optimizer",),
    "optimizer": ("use_distributed_optimizer",),
}
"""Fields of the parallel layout: the manifest's layout check (:mod:`orchestrator.ckpt.resume`) already
refused them, or carried them with ``checkpoint.allow_reshard=true``; the megatron config comparison
leaves them to it (a PP 2 -> 1 reshard also changes ``microbatch_group_size_per_vp_stage``, which is PP), as it leaves
``transformer_impl`` to the layer-spec check beside the layout's."""


UNUSED_FIELDS: Dict[str, Tuple[str, ...]] = {
    "transformer": (
        "cuda_graph_scope",
        "cuda_graph_use_single_mempool",
        "moe_deepep_num_sms",
        "moe_hybridep_num_sms",
        # 0.19.x keeps None, meaning TP x gtp_weight_remat_size (1): what 0.20 stores
        "tensor_parallel_num_weight_shards",
        "expert_tensor_parallel_num_weight_shards",
    ),
    "ddp": ("data_parallel_sharding_strategy",),
    "optimizer": ("barrier_with_L1_time", "fp8_recipe", "muon_momentum", "muon_tp_mode", "optimizer_offload_fraction"),
}
"""Fields whose default differs between megatron-core lines (0.16.1, 0.19.2, Megatron-LM's 0.20.0) and that no
job here reads — CUDA graphs, MoE token dispatchers, FSDP, Muon, FP8 parameters (the optimizer's ``fp8_recipe``
is read for them only; ``training.fp8`` sets it, Megatron-LM always does), optimizer offload and timers are never
turned on — or that mean the same: not compared on resume, listed in the README's megatron config table."""


def data_parallel_size(cfg) -> int:
    """DP of ``cfg``: stated, or world size / (TP x PP x CP) (orchestrator.config.layout's rule)."""
    from orchestrator.config.layout import layout_from_config

    return layout_from_config(cfg).data_parallel_size


def overlaps(cfg, gpu: bool, dp: int) -> Tuple[bool, bool]:
    """(overlap_grad_reduce, overlap_param_gather) of the job at data-parallel size ``dp`` (the layout's: a rank
    passes the one it carries): the config's when stated; null means on for a GPU job with DP > 1 (param gather:
    with the distributed optimizer), as NVIDIA's published pretraining recipes (Megatron-Bridge
    ``CommOverlapConfig``) — Megatron-LM's bare flags default off."""
    p = cfg.parallelism
    on = gpu and dp > 1
    grad = p.overlap_grad_reduce if p.overlap_grad_reduce is not None else on
    gather = (
        p.overlap_param_gather if p.overlap_param_gather is not None else on and cfg.optimizer.use_distributed_optimizer
    )
    return bool(grad), bool(gather)


def required_env(cfg) -> Dict[str, str]:
    """Environment megatron-core needs on a GPU rank before CUDA starts: ``CUDA_DEVICE_MAX_CONNECTIONS=1``
    with TP > 1 or CP > 1 (Megatron-LM's ``validate_args`` asserts it before Blackwell: the TP/CP
    communication kernels must be queued ahead of the compute they overlap)."""
    p = cfg.parallelism
    if p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def jsonable(value: Any) -> Any:
    """A JSON value for one config field: numbers, strings, bools and None as they are; a dtype as
    ``torch.bfloat16``; a function or class as ``module.qualname``; an enum by name; containers
    element by element; anything else by ``repr``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if type(value).__name__ == "dtype":  # torch.dtype (str: "torch.bfloat16")
        return str(value)
    if isinstance(value, functools.partial):  # e.g. init_method: normal_(mean=0.0, std=0.02)
        args = [repr(a) for a in value.args] + [f"{k}={v!r}" for k, v in sorted(value.keywords.items())]
        return f"{jsonable(value.func)}({', '.join(args)})"
    if callable(value) and hasattr(value, "__qualname__"):
        module = getattr(value, "__module__", None) or ""
        return f"{module}.{value.__qualname__}" if module else value.__qualname__
    if dataclasses.is_dataclass(value):
        return fields_of(value)
    return repr(value)


def fields_of(config: Any) -> Dict[str, Any]:
    """Every dataclass field of a megatron-core config object, by name, :func:`jsonable`."""
    return {f.name: jsonable(getattr(config, f.name, None)) for f in dataclasses.fields(config)}


def config_hash(config: Dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a megatron config (what a manifest records)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def split_diff(old: Dict[str, Any], new: Dict[str, Any]) -> Tuple[List[tuple], List[tuple]]:
    """(carried, math) differences between two megatron configs: rows ``(section.field, old, new)``; carried:
    :data:`PERFORMANCE_FIELDS`, :data:`FP8_FIELDS` and :data:`CARRIED_SECTIONS`.
    Fields one side lacks (another megatron-core line), :data:`UNUSED_FIELDS` and :data:`LAYOUT_FIELDS`
    (judged by the layout check) are left out."""
    perf: List[tuple] = []
    math: List[tuple] = []
    for section in SECTIONS:
        a, b = old.get(section) or {}, new.get(section) or {}
        for name in sorted(set(a) & set(b) - set(UNUSED_FIELDS[section]) - set(LAYOUT_FIELDS[section])):
            if a[name] != b[name]:
                row = (f"{section}.{name}", a[name], b[name])
                carried = name in PERFORMANCE_FIELDS[section] + FP8_FIELDS[section] or section in CARRIED_SECTIONS
                (perf if carried else math).append(row)
    return perf, math
