"""A Hugging Face ``config.json`` -> our ``model.*`` keys (issue 38 item 1, ``convert from-hf``). Pure: no torch.

Field names are transformers' (``LlamaConfig``, ``MistralConfig``, ``MixtralConfig``, ``Qwen2Config``).
Errors: :class:`HfConfigError`, one ``error:`` line naming the architecture and the supported list.
``unmapped`` lists config values no ``model.*`` key holds yet (RoPE θ / scaling, norm ε, QKV bias), so a caller
can refuse or warn rather than train a different model silently.
"""

from __future__ import annotations

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM")


class HfConfigError(ValueError):
    """A config.json we cannot map: one line naming the value and the fix."""


def architecture(config: dict) -> str:
    """The single architecture named by ``config["architectures"]``; refuses anything outside :data:`SUPPORTED`."""
    archs = config.get("architectures") or [config.get("model_type", "?")]
    if len(archs) != 1 or archs[0] not in SUPPORTED:
        raise HfConfigError(
            f"error: Hugging Face architecture {'/'.join(map(str, archs))} is not supported; "
            f"supported: {', '.join(SUPPORTED)}"
        )
    return archs[0]


def model_keys(config: dict) -> tuple[dict, list[str]]:
    """``(model.* overrides, unmapped "key=value" strings)`` for a supported config.json dict."""
    arch = architecture(config)
    heads = config["num_attention_heads"]
    keys = {
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "ffn_hidden_size": config["intermediate_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "position_embedding_type": "rope",
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "vocab_size": config["vocab_size"],
    }
    if arch == "MixtralForCausalLM":
        keys["num_moe_experts"] = config["num_local_experts"]
        keys["moe_router_topk"] = config["num_experts_per_tok"]
    unmapped = []
    if config.get("rope_theta", 10000.0) != 10000.0:
        unmapped.append(f"rope_theta={config['rope_theta']}")
    if config.get("rope_scaling"):
        unmapped.append(f"rope_scaling={config['rope_scaling']}")
    if config.get("rms_norm_eps", 1e-5) != 1e-5:
        unmapped.append(f"rms_norm_eps={config['rms_norm_eps']}")
    if arch == "Qwen2ForCausalLM" or config.get("attention_bias"):
        unmapped.append("attention bias (QKV bias)")
    return keys, unmapped
