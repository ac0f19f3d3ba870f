"""Megatron's rules for a parallel layout (:class:`orchestrator.config.layout.ParallelLayout`), each broken one
a sentence naming the keys, the values and a fix.

:func:`layout_problems` lists them; ``ParallelLayout.problems`` and ``ParallelLayout.validate`` (which raises
one :class:`~orchestrator.errors.LayoutError`) call it. Pure Python (no torch, no megatron import).

Rules (megatron-core 0.16.1, Megatron-LM ``arguments.validate_args``):

* ``world_size % (TP x PP x CP) == 0``; ``DP = world_size / (TP x PP x CP)``.
* ``global_batch_size % (micro_batch_size x DP) == 0``;
  ``num_microbatches = GBS / (MBS x DP)``.
* ``num_layers % PP == 0`` and, with VPP, ``num_layers % (PP x VPP) == 0``.
* interleaved schedule (VPP set): ``PP > 1`` and ``num_microbatches % PP == 0``
  (which implies ``num_microbatches >= PP``).
* ``num_attention_heads % TP == 0``; ``num_query_groups`` a multiple or a divisor of TP
  (megatron-core replicates key/value heads when TP exceeds the groups).
* ``sequence_parallel`` needs ``TP > 1``.
* ``seq_length <= max_position_embeddings`` (learned absolute positions);
  ``seq_length % (2 x CP) == 0`` with CP > 1 (load-balanced causal split).
* MoE: ``num_moe_experts % EP == 0`` and ``world_size % (TP x EP x PP) == 0`` (the expert
  grid: expert TP, which defaults to TP, x EP x PP; CP folds into expert data parallelism in
  ``parallel_state.initialize_model_parallel``); EP > 1 without experts is an error; EP > 1 with
  TP > 1 needs ``sequence_parallel`` (Megatron's MoE guide says it must be on; megatron-core
  0.16.1 only warns, earlier versions raised).
"""

from __future__ import annotations

from typing import List

from orchestrator.config.divisors import divisors, nearby_multiples, nearest_divisor, nearest_multiple


def layout_problems(layout) -> List[str]:
    """Every broken rule of ``layout`` (a :class:`~orchestrator.config.layout.ParallelLayout`) as one sentence
    naming keys, values and a fix (empty = valid)."""
    return [
        *_world_problems(layout),
        *_batch_and_pipeline_problems(layout),
        *_model_problems(layout),
        *_expert_problems(layout),
    ]


def _degrees(layout) -> tuple:
    return (
        layout.tensor_model_parallel_size,
        layout.pipeline_model_parallel_size,
        layout.context_parallel_size,
        layout.expert_model_parallel_size,
        layout.virtual_pipeline_model_parallel_size,
        [],
    )


def _world_problems(layout) -> List[str]:
    """The world size against TP x PP x CP and a stated DP."""
    tp, pp, cp, ep, vpp, out = _degrees(layout)
    mp = layout.model_parallel_size
    if layout.world_size % mp:
        valid = [d for d in divisors(layout.world_size)]
        out.append(
            f"world size {layout.world_size} ({layout.world_size_source}) is not divisible by "
            f"TP x PP x CP = {tp} x {pp} x {cp} = {mp}; fix: choose degrees whose product divides "
            f"{layout.world_size} (divisors: {valid}) or change the number of tasks"
        )
    elif layout.stated_data_parallel_size is not None and layout.stated_data_parallel_size != layout.data_parallel_size:
        need = mp * layout.stated_data_parallel_size
        out.append(
            f"parallelism.data_parallel_size={layout.stated_data_parallel_size} disagrees with the world size: "
            f"DP = world_size / (TP x PP x CP) = {layout.world_size} / ({tp} x {pp} x {cp}) = {layout.data_parallel_size}; "
            f"fix: set parallelism.data_parallel_size=null (derive it) or {layout.data_parallel_size}, "
            f"or run {need} tasks (cluster.nodes x cluster.tasks_per_node = {need})"
        )
    return out


def _batch_and_pipeline_problems(layout) -> List[str]:
    """GBS against MBS x DP; layers per (virtual) stage; the interleaved schedule's rule."""
    tp, pp, cp, ep, vpp, out = _degrees(layout)
    dp = layout.data_parallel_size
    step = layout.micro_batch_size * dp
    if layout.global_batch_size % step:
        out.append(
            f"training.global_batch_size={layout.global_batch_size} is not divisible by "
            f"training.micro_batch_size x DP = {layout.micro_batch_size} x {dp} = {step} "
            f"({layout.global_batch_size} % {step} = {layout.global_batch_size % step}); "
            f"fix: training.global_batch_size one of {nearby_multiples(layout.global_batch_size, step)}"
        )
    if layout.num_layers % pp:
        out.append(
            f"model.num_layers={layout.num_layers} does not split evenly over "
            f"parallelism.pipeline_model_parallel_size={pp} ({layout.num_layers} % {pp} = {layout.num_layers % pp}); "
            f"fix: parallelism.pipeline_model_parallel_size one of {[d for d in divisors(layout.num_layers) if d <= 64]} "
            f"or model.num_layers one of {nearby_multiples(layout.num_layers, pp)}"
        )
    elif vpp is not None and vpp > 1 and layout.num_layers % (pp * vpp):
        chunks = pp * vpp
        out.append(
            f"model.num_layers={layout.num_layers} layers do not split into {chunks} chunks of equal size "
            f"(PP x VPP = {pp} x {vpp}; {layout.num_layers} % {chunks} = {layout.num_layers % chunks}); "
            f"fix: parallelism.virtual_pipeline_model_parallel_size one of "
            f"{[v for v in divisors(layout.num_layers // pp) if v > 1] or ['null']}"
        )
    if vpp is not None:
        if vpp < 1:
            key = "parallelism.virtual_pipeline_model_parallel_size"  # values.py refuses it first: a fallback
            out.append(f"{key}={vpp} must be >= 1 or null; fix: {key}=null")
        elif vpp > 1 and pp == 1:
            out.append(
                f"parallelism.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
                f"(got {pp}); fix: parallelism.virtual_pipeline_model_parallel_size=null"
            )
        elif vpp > 1 and layout.global_batch_size % step == 0 and layout.num_microbatches % pp:
            m = layout.num_microbatches
            ok_gbs = [k * pp * step for k in range(1, 4)]
            out.append(
                f"interleaved schedule (virtual_pipeline_model_parallel_size={vpp}) needs num_microbatches >= {pp} "
                f"and a multiple of pipeline_model_parallel_size={pp}, but num_microbatches = GBS / (MBS x DP) = "
                f"{layout.global_batch_size} / ({layout.micro_batch_size} x {dp}) = {m}; "
                f"fix: training.global_batch_size one of {ok_gbs}, or parallelism.virtual_pipeline_model_parallel_size=null"
            )
    return out


def _model_problems(layout) -> List[str]:
    """Heads and query groups against TP; sequence parallel; positions; CP's sequence split."""
    tp, pp, cp, ep, vpp, out = _degrees(layout)
    heads = layout.num_attention_heads
    if heads % tp:
        out.append(
            f"model.num_attention_heads={heads} is not divisible by parallelism.tensor_model_parallel_size={tp}; "
            f"fix: parallelism.tensor_model_parallel_size={nearest_divisor(heads, tp)} (one of {[d for d in divisors(heads) if d <= 64]})"
        )
    groups = layout.num_query_groups
    if groups is not None:
        if heads % groups:
            ok = [g for g in divisors(heads) if g % tp == 0 or tp % g == 0]  # also fits TP (the rule below)
            out.append(
                f"model.num_attention_heads={heads} is not divisible by model.num_query_groups={groups}; "
                f"fix: model.num_query_groups={min(ok, key=lambda g: (abs(g - groups), g))} (one of {ok})"
            )
        if groups % tp and tp % groups:
            out.append(
                f"model.num_query_groups={groups} is neither a multiple nor a divisor of "
                f"parallelism.tensor_model_parallel_size={tp}; "
                f"fix: parallelism.tensor_model_parallel_size one of {divisors(groups)} or a multiple of {groups}"
            )
    if layout.sequence_parallel and tp == 1:
        out.append(
            "parallelism.sequence_parallel=true needs tensor_model_parallel_size > 1; fix: parallelism.sequence_parallel=false"
        )
    if layout.position_embedding_type == "learned_absolute" and layout.seq_length > layout.max_position_embeddings:
        out.append(
            f"model.seq_length={layout.seq_length} exceeds model.max_position_embeddings={layout.max_position_embeddings}; "
            f"fix: model.max_position_embeddings={layout.seq_length} (or model.seq_length={layout.max_position_embeddings})"
        )
    if cp > 1 and layout.seq_length % (2 * cp):
        out.append(
            f"model.seq_length={layout.seq_length} is not divisible by 2 x context_parallel_size = {2 * cp}; "
            f"fix: model.seq_length={nearest_multiple(layout.seq_length, 2 * cp)} (a multiple of {2 * cp})"
        )
    return out


def _expert_problems(layout) -> List[str]:
    """Expert parallelism: experts, the TP x EP x PP grid, sequence parallel with TP."""
    tp, pp, cp, ep, vpp, out = _degrees(layout)
    if ep > 1:
        if not layout.num_moe_experts:
            out.append(
                f"parallelism.expert_model_parallel_size={ep} needs a mixture-of-experts model "
                f"(model.num_moe_experts is null); fix: parallelism.expert_model_parallel_size=1"
            )
        elif layout.num_moe_experts % ep:
            out.append(
                f"model.num_moe_experts={layout.num_moe_experts} is not divisible by parallelism.expert_model_parallel_size="
                f"{ep}; fix: parallelism.expert_model_parallel_size one of {divisors(layout.num_moe_experts)}"
            )
        grid = tp * ep * pp
        if layout.world_size % grid:
            out.append(
                f"expert grid TP x EP x PP = {tp} x {ep} x {pp} = {grid} does not divide "
                f"world size {layout.world_size}; fix: parallelism.expert_model_parallel_size one of "
                f"{[e for e in divisors(layout.world_size) if layout.world_size % (tp * e * pp) == 0]}"
            )
        if tp > 1 and not layout.sequence_parallel:
            out.append(
                f"parallelism.expert_model_parallel_size={ep} with tensor_model_parallel_size={tp} needs "
                "sequence parallelism; fix: parallelism.sequence_parallel=true"
            )
    return out
