"""A checkpoint of any layout -> a Hugging Face directory that ``transformers.AutoModelForCausalLM.from_pretrained``
loads (issue 38 item 2): ``config.json``, ``generation_config.json``, safetensors shards with their index, and the
tokenizer when the run used a Hugging Face one.

megatron-core's torch_dist checkpoints store every tensor whole, whatever the layout that saved it (the
dist_checkpointing format: a TP shard is a fragment of one global tensor; layers are stacked on a leading axis of
``decoder.layers.*``, experts on the next one of ``decoder.layers.mlp.experts.experts.*``; SwiGLU's ``linear_fc1`` is
``[gate; up]`` however TP split it, by ``apply_swiglu_sharded_factory``'s offsets), so each tensor is read with
``torch.distributed.checkpoint`` (no process group, no model built) and mapped by
:mod:`orchestrator.runtime.rank.hf_llama` or :mod:`orchestrator.runtime.rank.hf_gpt2`. Memory: one stacked tensor
read at a time plus the converted model. Raises ValueError (one line) for a model neither Hugging Face's Llama
family nor GPT-2 can hold.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, List

import torch

from orchestrator.runtime.rank import hf_files
from orchestrator.runtime.rank.hf_import import family

_LAYERS = "decoder.layers."
_EXPERTS = "decoder.layers.mlp.experts.experts."


def read_model_tensors(ckpt_dir: str) -> Dict[str, torch.Tensor]:
    """Every model tensor of the torch_dist checkpoint ``ckpt_dir`` (optimizer state and ``_extra_state`` left),
    whole, as stored."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(ckpt_dir)
    meta = reader.read_metadata().state_dict_metadata
    out: Dict[str, torch.Tensor] = {}
    for key, md in sorted(meta.items()):
        if key.startswith("optimizer") or "_extra_state" in key or not hasattr(md, "size"):
            continue
        box = {key: torch.empty(md.size, dtype=md.properties.dtype)}
        with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": as intended here
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(box, storage_reader=dcp.FileSystemReader(ckpt_dir), no_dist=True)
        out[key] = box[key]
    return out


def per_layer(stacked: Dict[str, torch.Tensor], layers: int) -> Dict[str, torch.Tensor]:
    """megatron-core's per-layer (TP1, local spec with Transformer Engine's norm names) state dict from the stacked
    checkpoint tensors."""
    out: Dict[str, torch.Tensor] = {}
    for key, t in stacked.items():
        if key.startswith(_EXPERTS):
            rest = key[len(_EXPERTS) :]
            for i in range(layers):
                for e in range(t.shape[1]):
                    out[f"{_LAYERS}{i}.mlp.experts.local_experts.{e}.{rest}"] = t[i, e]
        elif key.startswith(_LAYERS):
            for i in range(layers):
                out[f"{_LAYERS}{i}.{key[len(_LAYERS) :]}"] = t[i]
        else:
            out[key] = t
    return out


_NEEDS = {
    "GPT-2": (
        ("normalization", "LayerNorm"),
        ("activation", "gelu"),
        ("position_embedding_type", "learned_absolute"),
        ("add_bias_linear", True),
    ),
    "the Llama family": (
        ("normalization", "RMSNorm"),
        ("activation", "swiglu"),
        ("position_embedding_type", "rope"),
        ("add_bias_linear", False),
    ),
}
"""The ``model.*`` values each family written needs."""


def _unmet(m: dict, family_name: str) -> List[str]:
    out = [f"model.{k}={m.get(k)!r} (needs {v!r})" for k, v in _NEEDS[family_name] if m.get(k) != v]
    if family_name == "GPT-2":  # and multi-head attention, Q/K/V biases too, no experts
        if m.get("num_query_groups") not in (None, m["num_attention_heads"]):
            out.append(f"model.num_query_groups={m['num_query_groups']} (needs {m['num_attention_heads']})")
        if m.get("add_qkv_bias") is False:
            out.append("model.add_qkv_bias=False (needs null or true)")
        if m.get("num_moe_experts"):
            out.append(f"model.num_moe_experts={m['num_moe_experts']} (needs null)")
    return out


def architecture_of(manifest: dict) -> str:
    """The Hugging Face architecture a run's model is written as: the imported one, else GPT-2 for a GPT-2-shaped
    model (LayerNorm, GELU, learned positions, biases everywhere, multi-head attention), else Mixtral with experts,
    Qwen2 with QKV bias, else Llama. ValueError (one line naming each family's unmet values) for any other model."""
    m = manifest["config"]["model"]
    unmet = {name: _unmet(m, name) for name in _NEEDS}
    if all(unmet.values()):
        raise ValueError(
            "no supported Hugging Face architecture holds this model: "
            + "; ".join(f"{name}: {', '.join(problems)}" for name, problems in unmet.items())
        )
    hf = (manifest.get("origin") or {}).get("hf") or {}
    if hf.get("architecture"):
        return hf["architecture"]
    if not unmet["GPT-2"]:
        return "GPT2LMHeadModel"
    if m.get("num_moe_experts"):
        return "MixtralForCausalLM"
    return "Qwen2ForCausalLM" if m.get("add_qkv_bias") else "LlamaForCausalLM"


def _gpt2_config(manifest: dict, dtype: torch.dtype):
    import transformers

    m = manifest["config"]["model"]
    ffn = m["ffn_hidden_size"]
    return transformers.GPT2Config(
        architectures=["GPT2LMHeadModel"],
        vocab_size=manifest["model"]["vocab_size"],
        n_positions=m["max_position_embeddings"],
        n_embd=m["hidden_size"],
        n_layer=m["num_layers"],
        n_head=m["num_attention_heads"],
        n_inner=None if ffn in (None, 4 * m["hidden_size"]) else ffn,
        activation_function="gelu_new",
        layer_norm_epsilon=m.get("norm_epsilon", 1e-5),
        resid_pdrop=m.get("hidden_dropout", 0.0),
        embd_pdrop=m.get("hidden_dropout", 0.0),
        attn_pdrop=m.get("attention_dropout", 0.0),
        tie_word_embeddings=not m["untie_embeddings_and_output_weights"],
        torch_dtype=str(dtype).replace("torch.", ""),
    )


def hf_config(manifest: dict, arch: str, dtype: torch.dtype):
    """transformers' config object for the run's model as ``arch``."""
    import transformers

    from orchestrator.config.hf_config import LLAMA3_ROPE

    if arch == "GPT2LMHeadModel":
        return _gpt2_config(manifest, dtype)
    m = manifest["config"]["model"]
    kw = dict(
        architectures=[arch],
        vocab_size=manifest["model"]["vocab_size"],
        hidden_size=m["hidden_size"],
        intermediate_size=m["ffn_hidden_size"] or 4 * m["hidden_size"],
        num_hidden_layers=m["num_layers"],
        num_attention_heads=m["num_attention_heads"],
        num_key_value_heads=m["num_query_groups"] or m["num_attention_heads"],
        max_position_embeddings=m["max_position_embeddings"] or m["seq_length"],
        rms_norm_eps=m.get("norm_epsilon", 1e-5),
        rope_theta=float(m.get("rotary_base", 10000)),
        tie_word_embeddings=not m["untie_embeddings_and_output_weights"],
        torch_dtype=str(dtype).replace("torch.", ""),
    )
    if m.get("rope_scaling") == "llama3":
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": m["rope_scaling_factor"], **LLAMA3_ROPE}
    if arch == "MixtralForCausalLM":
        return transformers.MixtralConfig(
            **kw, num_local_experts=m["num_moe_experts"], num_experts_per_tok=m["moe_router_topk"]
        )
    classes = {"MistralForCausalLM": transformers.MistralConfig, "Qwen2ForCausalLM": transformers.Qwen2Config}
    return classes.get(arch, transformers.LlamaConfig)(**kw)


def export(ckpt_dir: str, manifest: dict, out: str, max_shard_bytes: int = 5 * 10**9) -> List[str]:
    """Write the Hugging Face directory ``out`` (created; must not hold files) from checkpoint ``ckpt_dir`` with
    its ``manifest``; returns the shard file names."""
    arch = architecture_of(manifest)
    m = manifest["config"]["model"]
    heads, groups = m["num_attention_heads"], m["num_query_groups"] or m["num_attention_heads"]
    mc = per_layer(read_model_tensors(ckpt_dir), m["num_layers"])
    to_hf = family(arch).to_hf
    tensors = to_hf(mc, m["num_layers"], heads, groups, manifest["model"]["vocab_size"], fused_norm=True)
    if not m["untie_embeddings_and_output_weights"]:
        tensors.pop("lm_head.weight", None)
    os.makedirs(out, exist_ok=True)
    dtype = mc["embedding.word_embeddings.weight"].dtype
    config = hf_config(manifest, arch, dtype)
    config.save_pretrained(out)
    import transformers

    transformers.GenerationConfig.from_model_config(config).save_pretrained(out)
    return hf_files.write_shards(out, tensors, max_shard_bytes)
