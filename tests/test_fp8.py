"""FP8 (``training.fp8``, issue 37 item 4), pure: Megatron-LM's parser's fields (the golden
tests/golden/megatron/llama_8b_tp2_fp8_hybrid_4x8.json, compared field by field in tests/test_megatron_config.py),
the refusals on CPU and without Transformer Engine, a resume that switches FP8, and the planner's bytes by hand.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config.compose import compose_config

GOLDEN = Path(__file__).parent / "golden" / "megatron"
FP8_8B = json.loads((GOLDEN / "llama_8b_tp2_fp8_hybrid_4x8.json").read_text())


def _built(overrides, device="cuda", te=True):
    from orchestrator.config.layout import layout_from_config
    from orchestrator.runtime.rank.mcore import version
    from orchestrator.runtime.rank.megatron_config import Installed, build

    cfg = compose_config(list(overrides))
    return build(cfg, device, Installed(te, te, version()), layout_from_config(cfg).data_parallel_size).as_json()


@pytest.mark.mcore_lines
def test_megatron_lm_s_fp8_fields_are_ours_and_only_they_differ_from_bf16():
    bf16 = json.loads((GOLDEN / "llama_8b_tp2_distopt_a100_4x8.json").read_text())
    differ = {f"{s}.{k}" for s in ("transformer", "ddp", "optimizer") for k in FP8_8B[s] if FP8_8B[s][k] != bf16[s][k]}
    assert differ == {"transformer.fp8", "transformer.fp8_amax_history_len", "transformer.fp8_amax_compute_algo"}
    assert ["--fp8-format", "hybrid"] == FP8_8B["flags"][FP8_8B["flags"].index("--fp8-format") :][:2]
    ours = _built(FP8_8B["overrides"])
    for name in ("fp8", "fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_param", "fp8_margin"):
        assert ours["transformer"][name] == FP8_8B["transformer"][name], name
    assert (ours["transformer"]["fp8"], ours["transformer"]["fp8_amax_history_len"]) == ("hybrid", 1024)
    assert ours["optimizer"]["fp8_recipe"] == FP8_8B["optimizer"]["fp8_recipe"] == "delayed"


def test_fp8_is_refused_in_one_line_on_cpu_and_on_the_local_layer_spec():
    from orchestrator.config.checks import validate
    from orchestrator.errors import ConfigError

    with pytest.raises(ConfigError) as cpu:
        _built(["training.fp8=hybrid", "training.device=cpu"], device="cpu", te=False)
    assert str(cpu.value).startswith("training.fp8=hybrid: FP8 GEMMs are Transformer Engine's and run on GPUs only")
    with pytest.raises(ConfigError) as no_te:  # a GPU node without Transformer Engine: auto falls back to local
        _built(FP8_8B["overrides"], te=False)
    text = str(no_te.value)
    assert "\n" not in text and "model.transformer_impl=auto: Transformer Engine is not installed" in text
    assert text.endswith(
        "fix: pip install transformer-engine[pytorch] on the GPU nodes and "
        "model.transformer_impl=auto, or training.fp8=null"
    )
    with pytest.raises(ConfigError, match=r"^training.fp8=e4m3: needs Transformer Engine's layers.*=local: asked"):
        validate(compose_config([*FP8_8B["overrides"], "training.fp8=e4m3", "model.transformer_impl=local"]))


def test_a_resume_may_switch_fp8_on_or_off_and_says_so_in_its_own_line():
    from orchestrator.ckpt.megatron_resume import check_megatron_config
    from orchestrator.ckpt.mismatch import WARN, key_kind

    fp8 = _built(FP8_8B["overrides"])
    bf16 = _built([*FP8_8B["overrides"][:-6], *FP8_8B["overrides"][-3:]])  # no training.fp8*: Megatron-LM's defaults
    assert bf16["transformer"]["fp8"] is None and bf16["transformer"]["fp8_amax_history_len"] == 1
    said = []
    carried = check_megatron_config({"megatron_config": bf16}, fp8, "ckpt", said.append)
    assert [k for k, _, _ in carried] == [
        "transformer.fp8",
        "transformer.fp8_amax_compute_algo",
        "transformer.fp8_amax_history_len",
    ]  # (the optimizer's fp8_recipe: a line default, not compared)
    assert len(said) == 1 and said[0].startswith("resuming from ckpt with FP8 changed (training.fp8")
    assert "transformer.fp8 None -> hybrid" in said[0]
    said.clear()
    faster = json.loads(json.dumps(bf16))
    faster["ddp"]["overlap_grad_reduce"] = not faster["ddp"]["overlap_grad_reduce"]
    check_megatron_config({"megatron_config": fp8}, faster, "ckpt", said.append)  # off again, and a speed change
    assert len(said) == 2 and "overlap_grad_reduce" in said[0] and "transformer.fp8 hybrid -> None" in said[1]
    assert key_kind("training.fp8") == key_kind("training.fp8_amax_history_len") == WARN  # the launcher's compare


def test_planned_fp8_bytes_by_hand():
    """Llama-3-8B TP2 PP2 (16 layers a stage) and Mixtral 8x7B TP1 EP8 PP4 (8 a stage), history 1024, delayed."""
    from orchestrator.config.layout import layout_from_config
    from orchestrator.plan.memory import plan

    llama = ["+experiment=llama3_8b_a100x32", "gpu=H100", "training.fp8_amax_history_len=1024"]
    # GEMM weights per layer and GPU: QKV 4096 x (4096 + 2 x 1024) + projection 4096^2 = 41,943,040, SwiGLU
    # 3 x 4096 x 14336 = 176,160,768; / TP 2 = 109,051,904; x 2 B = 218,103,808
    # amax: 4 GEMMs x 5 tensors x (1024 + 2) fp32 = 82,080 B
    per_layer = 2 * (41_943_040 + 176_160_768) // 2 + 4 * 5 * 1026 * 4
    assert per_layer == 218_185_888
    off = plan(compose_config(llama))
    on = plan(compose_config([*llama, "training.fp8=hybrid"]))
    assert [st.fp8 for st in off.stages] == [0, 0]
    assert [st.fp8 for st in on.stages] == [16 * per_layer] * 2
    assert [b.total - a.total for a, b in zip(off.stages, on.stages)] == [16 * per_layer] * 2
    assert any(n.startswith("fp8: training.fp8=hybrid (delayed, amax history 1024)") for n in on.notes)
    current = plan(compose_config([*llama, "training.fp8=hybrid", "training.fp8_recipe=tensorwise"]))
    assert current.stages[0].fp8 == 16 * 218_103_808  # no amax history without delayed scaling
    # Mixtral: attention 41,943,040 + 8 experts x 176,160,768 / (TP 1 x EP 8); GEMMs 2 + 2 x 1 local expert
    mixtral = compose_config(
        ["+experiment=mixtral_8x7b_a100x32", "training.fp8=e4m3", "training.fp8_amax_history_len=1024"]
    )
    layout = layout_from_config(mixtral)
    assert (layout.expert_model_parallel_size, layout.layers_per_stage) == (8, 8)
    assert plan(mixtral).stages[0].fp8 == 8 * (2 * (41_943_040 + 176_160_768) + 4 * 5 * 1026 * 4)
