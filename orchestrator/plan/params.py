"""Parameter counts of a GPT model per layer and per pipeline stage, as megatron-core builds it.

Pure Python. Counts, not bytes; :mod:`orchestrator.plan.memory` turns them into bytes per GPU.
"""

from __future__ import annotations

from typing import List, Tuple

from orchestrator.config.layout import ParallelLayout
from orchestrator.plan.inputs import ModelShape


def layer_params(shape: ModelShape) -> Tuple[int, int, int, int]:
    """(TP-replicated, TP-sharded, expert-replicated, expert-sharded) parameters of one layer.

    Dense GPT layer with h = hidden, f = ffn, q = heads x kv_channels (= h), k = query groups x
    kv_channels: norms 2 x (2h | h), QKV h(q+2k) [+ q+2k bias, also alone with ``add_qkv_bias``], projection qh [+ h],
    fc1 h f (x2 gated) [+ f], fc2 f h [+ h]. Standard GPT: 12h^2 + 13h.
    Row-parallel biases and norms are replicated over TP; the rest is split.
    MoE: the MLP becomes ``num_moe_experts`` copies (split over TP x EP) plus an h x E router.
    """
    h, f, b = shape.hidden_size, shape.ffn, int(shape.add_bias_linear)
    d = h // shape.num_attention_heads
    q, k = shape.num_attention_heads * d, (shape.num_query_groups or shape.num_attention_heads) * d
    gate = 2 if shape.activation == "swiglu" else 1
    norm = 2 * h if shape.normalization == "LayerNorm" else h
    replicated = 2 * norm + b * h  # two norms + projection bias
    qkv_b = b if shape.add_qkv_bias is None else int(shape.add_qkv_bias)
    sharded = h * (q + 2 * k) + qkv_b * (q + 2 * k) + q * h
    mlp_rep, mlp_sharded = b * h, h * f * gate + b * f * gate + f * h
    if shape.num_moe_experts:
        e = shape.num_moe_experts
        return replicated + h * e, sharded, e * mlp_rep, e * mlp_sharded
    return replicated + mlp_rep, sharded + mlp_sharded, 0, 0


def stage_params(shape: ModelShape, layout: ParallelLayout, vp: int) -> List[Tuple[int, int, int, int]]:
    """Per pipeline stage: (unsharded count, per-GPU dense, per-GPU expert, per-GPU count).

    Embedding (vocab split over TP; learned positions replicated) on the first stage; final norm
    and output layer on the last. With tied embeddings and PP > 1 the last stage keeps its own
    copy of the word embeddings, which also has gradients and optimizer state.
    """
    t, p, ep = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.expert_model_parallel_size
    h = shape.hidden_size
    rep, sh, erep, esh = layer_params(shape)
    n = layout.layers_per_stage
    pos = (
        (shape.max_position_embeddings or shape.seq_length)
        if shape.position_embedding_type == "learned_absolute"
        else 0
    )
    final_norm = 2 * h if shape.normalization == "LayerNorm" else h
    out = []
    for r in range(p):
        full = n * (rep + sh + erep + esh)
        dense = n * (rep + sh // t)
        expert = n * (erep // ep + esh // (t * ep))
        if r == 0:
            full += vp * h + pos * h
            dense += vp * h // t + pos * h
        if r == p - 1:
            full += final_norm
            dense += final_norm
            if shape.untie_embeddings_and_output_weights or p > 1:
                full += vp * h
                dense += vp * h // t
        out.append((full, dense, expert, dense + expert))
    return out


def total_params(shape: ModelShape, layout: ParallelLayout, vp: int) -> int:
    """Distinct parameters of the whole model (each once: over TP, PP and EP shards, the tied output
    layer's copy on the last stage not counted twice) at padded vocabulary ``vp``."""
    tied_copy = (
        vp * shape.hidden_size
        if (layout.pipeline_model_parallel_size > 1 and not shape.untie_embeddings_and_output_weights)
        else 0
    )
    return sum(s[0] for s in stage_params(shape, layout, vp)) - tied_copy


def active_params(shape: ModelShape, layout: ParallelLayout, vp: int) -> int:
    """Parameters one token passes through: :func:`total_params` less, in every layer, the MLPs of the
    ``num_moe_experts - moe_router_topk`` experts it is not routed to (dense models: the total).
    Mixtral 8x7B: 12.9 B of 46.7 B (Jiang et al. 2024)."""
    total = total_params(shape, layout, vp)
    if not shape.num_moe_experts:
        return total
    _, _, erep, esh = layer_params(shape)
    idle = shape.num_moe_experts - min(shape.moe_router_topk, shape.num_moe_experts)
    return total - shape.num_layers * idle * (erep + esh) // shape.num_moe_experts
