"""Llama-family weight mapping between Hugging Face and megatron-core GPTModel state dicts (TP1/PP1).

Pure tensor work (issue 38 item 1): no I/O, no process group. Layout of megatron-core's fused QKV
(``megatron/core/transformer/attention.py``, ``SelfAttention.get_query_key_value_tensors``): rows are grouped per
KV group g = 0..G-1 as ``[q heads of g (H/G * d rows); k of g (d rows); v of g (d rows)]``, d = hidden / H.
The SwiGLU ``linear_fc1`` is ``[gate; up]`` (megatron-core ``MLP``: ``chunk(2)`` -> ``silu(a) * b``).

Names: ``fused_norm=False`` is the local spec (``input_layernorm.weight``, ``pre_mlp_layernorm.weight``);
``True`` is the Transformer Engine spec (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).
Vocabulary padding: the embedding / output rows beyond the Hugging Face vocabulary are zero on import and
dropped on export. Tied embeddings (``tie_word_embeddings``) give no ``output_layer.weight``.
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch

_HF = "model.layers.{i}."
_MC = "decoder.layers.{i}."


def layer_prefix(names: Iterable[str]) -> str:
    """The stored name prefix of decoder layer ``{i}`` (a format string): ``model.layers.{i}.``."""
    return _HF


def outer_names(names: Iterable[str]) -> Dict[str, str]:
    """megatron-core's parameters outside the decoder layers -> the stored Hugging Face tensor each is read from
    (the output layer: ``lm_head.weight``, or the tied embeddings)."""
    embed = "model.embed_tokens.weight"
    return {
        "embedding.word_embeddings.weight": embed,
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight" if "lm_head.weight" in names else embed,
    }


def _norm_names(fused_norm: bool) -> tuple[str, str]:
    if fused_norm:
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """[H*d, h], [G*d, h], [G*d, h] (or 1-D biases) -> megatron's grouped [(H + 2G)*d, h]."""
    d = q.shape[0] // heads
    per = heads // groups
    rest = q.shape[1:]
    qg = q.reshape(groups, per * d, *rest)
    kg = k.reshape(groups, d, *rest)
    vg = v.reshape(groups, d, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest).contiguous()


def split_qkv(qkv: torch.Tensor, heads: int, groups: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: [(H + 2G)*d, h] -> q [H*d, h], k [G*d, h], v [G*d, h]."""
    d = qkv.shape[0] // (heads + 2 * groups)
    per = heads // groups
    rest = qkv.shape[1:]
    g = qkv.reshape(groups, (per + 2) * d, *rest)
    q, k, v = torch.split(g, [per * d, d, d], dim=1)
    return tuple(t.reshape(-1, *rest).contiguous() for t in (q, k, v))


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])])


MOE_ROUTER = "block_sparse_moe.gate.weight"
"""Mixtral's router under ``model.layers.{i}.``; its experts are ``block_sparse_moe.experts.{e}.w1`` (gate),
``w3`` (up), ``w2`` (down). megatron-core's ``MoELayer`` (local spec: ``SequentialMLP``) names them
``mlp.router.weight`` and ``mlp.experts.local_experts.{e}.linear_fc1`` = ``[w1; w3]``, ``linear_fc2`` = ``w2``.
Routing agrees: Mixtral's softmax over the top-k logits (renormalised) is megatron's default softmax router
(top-k first, ``moe_router_pre_softmax=False``)."""


def _mlp_to_megatron(hf: dict, s: str, t: str) -> dict:
    return {
        t + "mlp.linear_fc1.weight": torch.cat([hf[s + "mlp.gate_proj.weight"], hf[s + "mlp.up_proj.weight"]]),
        t + "mlp.linear_fc2.weight": hf[s + "mlp.down_proj.weight"],
    }


def _mlp_to_hf(mc: dict, s: str, t: str) -> dict:
    gate, up = torch.chunk(mc[t + "mlp.linear_fc1.weight"], 2)
    return {
        s + "mlp.gate_proj.weight": gate.contiguous(),
        s + "mlp.up_proj.weight": up.contiguous(),
        s + "mlp.down_proj.weight": mc[t + "mlp.linear_fc2.weight"],
    }


def _moe_to_megatron(hf: dict, s: str, t: str) -> dict:
    out = {t + "mlp.router.weight": hf[s + MOE_ROUTER]}
    for e in range(hf[s + MOE_ROUTER].shape[0]):
        x, m = f"{s}block_sparse_moe.experts.{e}.", f"{t}mlp.experts.local_experts.{e}."
        out[m + "linear_fc1.weight"] = torch.cat([hf[x + "w1.weight"], hf[x + "w3.weight"]])
        out[m + "linear_fc2.weight"] = hf[x + "w2.weight"]
    return out


def _moe_to_hf(mc: dict, s: str, t: str) -> dict:
    out = {s + MOE_ROUTER: mc[t + "mlp.router.weight"]}
    for e in range(mc[t + "mlp.router.weight"].shape[0]):
        x, m = f"{s}block_sparse_moe.experts.{e}.", f"{t}mlp.experts.local_experts.{e}."
        w1, w3 = torch.chunk(mc[m + "linear_fc1.weight"], 2)
        out.update(
            {
                x + "w1.weight": w1.contiguous(),
                x + "w3.weight": w3.contiguous(),
                x + "w2.weight": mc[m + "linear_fc2.weight"],
            }
        )
    return out


def layer_to_megatron(hf: dict, i: int, heads: int, groups: int, fused_norm: bool = False) -> dict:
    """One decoder layer: Hugging Face names under ``model.layers.{i}.`` -> megatron-core names."""
    s, t = _HF.format(i=i), _MC.format(i=i)
    ln1, ln2 = _norm_names(fused_norm)
    a = s + "self_attn."
    out = {
        t + ln1: hf[s + "input_layernorm.weight"],
        t + ln2: hf[s + "post_attention_layernorm.weight"],
        t + "self_attention.linear_qkv.weight": fuse_qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], heads, groups
        ),
        t + "self_attention.linear_proj.weight": hf[a + "o_proj.weight"],
    }
    out.update(_moe_to_megatron(hf, s, t) if s + MOE_ROUTER in hf else _mlp_to_megatron(hf, s, t))
    if a + "q_proj.bias" in hf:  # Qwen2
        out[t + "self_attention.linear_qkv.bias"] = fuse_qkv(
            hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], heads, groups
        )
    if a + "o_proj.bias" in hf:  # Llama attention_bias=True
        out[t + "self_attention.linear_proj.bias"] = hf[a + "o_proj.bias"]
    return out


def layer_to_hf(mc: dict, i: int, heads: int, groups: int, fused_norm: bool = False) -> dict:
    """Inverse of :func:`layer_to_megatron` for one layer."""
    s, t = _HF.format(i=i), _MC.format(i=i)
    ln1, ln2 = _norm_names(fused_norm)
    a = s + "self_attn."
    q, k, v = split_qkv(mc[t + "self_attention.linear_qkv.weight"], heads, groups)
    out = {
        s + "input_layernorm.weight": mc[t + ln1],
        s + "post_attention_layernorm.weight": mc[t + ln2],
        a + "q_proj.weight": q,
        a + "k_proj.weight": k,
        a + "v_proj.weight": v,
        a + "o_proj.weight": mc[t + "self_attention.linear_proj.weight"],
    }
    out.update(_moe_to_hf(mc, s, t) if t + "mlp.router.weight" in mc else _mlp_to_hf(mc, s, t))
    if t + "self_attention.linear_qkv.bias" in mc:
        qb, kb, vb = split_qkv(mc[t + "self_attention.linear_qkv.bias"], heads, groups)
        out.update({a + "q_proj.bias": qb, a + "k_proj.bias": kb, a + "v_proj.bias": vb})
    if t + "self_attention.linear_proj.bias" in mc:
        out[a + "o_proj.bias"] = mc[t + "self_attention.linear_proj.bias"]
    return out


def to_megatron(hf: dict, layers: int, heads: int, groups: int, padded_vocab: int, fused_norm: bool = False) -> dict:
    """A whole Llama-family Hugging Face state dict -> megatron-core GPTModel's (TP1/PP1).

    ``padded_vocab`` >= the Hugging Face vocabulary; extra rows are zeros. KeyError names a missing tensor.
    """
    out = {"embedding.word_embeddings.weight": _pad_rows(hf["model.embed_tokens.weight"], padded_vocab)}
    for i in range(layers):
        out.update(layer_to_megatron(hf, i, heads, groups, fused_norm))
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if "lm_head.weight" in hf:
        out["output_layer.weight"] = _pad_rows(hf["lm_head.weight"], padded_vocab)
    return out


def to_hf(mc: dict, layers: int, heads: int, groups: int, vocab: int, fused_norm: bool = False) -> dict:
    """Inverse of :func:`to_megatron`: drops padded vocabulary rows beyond ``vocab``."""
    out = {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"][:vocab].contiguous()}
    for i in range(layers):
        out.update(layer_to_hf(mc, i, heads, groups, fused_norm))
    out["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
    if "output_layer.weight" in mc:
        out["lm_head.weight"] = mc["output_layer.weight"][:vocab].contiguous()
    return out
