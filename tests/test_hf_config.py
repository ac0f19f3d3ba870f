"""Issue 38: a transformers config.json -> model.* keys; an unsupported architecture is one line naming the list."""

import pytest

from orchestrator.convert import hf_config

transformers = pytest.importorskip("transformers")


def test_llama_and_mixtral_configs_map_and_gpt_neox_is_refused():
    llama = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=500000.0,
        architectures=["LlamaForCausalLM"],
    ).to_dict()
    keys, unmapped = hf_config.model_keys(llama)
    assert keys["num_query_groups"] == 2 and keys["ffn_hidden_size"] == 48 and keys["vocab_size"] == 50
    assert keys["untie_embeddings_and_output_weights"] is True and unmapped == [
        "rope_theta=500000.0",
        "rms_norm_eps=1e-06",
    ]
    mix = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, architectures=["MixtralForCausalLM"])
    keys, _ = hf_config.model_keys(mix.to_dict())
    assert (keys["num_moe_experts"], keys["moe_router_topk"]) == (4, 2)
    with pytest.raises(hf_config.HfConfigError, match="GPTNeoXForCausalLM is not supported; supported: Llama") as e:
        hf_config.model_keys({"architectures": ["GPTNeoXForCausalLM"]})
    assert "\n" not in str(e.value)
