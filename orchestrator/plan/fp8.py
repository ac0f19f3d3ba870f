"""Memory of FP8 training (``training.fp8``) per GPU of a pipeline stage: the FP8 weight copies and the amax
buffers Transformer Engine keeps besides the bf16 weights. Pure Python; bytes.

Per transformer layer, on one GPU (h hidden, f ffn, q = heads x kv_channels, k = groups x kv_channels, g = 2 for
SwiGLU else 1, t TP, e EP, E experts, H ``training.fp8_amax_history_len``):

* **FP8 weight copies** = :data:`FP8_WEIGHT_BYTES` x the weights of the layer's GEMMs,
  ``(h(q+2k) + qh) / t`` (QKV, projection) ``+ (g h f + f h) / t`` (MLP; MoE: ``E (g h f + f h) / (t e)``).
  Transformer Engine's ``Linear`` casts each weight to FP8 once per step (``weight_fp8``, kept across the
  step's micro-batches) and, for the backward's data-gradient GEMM, keeps its transpose (``weight_t_fp8``:
  Hopper's FP8 GEMMs take one layout only; TE docs, "Handling transposes"): 1 + 1 byte per weight. The master
  weights, gradients and optimizer state stay as without FP8 (``--fp8-param-gather`` is not offered here);
  biases, norms, the router, the embedding and the output layer are not cast.
* **amax buffers** (``delayed`` recipe only) = GEMMs x 5 x (H + 2) x 4 bytes: TE's ``fp8_meta`` holds, per GEMM,
  3 forward tensors (input, weight, output) and 2 backward ones (output gradient, input gradient), each with an
  fp32 amax history of H entries, a scale and its inverse (TE ``TransformerEngineBaseModule.set_meta_tensor``).
  GEMMs per layer: 4 (QKV, projection, fc1, fc2); MoE: 2 + 2 x local experts. The other recipes keep no history
  (their scales come from the current tensor); their per-block scales are not counted (< 4% of the copies for
  mxfp8's one byte per 32).

The FP8 activations (TE keeps some inputs of the backward in FP8) and FP8 GEMM speed are not modelled: the
activation and step-time terms are the bf16 ones.
"""

from __future__ import annotations

from orchestrator.config.layout import ParallelLayout
from orchestrator.plan.inputs import ModelShape, Recipe

FP8_WEIGHT_BYTES = 2
"""Bytes per GEMM weight of the FP8 copies: the cast (1) and its transpose (1)."""
AMAX_TENSORS_PER_GEMM = 5
"""FP8 tensors with scaling state per GEMM: input, weight, output (forward); output and input gradients."""


def layer_gemm_weights(shape: ModelShape, layout: ParallelLayout) -> int:
    """GEMM weights of one transformer layer held by one GPU (TP / EP shards), the ones TE casts to FP8."""
    t, ep = layout.tensor_model_parallel_size, layout.expert_model_parallel_size
    h, f = shape.hidden_size, shape.ffn
    d = h // shape.num_attention_heads
    q, k = shape.num_attention_heads * d, (shape.num_query_groups or shape.num_attention_heads) * d
    gate = 2 if shape.activation == "swiglu" else 1
    mlp = gate * h * f + f * h
    attention = (h * (q + 2 * k) + q * h) // t
    if shape.num_moe_experts:
        return attention + shape.num_moe_experts * mlp // (t * ep)
    return attention + mlp // t


def layer_gemms(shape: ModelShape, layout: ParallelLayout) -> int:
    """GEMMs of one transformer layer on one GPU, each with its own FP8 scaling state."""
    if shape.num_moe_experts:
        return 2 + 2 * (shape.num_moe_experts // layout.expert_model_parallel_size)
    return 4


def layer_fp8_bytes(shape: ModelShape, layout: ParallelLayout, recipe: Recipe) -> int:
    """Bytes one GPU keeps per transformer layer for FP8 (0 without ``recipe.fp8``): copies + amax buffers."""
    if not recipe.fp8:
        return 0
    copies = FP8_WEIGHT_BYTES * layer_gemm_weights(shape, layout)
    history = recipe.fp8_amax_history_len if recipe.fp8_recipe == "delayed" else None
    amax = 0 if history is None else layer_gemms(shape, layout) * AMAX_TENSORS_PER_GEMM * (history + 2) * 4
    return copies + amax
