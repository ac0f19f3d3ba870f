"""A checkpoint of any layout -> a Hugging Face directory that ``transformers.AutoModelForCausalLM.from_pretrained``
loads (issue 38 item 2): ``config.json``, ``generation_config.json``, safetensors shards with their index, and the
tokenizer when the run used a Hugging Face one.

megatron-core's torch_dist checkpoints store every tensor whole, whatever the layout that saved it (the
dist_checkpointing format: a TP shard is a fragment of one global tensor; layers are stacked on a leading axis of
``decoder.layers.*``, experts on the next one of ``decoder.layers.mlp.experts.experts.*``; SwiGLU's ``linear_fc1`` is
``[gate; up]`` however TP split it, by ``apply_swiglu_sharded_factory``'s offsets), so each tensor is read with
``torch.distributed.checkpoint`` (no process group, no model built) and mapped by
:mod:`orchestrator.runtime.rank.hf_llama`. Memory: one stacked tensor read at a time plus the converted model.
Raises ValueError (one line) for a model Hugging Face's Llama family cannot hold.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, List

import torch

from orchestrator.runtime.rank import hf_files, hf_llama

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


def architecture_of(manifest: dict) -> str:
    """The Hugging Face architecture a run's model is written as: the imported one, else Mixtral with experts,
    Qwen2 with QKV bias, else Llama. ValueError for a model outside the Llama family."""
    m = manifest["config"]["model"]
    problems = [
        f"model.{k}={m.get(k)!r} (needs {v!r})"
        for k, v in (
            ("normalization", "RMSNorm"),
            ("activation", "swiglu"),
            ("position_embedding_type", "rope"),
            ("add_bias_linear", False),
        )
        if m.get(k) != v
    ]
    if problems:
        raise ValueError(f"Hugging Face's Llama family cannot hold this model: {', '.join(problems)}")
    hf = (manifest.get("origin") or {}).get("hf") or {}
    if hf.get("architecture"):
        return hf["architecture"]
    if m.get("num_moe_experts"):
        return "MixtralForCausalLM"
    return "Qwen2ForCausalLM" if m.get("add_qkv_bias") else "LlamaForCausalLM"


def hf_config(manifest: dict, arch: str, dtype: torch.dtype):
    """transformers' config object for the run's model as ``arch``."""
    import transformers

    from orchestrator.config.hf_config import LLAMA3_ROPE

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
    tensors = hf_llama.to_hf(mc, m["num_layers"], heads, groups, manifest["model"]["vocab_size"], fused_norm=True)
    if not m["untie_embeddings_and_output_weights"]:
        tensors.pop("lm_head.weight", None)
    os.makedirs(out, exist_ok=True)
    dtype = tensors["model.embed_tokens.weight"].dtype
    config = hf_config(manifest, arch, dtype)
    config.save_pretrained(out)
    import transformers

    transformers.GenerationConfig.from_model_config(config).save_pretrained(out)
    return hf_files.write_shards(out, tensors, max_shard_bytes)
