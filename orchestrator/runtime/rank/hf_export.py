"""A checkpoint of any layout -> a Hugging Face directory that ``transformers.AutoModelForCausalLM.from_pretrained``
loads (issue 38 item 2): ``config.json``, ``generation_config.json``, safetensors shards with their index, and the
tokenizer when the run used a Hugging Face one.

megatron-core's torch_dist checkpoints store every tensor whole, whatever the layout that saved it (the
dist_checkpointing format: a TP shard is a fragment of one global tensor; layers are stacked on a leading axis of
``decoder.layers.*``, experts on the next one of ``decoder.layers.mlp.experts.experts.*``; SwiGLU's ``linear_fc1`` is
``[gate; up]`` however TP split it, by ``apply_swiglu_sharded_factory``'s offsets), so the tensors are read with
``torch.distributed.checkpoint`` (no process group, no model built), one decoder layer's slices at a time
(:mod:`orchestrator.runtime.rank.dcp_layers`), mapped by the family's module
(:mod:`orchestrator.runtime.rank.hf_llama` or :mod:`orchestrator.runtime.rank.hf_gpt2`) and appended to the shard
being written (issue 38 item 3: streaming). Memory: one layer's tensors (or the embedding's) as stored and as
mapped, whatever the model size (:func:`export`). Raises ValueError (one line) for a model neither Hugging Face's
Llama family nor GPT-2 can hold.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from orchestrator.runtime.rank import dcp_layers, hf_files
from orchestrator.runtime.rank.hf_import import family

_LAYERS = "decoder.layers."
_EXPERTS = "decoder.layers.mlp.experts.experts."
_EMBEDDING = "embedding.word_embeddings.weight"
_OUTPUT = "output_layer.weight"


def layer_state(stacked: Dict[str, torch.Tensor], i: int) -> Dict[str, torch.Tensor]:
    """megatron-core's per-layer (TP1, Transformer Engine's norm names) state dict of decoder layer ``i`` from its
    slices of the stacked checkpoint tensors (``decoder.layers.X`` -> ``decoder.layers.{i}.X``; experts
    ``decoder.layers.mlp.experts.experts.X`` [E, ...] -> ``decoder.layers.{i}.mlp.experts.local_experts.{e}.X``)."""
    out: Dict[str, torch.Tensor] = {}
    for key, t in stacked.items():
        if key.startswith(_EXPERTS):
            for e in range(t.shape[0]):
                out[f"{_LAYERS}{i}.mlp.experts.local_experts.{e}.{key[len(_EXPERTS) :]}"] = t[e]
        else:
            out[f"{_LAYERS}{i}.{key[len(_LAYERS) :]}"] = t
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


class _Units:
    """The export's units, in writing order: the tensors outside the decoder layers but the output layer (the
    embeddings, the final norm), each decoder layer, then the output layer (untied only: a tied model's copy on the
    last stage is not written). Each unit maps alone, so at most one unit's tensors are held: its checkpoint
    slices and their Hugging Face tensors (:func:`mapped`)."""

    def __init__(self, stored: Dict[str, object], manifest: dict, fam):
        m = manifest["config"]["model"]
        self.fam = fam
        self.layers, self.vocab = m["num_layers"], manifest["model"]["vocab_size"]
        self.shape = (m["num_attention_heads"], m["num_query_groups"] or m["num_attention_heads"])
        if not m["untie_embeddings_and_output_weights"]:
            stored = {k: v for k, v in stored.items() if k != _OUTPUT}
        self.stacked = {k: v for k, v in stored.items() if k.startswith(_LAYERS)}
        self.outer = {k: v for k, v in stored.items() if not k.startswith(_LAYERS) and k != _OUTPUT}
        self.output = {k: v for k, v in stored.items() if k == _OUTPUT}
        meta = {k: torch.empty(md.size, dtype=md.properties.dtype, device="meta") for k, md in self.outer.items()}
        self.outer_meta = meta
        self.outer_names = set(fam.to_hf(meta, 0, *self.shape, self.vocab, fused_norm=True))

    def all(self) -> List[Tuple[Dict[str, object], Optional[int]]]:
        """(stored tensors, layer index or None) of every unit, in order."""
        units = [(self.outer, None), *[(self.stacked, i) for i in range(self.layers)]]
        return units + ([(self.output, None)] if self.output else [])

    def mapped(self, tensors: Dict[str, torch.Tensor], layer: Optional[int]) -> Dict[str, torch.Tensor]:
        """One unit's Hugging Face tensors from its checkpoint tensors (``meta`` ones: a dry run for the plan)."""
        if layer is not None:
            return self.fam.layer_to_hf(layer_state(tensors, layer), layer, *self.shape, fused_norm=True)
        if _OUTPUT not in tensors:
            return self.fam.to_hf(tensors, 0, *self.shape, self.vocab, fused_norm=True)
        whole = self.fam.to_hf({**self.outer_meta, **tensors}, 0, *self.shape, self.vocab, fused_norm=True)
        return {k: v for k, v in whole.items() if k not in self.outer_names}


def _meta(stored: Dict[str, object], layer: Optional[int]) -> Dict[str, torch.Tensor]:
    return {
        k: torch.empty(md.size if layer is None else md.size[1:], dtype=md.properties.dtype, device="meta")
        for k, md in stored.items()
    }


def export(ckpt_dir: str, manifest: dict, out: str, max_shard_bytes: int = 5 * 10**9, log=None) -> List[str]:
    """Write the Hugging Face directory ``out`` (created; must not hold files) from checkpoint ``ckpt_dir`` with
    its ``manifest``, one unit (:class:`_Units`) at a time: read its slices (:mod:`.dcp_layers`), map them, append
    them to the current shard (:class:`.hf_files.ShardWriter`, planned by a dry run on ``meta`` tensors), saying
    progress with an ETA through ``log`` (:class:`orchestrator.meter.Meter`, a line per layer). Peak memory: the
    largest unit's checkpoint tensors and their mapped copies (a decoder layer, or the embedding), plus one stored
    chunk; nothing of a shard is held. Returns the shard file names."""
    from orchestrator.meter import Meter, say

    arch = architecture_of(manifest)
    units = _Units(dcp_layers.model_tensors(ckpt_dir), manifest, family(arch))
    plan = [
        (name, t.shape, t.dtype) for stored, i in units.all() for name, t in units.mapped(_meta(stored, i), i).items()
    ]
    os.makedirs(out, exist_ok=True)
    config = hf_config(manifest, arch, units.outer[_EMBEDDING].properties.dtype)
    config.save_pretrained(out)
    import transformers

    transformers.GenerationConfig.from_model_config(config).save_pretrained(out)
    writer = hf_files.ShardWriter(out, plan, max_shard_bytes)
    done = [0]
    meter = Meter("writing", writer.total, lambda: {f"of {units.layers} layers": done[0]}, log or say, every=0.0)
    for stored, i in units.all():
        tensors = units.mapped(dcp_layers.read(ckpt_dir, stored, i), i)
        for name, t in tensors.items():
            writer.add(name, t)
        done[0] += i is not None
        meter.advance(sum(t.numel() * t.element_size() for t in tensors.values()))
        del tensors  # one unit at a time
    meter.close()
    return writer.close()
