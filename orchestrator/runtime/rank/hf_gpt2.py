"""GPT-2 weight mapping between Hugging Face (``GPT2LMHeadModel``) and megatron-core GPTModel state dicts (TP1/PP1).

Pure tensor work (issue 38 item 1): no I/O, no process group. GPT-2's projections are ``Conv1D`` modules
(transformers ``pytorch_utils.Conv1D``: ``y = x @ W + b``, ``W`` stored [in, out]), so ``c_attn``, ``c_proj`` and
``c_fc`` weights are the transposes of megatron-core's ``nn.Linear``-shaped [out, in] ones. ``c_attn``'s output
columns are ``[q; k; v]`` (hidden each, heads contiguous inside); megatron-core's fused ``linear_qkv`` interleaves
them per head (``[q_h; k_h; v_h]``, :func:`orchestrator.runtime.rank.hf_llama.fuse_qkv` with as many KV groups as
heads), its bias likewise. Every linear and norm has a bias; the word embeddings (``wte``) are tied to the output
layer unless the directory stores ``lm_head.weight``; the position embeddings (``wpe``: n_positions rows) are
megatron-core's ``embedding.position_embeddings`` (``position_embedding_type=learned_absolute``).

Names: checkpoints saved from ``GPT2LMHeadModel`` start with ``transformer.``; those saved from the bare
``GPT2Model`` (the published ``gpt2`` weights) do not: both are read, and written with ``transformer.``. Older
transformers also stored the attention mask buffers ``attn.bias`` / ``attn.masked_bias``: not weights, ignored.
``fused_norm``: as :mod:`orchestrator.runtime.rank.hf_llama` (local spec ``input_layernorm.*`` or Transformer
Engine's ``linear_qkv.layer_norm_*``). Vocabulary padding: rows beyond the Hugging Face vocabulary are zero on
import and dropped on export.
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch

from orchestrator.runtime.rank.hf_llama import fuse_qkv, split_qkv

ROOT = "transformer."
_MC = "decoder.layers.{i}."


def _root(names: Iterable[str]) -> str:
    return ROOT if any(n.startswith(ROOT) for n in names) else ""


def layer_prefix(names: Iterable[str]) -> str:
    """The stored name prefix of decoder layer ``{i}`` (a format string) among ``names``."""
    return _root(names) + "h.{i}."


def outer_names(names: Iterable[str]) -> Dict[str, str]:
    """megatron-core's parameters outside the decoder layers -> the stored Hugging Face tensor each is read from."""
    names = list(names)
    r = _root(names)
    return {
        "embedding.word_embeddings.weight": r + "wte.weight",
        "embedding.position_embeddings.weight": r + "wpe.weight",
        "decoder.final_layernorm.weight": r + "ln_f.weight",
        "decoder.final_layernorm.bias": r + "ln_f.bias",
        "output_layer.weight": "lm_head.weight" if "lm_head.weight" in names else r + "wte.weight",
    }


def _norms(fused_norm: bool) -> tuple[str, str]:
    if fused_norm:
        return "self_attention.linear_qkv.layer_norm_", "mlp.linear_fc1.layer_norm_"
    return "input_layernorm.", "pre_mlp_layernorm."


def _linears(s: str, t: str) -> Dict[str, str]:
    """Hugging Face Conv1D -> megatron-core linear names of one layer (weights transposed, biases as they are)."""
    return {
        s + "attn.c_proj.": t + "self_attention.linear_proj.",
        s + "mlp.c_fc.": t + "mlp.linear_fc1.",
        s + "mlp.c_proj.": t + "mlp.linear_fc2.",
    }


def layer_to_megatron(hf: dict, i: int, heads: int, groups: int = 0, fused_norm: bool = False) -> dict:
    """One decoder layer: Hugging Face names under ``[transformer.]h.{i}.`` -> megatron-core names (``groups`` is
    ignored: GPT-2 attention has a KV head per query head)."""
    s, t = layer_prefix(hf).format(i=i), _MC.format(i=i)
    ln1, ln2 = _norms(fused_norm)
    w = hf[s + "attn.c_attn.weight"].t()  # [3 * hidden, hidden]: rows q, k, v
    b = hf[s + "attn.c_attn.bias"]
    out = {
        t + ln1 + "weight": hf[s + "ln_1.weight"],
        t + ln1 + "bias": hf[s + "ln_1.bias"],
        t + ln2 + "weight": hf[s + "ln_2.weight"],
        t + ln2 + "bias": hf[s + "ln_2.bias"],
        t + "self_attention.linear_qkv.weight": fuse_qkv(*w.chunk(3), heads, heads),
        t + "self_attention.linear_qkv.bias": fuse_qkv(*b.chunk(3), heads, heads),
    }
    for src, dst in _linears(s, t).items():
        out[dst + "weight"] = hf[src + "weight"].t().contiguous()
        out[dst + "bias"] = hf[src + "bias"]
    return out


def layer_to_hf(mc: dict, i: int, heads: int, groups: int = 0, fused_norm: bool = False) -> dict:
    """Inverse of :func:`layer_to_megatron` for one layer (names under ``transformer.h.{i}.``)."""
    s, t = f"{ROOT}h.{i}.", _MC.format(i=i)
    ln1, ln2 = _norms(fused_norm)
    qkv = split_qkv(mc[t + "self_attention.linear_qkv.weight"], heads, heads)
    out = {
        s + "ln_1.weight": mc[t + ln1 + "weight"],
        s + "ln_1.bias": mc[t + ln1 + "bias"],
        s + "ln_2.weight": mc[t + ln2 + "weight"],
        s + "ln_2.bias": mc[t + ln2 + "bias"],
        s + "attn.c_attn.weight": torch.cat(qkv).t().contiguous(),
        s + "attn.c_attn.bias": torch.cat(split_qkv(mc[t + "self_attention.linear_qkv.bias"], heads, heads)),
    }
    for src, dst in _linears(s, t).items():
        out[src + "weight"] = mc[dst + "weight"].t().contiguous()
        out[src + "bias"] = mc[dst + "bias"]
    return out


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])]) if rows > w.shape[0] else w


def to_megatron(hf: dict, layers: int, heads: int, groups: int, padded_vocab: int, fused_norm: bool = False) -> dict:
    """A whole GPT-2 Hugging Face state dict -> megatron-core GPTModel's (TP1/PP1); ``padded_vocab`` >= the Hugging
    Face vocabulary (extra rows zero); ``groups`` as :func:`layer_to_megatron`. KeyError names a missing tensor."""
    out = {}
    for mc, name in outer_names(hf).items():
        if mc != "output_layer.weight" or name == "lm_head.weight":
            out[mc] = hf[name]
    for mc in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if mc in out:
            out[mc] = _pad_rows(out[mc], padded_vocab)
    for i in range(layers):
        out.update(layer_to_megatron(hf, i, heads, fused_norm=fused_norm))
    return out


def to_hf(mc: dict, layers: int, heads: int, groups: int, vocab: int, fused_norm: bool = False) -> dict:
    """Inverse of :func:`to_megatron` (names under ``transformer.``, ``lm_head.weight`` only when untied); drops
    padded vocabulary rows beyond ``vocab``."""
    out = {
        ROOT + "wte.weight": mc["embedding.word_embeddings.weight"][:vocab].contiguous(),
        ROOT + "wpe.weight": mc["embedding.position_embeddings.weight"],
        ROOT + "ln_f.weight": mc["decoder.final_layernorm.weight"],
        ROOT + "ln_f.bias": mc["decoder.final_layernorm.bias"],
    }
    for i in range(layers):
        out.update(layer_to_hf(mc, i, heads, fused_norm=fused_norm))
    if "output_layer.weight" in mc:
        out["lm_head.weight"] = mc["output_layer.weight"][:vocab].contiguous()
    return out
