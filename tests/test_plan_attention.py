"""Plans that know the attention kernel: unfused (local spec) stores the a s^2 scores, flash does not.

Plain pytest, no torch. Per-layer bytes against hand-computed values (Korthikanti et al. 2022 sec. 4;
Dao et al. 2022 sec. 3.1), and Llama-3-8B at TP2, seq 8192, MBS 1 on H100 against a total by hand.
"""

import dataclasses

import pytest

from orchestrator.config.compose import compose_config
from orchestrator.config.layout import ParallelLayout
from orchestrator.plan import memory as planner
from orchestrator.plan.inputs import FRAMEWORK_OVERHEAD_BYTES, GiB, ModelShape, attention_kernel
from orchestrator.plan.report import format_plan

S, B, H, A, T = 2048, 2, 1024, 16, 2


def _shape(swiglu: bool) -> ModelShape:
    if swiglu:  # Llama-style: gated fc1, no dropout
        return ModelShape(4, H, A, S, activation="swiglu", ffn_hidden_size=2816, normalization="RMSNorm")
    return ModelShape(4, H, A, S, hidden_dropout=0.1, attention_dropout=0.1)  # GPT: f = 4h, GELU, dropout


def _layout(sp: bool) -> ParallelLayout:
    return ParallelLayout(
        world_size=T,
        tensor_model_parallel_size=T,
        sequence_parallel=sp,
        micro_batch_size=B,
        global_batch_size=B,
        num_layers=4,
        num_attention_heads=A,
        seq_length=S,
        max_position_embeddings=S,
    )


sbh = S * B * H
# by hand, 2-byte activations. GPT: sbh(10 + 24/t) + 5as^2b/t unfused; 34 sbh/t + 5as^2b/t with SP.
# flash: the a s^2 b terms become the fp32 log-sum-exp, 4asb/t. SwiGLU (f = 2816, no dropout):
# 8 sbh kept whole + (8 sbh + 2 x 3 s b f) split; no masks.
SCORES, LSE = 5 * A * S * S * B, 4 * A * S * B
GLU = 8 * sbh + 6 * S * B * 2816
TABLE = [
    # attention, swiglu, sp, bytes
    ("unfused", False, False, sbh * (10 + 24 / T) + SCORES / T),
    ("unfused", False, True, (34 * sbh + SCORES) / T),
    ("flash", False, False, sbh * (10 + 24 / T) + LSE / T),
    ("flash", False, True, (34 * sbh + LSE) / T),
    ("unfused", True, False, 8 * sbh + (GLU + 2 * A * S * S * B) / T),
    ("unfused", True, True, (8 * sbh + GLU + 2 * A * S * S * B) / T),
    ("flash", True, False, 8 * sbh + (GLU + LSE) / T),
    ("flash", True, True, (8 * sbh + GLU + LSE) / T),
]


@pytest.mark.parametrize("attention,swiglu,sp,expected", TABLE)
def test_layer_activation_bytes_by_kernel_match_hand_values(attention, swiglu, sp, expected):
    f = planner.layer_activation_bytes
    got = f(_shape(swiglu), _layout(sp), 2, attention=attention)
    assert got == pytest.approx(expected, rel=1e-12)
    # selective recomputation recomputes core attention: it drops the scores, or flash's log-sum-exp
    sel = f(_shape(swiglu), _layout(sp), 2, selective=True, attention=attention)
    dropped = (SCORES if not swiglu else 2 * A * S * S * B) if attention == "unfused" else LSE
    assert sel == pytest.approx(expected - dropped / T, rel=1e-12)
    with pytest.raises(ValueError, match="attention='sdpa'"):
        f(_shape(swiglu), _layout(sp), 2, attention="sdpa")


def test_kernel_follows_transformer_impl_and_device():
    assert attention_kernel("auto", True) == attention_kernel("transformer_engine", True) == "flash"
    assert attention_kernel("local", True) == attention_kernel("auto", False) == "unfused"


# ---- Llama-3-8B, TP2 x DP4 on 8 x H100, seq 8192, MBS 1, no recomputation, distributed optimizer --------
LLAMA = [
    "+experiment=llama3_8b_a100x32",
    "gpu=H100",
    "cluster.nodes=1",
    "parallelism.pipeline_model_parallel_size=1",
    "parallelism.data_parallel_size=4",
    "training.global_batch_size=32",
    "model.recompute_granularity=null",
    "model.recompute_method=null",
    "model.recompute_num_layers=null",
]


def _llama_by_hand() -> float:
    """Bytes per GPU: weights + gradients + optimizer exact, activations from the flash formula."""
    h, f, V, L, t, dp, s, a = 4096, 14336, 128256, 32, 2, 4, 8192, 32
    qkv = h * (h + 2 * 1024)  # 8 KV groups of 128
    layer_sharded = qkv + h * h + 2 * h * f + f * h
    params = L * (layer_sharded // t + 2 * h) + 2 * V * h // t + h  # untied embedding + output, final norm
    states = params * (2 + 4 + 12 / dp)  # bf16 weights, fp32 grads, Adam + fp32 master sharded over DP
    sbh = s * h
    layer = 8 * sbh + (8 * sbh + 6 * s * f + 4 * a * s) / t  # flash, SwiGLU, no dropout, MBS 1
    acts = (L + 1) * layer + 4 * sbh + (2 + 4) * s * V / t  # + backward working set, final norm, logits
    return states + acts + FRAMEWORK_OVERHEAD_BYTES


def test_llama3_8b_tp2_seq8192_with_te_is_planned_within_5_percent_of_hand():
    cfg = compose_config(LLAMA)
    plan = planner.plan(cfg, profile=None)
    assert plan.recipe.attention == "flash" and plan.layout.tensor_model_parallel_size == 2
    st = plan.worst
    h, f, V, L, t = 4096, 14336, 128256, 32, 2
    params = L * ((h * 6144 + h * h + 3 * h * f) // t + 2 * h) + 2 * V * h // t + h
    assert st.params == params
    assert (st.weights, st.gradients, st.optimizer) == (2 * params, 4 * params, 12 * params / 4)
    assert plan.peak_bytes == pytest.approx(_llama_by_hand(), rel=0.05)
    assert plan.fits and plan.peak_bytes < 70 * GiB
    text = format_plan(plan)
    assert "activations (no recompute, flash attention)" in text
    assert (
        "note: attention: flash/fused (Transformer Engine's TEDotProductAttention, model.transformer_impl=auto" in text
    )


def test_llama3_8b_unfused_plan_is_the_local_spec_and_unchanged():
    local = planner.plan(compose_config(LLAMA + ["model.transformer_impl=local"]), profile=None)
    assert local.recipe.attention == "unfused" and not local.fits
    assert local.reason.startswith("does not fit")
    lay, sh = local.layout, local.shape
    unfused = planner.plan_layout(
        lay, sh, dataclasses.replace(local.recipe, attention="unfused"), local.gpu, gpus_per_node=8
    )
    assert local.peak_bytes == unfused.peak_bytes
    # the scores: 2 a s^2 b bytes per layer over TP (no dropout), 32 layers + the working set
    flash = planner.plan(compose_config(LLAMA), profile=None)
    scores = 2 * 32 * 8192 * 8192 / 2 - 4 * 32 * 8192 / 2
    assert local.worst.activations - flash.worst.activations == pytest.approx(33 * scores)
    assert "attention: unfused (model.transformer_impl=local" in format_plan(local)


def test_the_seed_experiment_says_which_kernel_it_assumed():
    plan = planner.plan(compose_config(["+experiment=llama3_8b_a100x32"]), profile=None)
    assert plan.recipe.attention == "flash"
    assert any(n.startswith("attention: flash/fused") for n in plan.notes)
    cpu = planner.plan(compose_config(["+experiment=llama3_8b_a100x32", "gpu=cpu"]), profile=None)
    assert cpu.recipe.attention == "unfused"
    assert any(n.startswith("attention: unfused (on CPU: no Transformer Engine") for n in cpu.notes)
