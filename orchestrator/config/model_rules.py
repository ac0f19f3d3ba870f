"""Rules megatron-core enforces only when it builds the model inside the ranks (``TransformerConfig``
and the MoE layers), checked before anything is queued: one sentence each, in the one-line error form
(:func:`orchestrator.config.checks.validate` raises them; the planner's recipe check uses
:func:`recompute_problems` too)."""

from __future__ import annotations

from typing import List, Optional

from orchestrator.config.divisors import nearest_divisor, nearest_multiple
from orchestrator.config.layout import ParallelLayout
from orchestrator.config.schema import JobConfig
from orchestrator.text import show


def recompute_problems(
    granularity: Optional[str], method: Optional[str], num_layers: Optional[int], layers_per_stage: int
) -> List[str]:
    """Megatron's activation-recomputation rules (``TransformerConfig.__post_init__``), one sentence each.

    ``full`` needs ``recompute_method`` uniform or block and ``recompute_num_layers`` between 1 and
    the layers per pipeline rank; ``selective`` needs ``recompute_num_layers`` null. The planner's
    recipe check calls this too.
    """
    out: List[str] = []
    if granularity == "full":
        if method not in ("uniform", "block"):
            out.append(
                f"model.recompute_method={show(method)}: recompute_granularity=full needs uniform or block; "
                "fix: model.recompute_method=uniform"
            )
        if num_layers is None or not 1 <= num_layers <= layers_per_stage:
            out.append(
                f"model.recompute_num_layers={show(num_layers)}: must be between 1 and the layers per "
                f"pipeline rank ({layers_per_stage}) with recompute_granularity=full; "
                "fix: model.recompute_num_layers=1"
            )
    elif granularity == "selective" and num_layers is not None:
        out.append(
            f"model.recompute_num_layers={num_layers}: must be null with recompute_granularity=selective; "
            "fix: model.recompute_num_layers=null"
        )
    return out


def model_problems(cfg: JobConfig, layout: ParallelLayout) -> List[str]:
    """Rules megatron-core enforces only when it builds the model, inside the ranks."""
    m, p = cfg.model, cfg.parallelism
    tp = p.tensor_model_parallel_size
    out = recompute_problems(
        m.recompute_granularity, m.recompute_method, m.recompute_num_layers, layout.layers_per_stage
    )
    if m.hidden_size % m.num_attention_heads:
        out.append(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
            f"{m.num_attention_heads} (Megatron's head size = hidden / heads); fix: model.hidden_size="
            f"{nearest_multiple(m.hidden_size, m.num_attention_heads)} (a multiple of {m.num_attention_heads}) or "
            f"model.num_attention_heads={nearest_divisor(m.hidden_size, m.num_attention_heads)}"
        )
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    if ffn % tp:
        out.append(
            f"model.ffn_hidden_size={ffn} is not divisible by parallelism.tensor_model_parallel_size={tp} "
            f"(each TP rank holds an equal slice of the MLP); fix: model.ffn_hidden_size={nearest_multiple(ffn, tp)} "
            f"(a multiple of {tp})"
        )
    if p.sequence_parallel and tp > 1 and (m.seq_length // p.context_parallel_size) % tp:
        out.append(
            f"model.seq_length={m.seq_length} does not split over sequence parallelism: "
            f"seq_length / CP = {m.seq_length // p.context_parallel_size} is not divisible by TP={tp}; "
            f"fix: model.seq_length={nearest_multiple(m.seq_length, tp * p.context_parallel_size)} "
            f"(a multiple of {tp * p.context_parallel_size})"
        )
    if m.num_moe_experts and m.add_bias_linear and tp > 1:
        out.append(
            f"model.num_moe_experts={m.num_moe_experts} with model.add_bias_linear=true needs "
            f"parallelism.tensor_model_parallel_size=1 (megatron-core: bias in MoE only with expert TP = 1, "
            f"got {tp}); fix: model.add_bias_linear=false"
        )
    return out
