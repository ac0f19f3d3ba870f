"""Issue 38: a transformers config.json -> model.* keys; an unsupported architecture is one line naming the list."""

import pytest

from orchestrator.config import hf_config
from orchestrator.config.model_schema import ModelConfig

transformers = pytest.importorskip("transformers")

TINY = dict(
    vocab_size=50,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
"""A tiny Llama shape (GQA: 4 heads in 2 KV groups)."""


def test_llama_qwen_and_mixtral_configs_map_and_gpt_neox_is_refused():
    llama = transformers.LlamaConfig(
        **TINY,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        architectures=["LlamaForCausalLM"],
    ).to_dict()
    keys = hf_config.model_keys(llama)
    assert keys["num_query_groups"] == 2 and keys["ffn_hidden_size"] == 48 and keys["vocab_size"] == 50
    assert (keys["rotary_base"], keys["rope_scaling"], keys["rope_scaling_factor"]) == (500000, "llama3", 8.0)
    assert keys["untie_embeddings_and_output_weights"] is True and keys["norm_epsilon"] == 1e-06
    qwen = transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True).to_dict()
    keys = hf_config.model_keys(qwen)
    assert keys["add_qkv_bias"] is True and keys["untie_embeddings_and_output_weights"] is False
    mix = transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, architectures=["MixtralForCausalLM"])
    keys = hf_config.model_keys(mix.to_dict())
    assert (keys["num_moe_experts"], keys["moe_router_topk"], keys["rotary_base"]) == (4, 2, 1000000)
    with pytest.raises(hf_config.HfConfigError, match="GPTNeoXForCausalLM is not supported; supported: Llama") as e:
        hf_config.model_keys({"architectures": ["GPTNeoXForCausalLM"]})
    assert "\n" not in str(e.value)
    llama["rope_scaling"]["high_freq_factor"] = 2.0
    with pytest.raises(hf_config.HfConfigError, match="megatron-core applies only Llama 3.1's"):
        hf_config.model_keys(llama)


def test_shape_problems_name_each_key_that_differs():
    cfg = transformers.LlamaConfig(
        **TINY,
        rms_norm_eps=1e-5,
        architectures=["LlamaForCausalLM"],
    ).to_dict()
    keys = hf_config.model_keys(cfg)
    model = ModelConfig(**{k: v for k, v in keys.items()})
    assert hf_config.shape_problems(cfg, model) == []
    model.num_layers, model.num_query_groups = 3, None
    assert hf_config.shape_problems(cfg, model) == [
        "model.num_layers: ours 3, config.json 2",
        "model.num_query_groups: ours 4, config.json 2",
    ]


def test_gpt2_maps_to_megatron_cores_default_layer_and_its_variants_are_refused():
    gpt2 = transformers.GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=64).to_dict()
    gpt2["architectures"] = ["GPT2LMHeadModel"]
    keys = hf_config.model_keys(gpt2)
    assert keys == {
        "num_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_query_groups": 4,
        "ffn_hidden_size": 128,  # n_inner null: 4 x n_embd
        "max_position_embeddings": 64,
        "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm",
        "activation": "gelu",  # with biases: megatron-core's fused bias-GELU, the tanh approximation (gelu_new)
        "add_bias_linear": True,
        "untie_embeddings_and_output_weights": False,
        "vocab_size": 50,
        "norm_epsilon": 1e-5,
        "hidden_dropout": 0.1,
        "attention_dropout": 0.1,
    }
    model = ModelConfig(**keys)
    model.hidden_dropout, model.max_position_embeddings = 0.0, 128  # dropout is the job's; position rows are weights
    assert hf_config.shape_problems(gpt2, model) == ["model.max_position_embeddings: ours 128, config.json 64"]
    for bad, said in (
        ({"activation_function": "gelu"}, "activation_function=gelu: megatron-core's GPT layer with biases"),
        ({"scale_attn_by_inverse_layer_idx": True}, r"scales attention scores by 1/sqrt\(head dim\) only"),
    ):
        with pytest.raises(hf_config.HfConfigError, match=said) as e:
            hf_config.model_keys({**gpt2, **bad})
        assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "config, missing",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "'n_layer', which a GPT2LMHeadModel config needs"),
        ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, "'num_attention_heads', which a LlamaForCausalLM"),
    ],
)
def test_a_config_json_missing_a_key_is_one_line_naming_it(config, missing):
    with pytest.raises(hf_config.HfConfigError, match=f"^config.json has no {missing}"):
        hf_config.model_keys(config)
