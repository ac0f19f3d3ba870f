"""Llama- and Mixtral-shaped presets (issue 31, item 1): the planner's parameter counts against the published
ones, the vocabulary a preset plans with, and the A100 x 32 experiments plan and dry-run. Pure: no torch."""

from __future__ import annotations

import pytest
from conftest import run_cli

from orchestrator.config.compose import compose_config
from orchestrator.config.layout import layout_from_config, padded_vocab_size
from orchestrator.plan.inputs import ModelShape, vocab_size_of
from orchestrator.plan.params import active_params, total_params

PUBLISHED = {  # model: (total, active per token), parameters (Meta 2024; Jiang et al. 2024)
    "llama3_8b": (8.03e9, 8.03e9),
    "llama3_70b": (70.6e9, 70.6e9),
    "mixtral_8x7b": (46.7e9, 12.9e9),
}


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_planner_counts_match_the_published_parameters_within_half_a_percent(model):
    cfg = compose_config([f"model={model}"])
    vocab, note = vocab_size_of(cfg)
    shape = ModelShape.from_model_config(cfg.model, vocab)
    layout = layout_from_config(cfg)
    vp = padded_vocab_size(vocab, cfg.model.make_vocab_size_divisible_by, 1)
    total, active = PUBLISHED[model]
    assert abs(total_params(shape, layout, vp) - total) <= 0.005 * total
    assert abs(active_params(shape, layout, vp) - active) <= 0.005 * active
    assert vocab == (32000 if model == "mixtral_8x7b" else 128256)
    assert f"model.vocab_size={vocab}" in note  # the plan says which vocabulary it used


def test_the_datas_tokenizer_wins_over_the_presets_vocabulary(tmp_path):
    """A NullTokenizer of 50257 ids (the data says otherwise): the plan uses 50257 and says the preset's is unused;
    a preset without model.vocab_size keeps the byte tokenizer's 258 silently (as before)."""
    cfg = compose_config(["model=llama3_8b", "data=mock", "data.tokenizer=NullTokenizer", "data.vocab_size=50257"])
    vocab, note = vocab_size_of(cfg)
    assert vocab == 50257 and "model.vocab_size=128256 not used" in note
    assert vocab_size_of(compose_config(["model=llama_tiny"])) == (258, None)


@pytest.mark.parametrize("model", ["llama_tiny", "moe_tiny"])
def test_tiny_presets_have_the_real_layer_shapes(model):
    m = compose_config([f"model={model}"]).model
    assert (
        m.position_embedding_type,
        m.normalization,
        m.activation,
        m.add_bias_linear,
        m.untie_embeddings_and_output_weights,
    ) == ("rope", "RMSNorm", "swiglu", False, True)
    assert m.num_query_groups < m.num_attention_heads and m.vocab_size is None
    assert (m.num_moe_experts, m.moe_router_topk) == ((4, 2) if model == "moe_tiny" else (None, 2))


@pytest.mark.parametrize(
    "experiment,line",
    [("llama3_8b_a100x32", "total 8.03 B"), ("mixtral_8x7b_a100x32", "active per token 12.88 B (top-2 of 8 experts)")],
)
def test_a100x32_experiments_plan_and_dry_run(tmp_path, cache_dir, experiment, line):
    """The seed's cluster (4 x 8 A100-40GB): each experiment plans to a fit and dry-runs to an sbatch script
    (space_check off: this machine's disk cannot hold their checkpoints, which a dry run rightly refuses)."""
    common = [f"+experiment={experiment}", f"run.root={tmp_path}"]
    plan = run_cli(common + ["plan=true"], cache=cache_dir)
    assert line in plan.stdout and "verdict: fits" in plan.stdout and "on A100-40GB" in plan.stdout
    dry = run_cli(common + ["dry_run=true", "checkpoint.space_check=false"], cache=cache_dir)
    assert "#SBATCH --nodes=4" in dry.stdout and "would start fresh" in dry.stdout
    assert not (tmp_path / experiment).exists()  # a dry run writes nothing


def test_presets_carry_the_published_rope_base_and_export_it_with_their_vocabulary():
    """Llama 3: RoPE theta 500,000; Mixtral: 1,000,000 (Megatron-LM's Mixtral example: --rotary-base 1000000); the GPT
    presets keep megatron-core's 10,000. `convert to-megatron` says --rotary-base and the vocabulary the model is
    built with (Llama 3's 128256, not the byte tokenizer's 258)."""
    from orchestrator.config.compose import compose_config
    from orchestrator.convert.cli import check
    from orchestrator.convert.from_config import export

    bases = {m: compose_config([f"model={m}"]).model.rotary_base for m in ("llama3_8b", "llama3_70b", "mixtral_8x7b")}
    assert bases == {"llama3_8b": 500000, "llama3_70b": 500000, "mixtral_8x7b": 1000000}
    assert compose_config(["model=gpt_1.3b"]).model.rotary_base == 10000
    cfg = compose_config(["+experiment=llama3_8b_a100x32"])
    text = export(cfg, ["+experiment=llama3_8b_a100x32"], check(cfg)[0].world_size)
    assert "--rotary-base 500000 " in text and "--vocab-size 128256 " in text and "--vocab-size 258" not in text
    scaled = compose_config(["model=llama_tiny", "model.rope_scaling=llama3"])
    assert "--use-rope-scaling " in export(scaled, [], check(scaled)[0].world_size)
