"""The plan as text: layout, parameters, the memory table, bubble, FLOPs and the verdict.

Pure Python; formats a :class:`orchestrator.plan.memory.Plan`.
"""

from __future__ import annotations

from orchestrator.plan.inputs import GiB, gib
from orchestrator.plan.params import active_params
from orchestrator.plan.result import Plan
from orchestrator.text import table


def _num(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f}"


def format_plan(plan: Plan) -> str:
    """The plan as a plain-text report (layout, parameters, memory table, bubble, FLOPs, verdict)."""
    lay, sh, rec, gpu = plan.layout, plan.shape, plan.recipe, plan.gpu
    p, m, v, t = lay.pipeline_model_parallel_size, lay.num_microbatches, lay.vpp, lay.tensor_model_parallel_size
    peak = gpu.peak_flops(rec.precision)
    lines = [
        f"plan: {lay.world_size} x {gpu.name} ({gib(gpu.memory_bytes)}, {peak / 1e12:g} TFLOP/s dense "
        f"{'fp32' if rec.precision == 'fp32' else 'bf16/fp16'}), precision {rec.precision}",
        *("  " + s for s in lay.summary().splitlines()),
        "parameters",
        f"  vocab {sh.vocab_size} -> padded {plan.padded_vocab_size} (multiple of "
        f"{sh.make_vocab_size_divisible_by} x TP {t})" + (f"; from {plan.vocab_source}" if plan.vocab_source else ""),
        f"  total {_num(plan.params_total)} (per layer {_num(plan.params_per_layer)}, embeddings "
        f"{_num(plan.params_embedding)}{', output layer tied' if not sh.untie_embeddings_and_output_weights else ''})"
        + (
            f"; active per token {_num(active_params(sh, lay, plan.padded_vocab_size))} (top-{sh.moe_router_topk} "
            f"of {sh.num_moe_experts} experts)"
            if sh.num_moe_experts
            else ""
        ),
        "  per stage: "
        + ", ".join(_num(n) for n in plan.params_per_stage)
        + f"; per GPU (TP {t} shard): "
        + ", ".join(_num(st.params) for st in plan.stages),
    ]
    shown = sorted({0, p - 1, plan.worst.stage})
    cols = [plan.stages[r] for r in shown]
    opt = f"{rec.optimizer}, {rec.optimizer_bytes} B/param" + (
        f", sharded over DP {lay.data_parallel_size}" if rec.use_distributed_optimizer else ""
    )
    rows = _memory_rows(plan, cols, opt)
    unit, scale = ("GiB", GiB) if plan.peak_bytes - plan.worst.overhead >= GiB else ("MiB", 2**20)
    cells = [
        [label] + [str(x) if label.endswith("in flight") else f"{x / scale:.2f}" for x in vals] for label, vals in rows
    ]
    lines.append(
        table([f"memory per GPU, {unit}"] + [f"stage {r}" for r in shown], cells, right=range(1, len(shown) + 1))
    )
    lines.append(
        "  activations on the worst stage by recomputation: "
        + ", ".join(f"{k} {gib(val)}" for k, val in plan.activations_by_recompute.items())
    )
    sched = f"interleaved, v={v}" if lay.interleaved else "1F1B"
    lines += [
        f"pipeline bubble ({sched}; Narayanan et al. 2021 sec. 2.2): bubble/ideal = (p-1)/(v m) = "
        f"{p - 1}/({v} x {m}) = {plan.bubble_overhead:.1%}; idle share of step = (p-1)/(v m + p-1) = "
        f"{plan.bubble_fraction:.1%}",
        f"FLOPs per step: model {plan.model_flops:.3e} (3 x forward; 72 B s l h^2 (1 + s/12h + V/12lh) for GPT), "
        f"hardware {plan.hardware_flops:.3e} (model + recomputation)",
        (
            f"step time with the device profile: {plan.step_time_s:.3g} s = compute {plan.compute_s:.3g} + TP comm "
            f"{plan.tp_comm_s:.3g} + PP comm {plan.pp_comm_s:.3g} + framework {plan.framework_s:.3g} + bubble "
            f"{plan.bubble_s:.3g} + DP comm {plan.dp_comm_s:.3g} + fixed {plan.fixed_s:.3g}"
            if plan.profile is not None
            else f"step time at assumed MFU {plan.mfu_assumed:.2f} of busy compute: {plan.step_time_s:.3g} s = compute "
            f"{plan.compute_s:.3g} + TP comm {plan.tp_comm_s:.3g} + PP comm {plan.pp_comm_s:.3g} + bubble "
            f"{plan.bubble_s:.3g} + DP comm {plan.dp_comm_s:.3g}"
        )
        + f"; {plan.tokens_per_s:,.0f} tokens/s; predicted MFU {plan.mfu_predicted:.2f}",
        f"verdict: {plan.reason}",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _memory_rows(plan, cols, opt: str) -> list:
    """The memory table's rows: (label, one value per shown stage)."""
    rec, lay = plan.recipe, plan.layout
    rows = [
        (f"weights ({rec.param_bytes} B/param)", [c.weights for c in cols]),
        (f"gradients ({rec.grad_bytes} B/param)", [c.gradients for c in cols]),
        (f"optimizer state ({opt})", [c.optimizer for c in cols]),
        ("  without distributed optimizer", [c.optimizer_unsharded for c in cols]),
        (f"  with distributed optimizer (/DP {lay.data_parallel_size})", [c.optimizer_sharded for c in cols]),
        (
            f"activations ({rec.recompute_granularity or 'no'} recompute, {rec.attention} attention)",
            [c.activations for c in cols],
        ),
        ("  micro-batch chunks in flight", [c.in_flight for c in cols]),
        (
            "framework overhead (device profile)" if plan.profile is not None else "framework overhead (assumed)",
            [c.overhead for c in cols],
        ),
        ("total", [c.total for c in cols]),
    ]
    if rec.fp8:  # before the total
        rows.insert(-1, (f"FP8 weight copies + amax ({rec.fp8}, {rec.fp8_recipe})", [c.fp8 for c in cols]))
    return rows
