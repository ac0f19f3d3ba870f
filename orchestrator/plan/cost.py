"""What a step costs in time: the pipeline bubble, FLOPs per step, communication seconds.

Pure Python. FLOPs count a multiply-add as 2; times are seconds; bandwidths bytes/s.
Sources: [N21] Narayanan et al. 2021 (bubble, section 2.2; FLOPs, section 5.1 and appendix),
[K22] Korthikanti et al. 2022 (recomputation FLOPs, section 6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from orchestrator.config.layout import ParallelLayout
from orchestrator.plan.inputs import BUS_EFFICIENCY, GpuPreset, ModelShape, Recipe


def bubble(pp: int, num_microbatches: int, vpp: int = 1) -> Tuple[float, float]:
    """Pipeline bubble of one flush, [N21] section 2.2, as (overhead, fraction).

    overhead = bubble time / ideal time = (p-1)/(v m)  ([N21] 2.2.1 for 1F1B, 2.2.2 interleaved);
    fraction = bubble time / step time = (p-1)/(v m + p - 1)  (step = (v m + p - 1) chunk-times).
    PP=4, m=8: 3/8 and 3/11; with v=2: 3/16 and 3/19.
    """
    idle, work = pp - 1, vpp * num_microbatches
    return idle / work, idle / (work + idle)


def _layer_forward_flops_per_token(shape: ModelShape) -> Tuple[float, float]:
    """(dense matmul FLOPs, attention-core FLOPs) of one layer's forward pass per token.

    Standard GPT: 24h^2 and 2sh. The attention core (QK^T and scores x V, 2 s q each per token) is
    halved for the causal mask, as Megatron-LM's ``num_floating_point_operations``
    (megatron/training/training.py) counts it; [N21] eq. (3) counts it whole (4sh). With the 2hV
    logit layer and x3 for backward: 72 B s l h^2 (1 + s/(12h) + V/(12 l h)).
    """
    h, a = shape.hidden_size, shape.num_attention_heads
    d = h // a
    q, k = a * d, (shape.num_query_groups or a) * d
    gate = 2 if shape.activation == "swiglu" else 1
    topk = shape.moe_router_topk if shape.num_moe_experts else 1
    dense = 2 * h * (q + 2 * k) + 2 * q * h + topk * 2 * h * shape.ffn * (gate + 1)
    if shape.num_moe_experts:
        dense += 2 * h * shape.num_moe_experts
    return dense, 2 * shape.seq_length * q  # causal: half of 4 s q


def flops_per_step(
    shape: ModelShape, layout: ParallelLayout, recipe: Recipe, vp: int
) -> Tuple[float, float, List[float]]:
    """(model FLOPs, hardware FLOPs, hardware FLOPs per pipeline stage) of one optimizer step.

    Model FLOPs = 3 x forward (backward = 2 x forward), [N21] 5.1, with the causal attention core of
    :func:`_layer_forward_flops_per_token`; for standard GPT 72 B s l h^2 (1 + s/(12h) + V/(12 l h)).
    Hardware FLOPs add what recomputation redoes: full = one more forward of the recomputed layers
    (96 B s l h^2 (1 + s/(12h) + V/(16 l h)) when every layer is recomputed), selective = the
    attention core again ([K22] sections 5-6). The planner's MFU and the job's measured TFLOP/s
    (``throughput_tflops``) both use this count.
    """
    tokens = layout.tokens_per_step
    dense, attn = _layer_forward_flops_per_token(shape)
    layer = dense + attn
    logits = 2 * shape.hidden_size * vp
    model = tokens * (3 * shape.num_layers * layer + 3 * logits)
    if recipe.recompute_granularity == "full":
        chunk = layout.layers_per_virtual_stage
        n = chunk if recipe.recompute_method != "block" else min(recipe.recompute_num_layers or chunk, chunk)
        extra_per_layer = layer * n / chunk
    elif recipe.recompute_granularity == "selective":
        extra_per_layer = attn
    else:
        extra_per_layer = 0.0
    per_layer_hw = tokens * (3 * layer + extra_per_layer)
    p = layout.pipeline_model_parallel_size
    stages = [layout.layers_per_stage * per_layer_hw for _ in range(p)]
    stages[-1] += tokens * 3 * logits
    return model, sum(stages), stages


@dataclass(frozen=True)
class CommVolume:
    """What one GPU moves per step for one parallel dimension: bytes, calls, and over which link."""

    bytes: float
    """Bytes each GPU sends per step (ring factors included)."""
    calls: int
    """Latency-bound messages per step: 1 per point-to-point send, 2(n-1) per ring collective over n ranks."""
    intra_node: bool
    """True when the group's span of consecutive ranks fits in one node (NVLink), else the network."""


def comm_volumes(
    shape: ModelShape, layout: ParallelLayout, recipe: Recipe, params_per_gpu: int, gpus_per_node: int = 8
) -> Tuple[CommVolume, CommVolume, CommVolume]:
    """(TP, PP, DP) communication of one GPU per step; a rough model, assumed not overlapped.

    TP ([K22] 4.2.2): every layer all-reduces its e s b h output twice forward and twice backward
    (sequence parallel turns each into a reduce-scatter + all-gather of the same volume), twice more
    when a full-recompute forward reruns it; a ring moves 2(t-1)/t of the buffer per GPU.
    DP: the gradients once per step, 2(d-1)/d x gradient bytes (distributed optimizer:
    reduce-scatter of gradients + all-gather of weights, (d-1)/d x both), one bucketed call.
    PP: each micro-batch chunk sends its e s b h / (t if SP) output forward and receives its gradient,
    so interleaving multiplies this by v ([N21] 2.2.2). Megatron orders ranks tp-cp-ep-dp-pp, so a
    group uses NVLink while its span of consecutive ranks fits in a node (TP for TP, TP x CP x DP for
    DP, world/PP for PP neighbours), else the network. MoE all-to-all is left out.
    """
    t, cp, dp = layout.tensor_model_parallel_size, layout.context_parallel_size, layout.data_parallel_size
    p, m = layout.pipeline_model_parallel_size, layout.num_microbatches
    buffer = recipe.param_bytes * shape.seq_length / cp * layout.micro_batch_size * shape.hidden_size
    tp = pp = dpv = CommVolume(0.0, 0, True)
    if p > 1:
        sent = buffer / t if layout.sequence_parallel else buffer
        calls = m * layout.vpp * 2
        pp = CommVolume(calls * sent, calls, layout.world_size // p + 1 <= gpus_per_node)
    if t > 1:
        calls = m * layout.layers_per_stage * (6 if recipe.recompute_granularity == "full" else 4)
        tp = CommVolume(calls * 2 * (t - 1) / t * buffer, calls * 2 * (t - 1), t <= gpus_per_node)
    if dp > 1:
        if recipe.use_distributed_optimizer:
            volume = (dp - 1) / dp * params_per_gpu * (recipe.grad_bytes + recipe.param_bytes)
        else:
            volume = 2 * (dp - 1) / dp * params_per_gpu * recipe.grad_bytes
        dpv = CommVolume(volume, 2 * (dp - 1), t * cp * dp <= gpus_per_node)
    return tp, pp, dpv


def comm_seconds(
    shape: ModelShape,
    layout: ParallelLayout,
    recipe: Recipe,
    gpu: GpuPreset,
    params_per_gpu: int,
    gpus_per_node: int = 8,
) -> Tuple[float, float, float]:
    """(TP, PP, DP) seconds per step on one GPU: :func:`comm_volumes` over the preset's links, which
    reach ``BUS_EFFICIENCY`` of nominal bandwidth (latency not counted)."""
    return tuple(
        v.bytes / (BUS_EFFICIENCY * (gpu.intra_node_bw if v.intra_node else gpu.inter_node_bw))
        for v in comm_volumes(shape, layout, recipe, params_per_gpu, gpus_per_node)
    )  # type: ignore[return-value]
