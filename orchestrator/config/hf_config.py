"""A Hugging Face ``config.json`` -> our ``model.*`` keys (issue 38: ``convert from-hf`` and ``checkpoint.init_from=hf:``).

Pure: no torch. Field names are transformers' (``LlamaConfig``, ``MistralConfig``, ``MixtralConfig``,
``Qwen2Config``, ``GPT2Config``). Errors: :class:`HfConfigError`, one ``error:`` line naming the value, the
supported list or the fix.

GPT-2 (:func:`gpt2_keys`) is megatron-core's default GPT layer: learned absolute positions, LayerNorm with bias,
biases on every linear, multi-head attention, GELU. Its ``gelu_new`` is GELU's tanh approximation, which is what
megatron-core computes for ``model.activation=gelu`` with ``model.add_bias_linear=true``: the fused bias-GELU
(``bias_activation_fusion``, ``fusions/fused_bias_gelu.py``; 2.4e-7 apart in fp32 on [-20, 20], where exact GELU
is 4.7e-4 apart).
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel")

TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
"""transformers' names of GELU's tanh approximation (``activations.py``): the GPT-2 activations we build."""

WEIGHTLESS = ("max_position_embeddings", "vocab_size", "hidden_dropout", "attention_dropout")
"""``model.*`` keys :func:`shape_problems` leaves to the job: no weight's shape follows from them (RoPE has no
position weights; the vocabulary is the job's tokenizer's; dropout is training only)."""

LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama 3.1 ``rope_scaling`` values megatron-core's ``apply_rope_scaling`` uses (its defaults; Llama 3.1's
published config): a config.json with others is refused rather than trained as another model."""

HF_PREFIX = "hf:"
"""``checkpoint.init_from=hf:PATH``: a Hugging Face directory (``config.json`` + ``*.safetensors``)."""


class HfConfigError(ValueError):
    """A config.json we cannot map: one line naming the value and the fix."""


def hf_path(init_from: Any) -> str | None:
    """The directory of ``checkpoint.init_from=hf:PATH`` (user-expanded), or None for another value."""
    if isinstance(init_from, str) and init_from.startswith(HF_PREFIX):
        return os.path.expanduser(init_from[len(HF_PREFIX) :])
    return None


def read_config(path: str) -> Dict[str, Any]:
    """``PATH/config.json`` as a dict; HfConfigError (one line) when it is missing or not JSON."""
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            return json.load(f)
    except FileNotFoundError:
        raise HfConfigError(
            f"{file}: not found; fix: a Hugging Face model directory (config.json, *.safetensors)"
        ) from None
    except ValueError as exc:
        raise HfConfigError(f"{file}: not JSON ({exc})") from None


def architecture(config: dict) -> str:
    """The single architecture named by ``config["architectures"]``; refuses anything outside :data:`SUPPORTED`."""
    archs = config.get("architectures") or [config.get("model_type", "?")]
    if len(archs) != 1 or archs[0] not in SUPPORTED:
        raise HfConfigError(
            f"Hugging Face architecture {'/'.join(map(str, archs))} is not supported; supported: {', '.join(SUPPORTED)}"
        )
    return archs[0]


def _rope(config: dict) -> Dict[str, Any]:
    scaling = config.get("rope_scaling")
    out: Dict[str, Any] = {"rotary_base": int(config.get("rope_theta", 10000.0))}
    if not scaling:
        return out
    kind = scaling.get("rope_type", scaling.get("type"))
    others = {k: scaling.get(k) for k in LLAMA3_ROPE if scaling.get(k) != LLAMA3_ROPE[k]}
    if kind != "llama3" or others:
        raise HfConfigError(
            f"config.json rope_scaling={scaling}: megatron-core applies only Llama 3.1's (rope_type llama3 with "
            f"{LLAMA3_ROPE}); this model would train with other positions"
        )
    return {**out, "rope_scaling": "llama3", "rope_scaling_factor": float(scaling["factor"])}


def model_keys(config: dict) -> Dict[str, Any]:
    """The ``model.*`` keys of a supported config.json dict (HfConfigError otherwise, one line: also for a key the
    architecture's config needs that config.json lacks)."""
    arch = architecture(config)
    try:
        return _keys_of(arch, config)
    except KeyError as exc:
        raise HfConfigError(
            f"config.json has no {exc.args[0]!r}, which a {arch} config needs; fix: a complete config.json "
            f"(as transformers' save_pretrained writes it)"
        ) from None


def _keys_of(arch: str, config: dict) -> Dict[str, Any]:
    if arch == "GPT2LMHeadModel":
        return gpt2_keys(config)
    heads = config["num_attention_heads"]
    keys: Dict[str, Any] = {
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "ffn_hidden_size": config["intermediate_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "position_embedding_type": "rope",
        **_rope(config),
        "normalization": "RMSNorm",
        "activation": "swiglu",
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "vocab_size": config["vocab_size"],
    }
    if config.get("head_dim") not in (None, config["hidden_size"] // heads):
        raise HfConfigError(
            f"config.json head_dim={config['head_dim']}: megatron-core's GPT layer uses hidden_size / "
            f"num_attention_heads = {config['hidden_size'] // heads}"
        )
    if arch == "MixtralForCausalLM":
        keys["num_moe_experts"] = config["num_local_experts"]
        keys["moe_router_topk"] = config["num_experts_per_tok"]
    if config.get("attention_bias"):  # Llama's: o_proj too, which megatron-core biases only with every linear
        raise HfConfigError(
            "config.json attention_bias=true: megatron-core has no layer with biases on Q, K, V and "
            "the output projection only"
        )
    if arch == "Qwen2ForCausalLM":
        keys["add_qkv_bias"] = True
    keys["norm_epsilon"] = config.get("rms_norm_eps", 1e-6)  # transformers' Llama default
    return keys


def gpt2_keys(config: dict) -> Dict[str, Any]:
    """The ``model.*`` keys of a GPT-2 config.json (``GPT2Config``'s ``n_*`` names; ``n_inner`` null is 4 x
    ``n_embd``; ``tie_word_embeddings`` defaults to true there); HfConfigError for a variant megatron-core's layer
    does not compute (another activation, attention scaled otherwise than by 1/sqrt(head dim))."""
    act = config.get("activation_function", "gelu_new")
    if act not in TANH_GELU:
        raise HfConfigError(
            f"config.json activation_function={act}: megatron-core's GPT layer with biases computes GELU's tanh "
            f"approximation ({', '.join(TANH_GELU)})"
        )
    if config.get("scale_attn_by_inverse_layer_idx") or not config.get("scale_attn_weights", True):
        raise HfConfigError(
            "config.json scale_attn_by_inverse_layer_idx / scale_attn_weights: megatron-core scales attention "
            "scores by 1/sqrt(head dim) only (GPT-2's default: false / true)"
        )
    return {
        "num_layers": config["n_layer"],
        "hidden_size": config["n_embd"],
        "num_attention_heads": config["n_head"],
        "num_query_groups": config["n_head"],
        "ffn_hidden_size": config.get("n_inner") or 4 * config["n_embd"],
        "max_position_embeddings": config["n_positions"],
        "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm",
        "activation": "gelu",
        "add_bias_linear": True,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True),
        "vocab_size": config["vocab_size"],
        "norm_epsilon": config.get("layer_norm_epsilon", 1e-5),
        "hidden_dropout": config.get("resid_pdrop", 0.1),
        "attention_dropout": config.get("attn_pdrop", 0.1),
    }


def shape_problems(config: dict, model: Any) -> List[str]:
    """``key: ours X, config.json Y`` for every ``model.*`` key of ``model`` (a ModelConfig) that differs from what
    config.json builds (:data:`WEIGHTLESS` keys may differ, except learned position embeddings' rows); empty when
    the weights fit."""
    keys = model_keys(config)
    out = []
    for key, want in keys.items():
        learned = key == "max_position_embeddings" and keys["position_embedding_type"] == "learned_absolute"
        if key in WEIGHTLESS and not learned:
            continue
        have = getattr(model, key)
        if key == "num_query_groups" and have is None:
            have = model.num_attention_heads
        if key == "ffn_hidden_size" and have is None:
            have = 4 * model.hidden_size
        if have != want and not (isinstance(want, float) and abs(have - want) < 1e-9):
            out.append(f"model.{key}: ours {have!r}, config.json {want!r}")
    return out
