"""Activation memory per GPU: one layer's stored activations, the micro-batches in flight at a stage's peak, a
stage's total with its recomputation. Pure Python; bytes. Sources:

* [K22] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198): per-layer activations sbh(34 + 5as/h) (section 4, eq. 1-2), the pipeline in-flight
  factor (section 4.2.3), selective and full recomputation (section 5).
* [N21] Narayanan et al. 2021: the 1F1B and interleaved schedules' warm-up (section 2.2).
* [D22] Dao et al. 2022, "FlashAttention" (arXiv:2205.14135), section 3.1: the fused kernel keeps the
  softmax's log-sum-exp (one fp32 per query row and head) instead of the a s^2 score matrices, and
  regenerates the dropout mask from the RNG state instead of storing it.

The attention kernel (``Recipe.attention``, :func:`orchestrator.plan.inputs.attention_kernel`) follows the
layer spec the job runs: megatron-core's local spec (``model.transformer_impl=local``, and every CPU job)
computes attention as unfused matmuls and softmax (``DotProductAttention``), which keep the scores;
Transformer Engine's ``TEDotProductAttention`` (``auto`` / ``transformer_engine`` on GPU) runs flash or
cuDNN fused attention, which do not.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, Optional, Tuple

from orchestrator.config.layout import ParallelLayout
from orchestrator.plan.inputs import ATTENTION_KERNELS, ModelShape, Recipe
from orchestrator.plan.profile import DeviceProfile

LSE_BYTES = 4
"""Bytes per element of the flash kernel's saved log-sum-exp (fp32, [D22] section 3.1)."""


def layer_activation_bytes(
    shape: ModelShape, layout: ParallelLayout, elem: int, selective: bool = False, attention: str = "unfused"
) -> float:
    """Bytes one transformer layer keeps for backward, per GPU, for one micro-batch.

    s = seq_length / CP, b = micro_batch_size, h = hidden, a = heads, t = TP, f = ffn hidden,
    g = 2 for SwiGLU (gated fc1) else 1, k = router top-k (1 for a dense MLP), e = ``elem``
    (2 for bf16/fp16, 4 for fp32), d_h / d_a = 1 when hidden / attention dropout > 0 else 0.

    * kept whole on every TP rank unless sequence parallel: two norm inputs, the QKV input, the fc1
      input (4 e sbh) and the two hidden-dropout masks (2 d_h sbh, 1 byte per element);
    * split over TP: Q, K, V and the projection input (4 e sbh; K and V counted at full width even
      with grouped-query attention, as [K22]), the MLP activation input and fc2 input
      (k e sb f (g + 1));
    * ``attention="unfused"``: softmax output, its dropout mask and the dropout output,
      a s^2 b (e + d_a (1 + e)), split over TP; ``selective`` recomputation drops them ([K22] section 5);
    * ``attention="flash"``: no scores, no dropout mask; the log-sum-exp, a s b x 4 bytes, split over
      TP ([D22]); ``selective`` recomputes core attention and drops that.

    With e = 2, dropout on, f = 4h and GELU this is [K22]'s sbh(34 + 5as/h) without parallelism,
    sbh(10 + 24/t + 5as/(ht)) with TP and sbh/t (34 + 5as/h) with TP + sequence parallel; flash
    leaves 34 sbh + 4asb (sbh(10 + 24/t) + 4asb/t with TP). Llama-style layers (SwiGLU, no dropout,
    e = 2) with flash: sbh(8 + (8 + 6f/h)/t) + 4asb/t. Raises ValueError for an unknown ``attention``.
    """
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r}: expected one of {', '.join(ATTENTION_KERNELS)}")
    s = shape.seq_length / layout.context_parallel_size
    b, h, a = layout.micro_batch_size, shape.hidden_size, shape.num_attention_heads
    t = layout.tensor_model_parallel_size
    sbh = s * b * h
    hmask, amask = float(shape.hidden_dropout > 0), float(shape.attention_dropout > 0)
    topk = shape.moe_router_topk if shape.num_moe_experts else 1
    gate = 2 if shape.activation == "swiglu" else 1
    replicated = 4 * elem * sbh + 2 * hmask * sbh
    sharded = 4 * elem * sbh + topk * elem * s * b * shape.ffn * (gate + 1)
    if not selective:
        if attention == "flash":
            sharded += LSE_BYTES * a * s * b
        else:  # the query length is s/CP, the key length the whole sequence
            sharded += a * s * shape.seq_length * b * (elem + amask * (1 + elem))
    if layout.sequence_parallel:
        return (replicated + sharded) / t
    return replicated + sharded / t


def in_flight(layout: ParallelLayout, stage: int) -> int:
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


def stage_activations(
    shape: ModelShape, layout: ParallelLayout, recipe: Recipe, stage: int, vp: int, granularity: Optional[str]
) -> Tuple[float, int]:
    """(bytes, in-flight chunks) of activations on one GPU of ``stage`` at its peak; ``vp`` is the padded
    vocabulary, ``granularity`` the recomputation (None, ``selective``, ``full``), per-layer bytes from
    :func:`layer_activation_bytes` with ``recipe.attention``.

    Stored activations of the in-flight chunks ([K22]) plus a working set that [K22] does not
    count: while one layer runs backward, gradients of its activations live next to them, taken
    as one layer's full activations (and, with full recomputation, the rebuilt layers on top).
    """
    e, t = recipe.param_bytes, layout.tensor_model_parallel_size
    p, chunk_layers = layout.pipeline_model_parallel_size, layout.layers_per_virtual_stage
    full = layer_activation_bytes(shape, layout, e, selective=False, attention=recipe.attention)
    sbh = shape.seq_length / layout.context_parallel_size * layout.micro_batch_size * shape.hidden_size
    sbh_local = sbh / t if layout.sequence_parallel else sbh
    flight = in_flight(layout, stage)
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
        selective = granularity == "selective"
        per_chunk = chunk_layers * layer_activation_bytes(shape, layout, e, selective, recipe.attention)
    total = flight * per_chunk + transient
    if stage == 0 and shape.hidden_dropout > 0:  # embedding dropout mask
        total += flight * sbh_local
    if stage == p - 1:  # final norm + output-layer inputs; logits and fp32 softmax of one micro-batch
        total += 2 * e * sbh_local + (e + 4) * sbh / shape.hidden_size * vp / t
    return total, flight


def activations_by_recompute(
    shape: ModelShape, layout: ParallelLayout, recipe: Recipe, vp: int, profile: Optional[DeviceProfile]
) -> Dict[str, float]:
    """The worst end stage's activation bytes per GPU with no, selective and full recomputation (scaled by the
    profile's activation factor when there is one)."""
    p = layout.pipeline_model_parallel_size
    alt_full = (
        recipe
        if recipe.recompute_granularity == "full"
        else replace(recipe, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    )
    ends = {0, p - 1}  # middle stages hold fewer micro-batches and neither embedding nor logits
    act_factor = profile.activation_factor if profile is not None else 1.0
    by_recompute = {
        name: act_factor * max(stage_activations(shape, layout, rec, r, vp, g)[0] for r in ends)
        for name, rec, g in (("none", recipe, None), ("selective", recipe, "selective"), ("full", alt_full, "full"))
    }
    return by_recompute
