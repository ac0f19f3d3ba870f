"""Issue 38: the GPT-2 weight mapping on a real (tiny, random) transformers GPT2LMHeadModel, and the GELU it needs."""

import pytest
import torch

from orchestrator.runtime.rank import hf_gpt2

transformers = pytest.importorskip("transformers")

HEADS, HIDDEN, LAYERS, VOCAB, PADDED = 4, 32, 2, 50, 64


def _tiny(tied: bool) -> dict:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=16, tie_word_embeddings=tied
    )
    sd = transformers.GPT2LMHeadModel(cfg).state_dict()
    if tied:
        sd.pop("lm_head.weight")
    return {k: v.clone() for k, v in sd.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}


@pytest.mark.parametrize("tied,fused", [(True, False), (False, True)])
def test_gpt2_conv1d_weights_transpose_qkv_interleaves_per_head_and_round_trips_bitwise(tied, fused):
    hf = _tiny(tied)
    mc = hf_gpt2.to_megatron(hf, LAYERS, HEADS, HEADS, PADDED, fused_norm=fused)
    d, s = HIDDEN // HEADS, "transformer.h.1."
    qkv, bias = (
        mc["decoder.layers.1.self_attention.linear_qkv.weight"],
        mc["decoder.layers.1.self_attention.linear_qkv.bias"],
    )
    w, b = hf[s + "attn.c_attn.weight"], hf[s + "attn.c_attn.bias"]  # Conv1D: [in, out], out = [q; k; v]
    assert qkv.shape == (3 * HIDDEN, HIDDEN)
    for h in range(HEADS):  # head h: its q, k and v rows, each the transpose of c_attn's columns
        for j, part in enumerate("qkv"):
            rows, cols = (
                slice((3 * h + j) * d, (3 * h + j + 1) * d),
                slice(j * HIDDEN + h * d, j * HIDDEN + (h + 1) * d),
            )
            assert torch.equal(qkv[rows], w[:, cols].t()), (h, part)
            assert torch.equal(bias[rows], b[cols]), (h, part)
    assert torch.equal(mc["decoder.layers.0.mlp.linear_fc1.weight"], hf["transformer.h.0.mlp.c_fc.weight"].t())
    norm = "mlp.linear_fc1.layer_norm_bias" if fused else "pre_mlp_layernorm.bias"
    assert torch.equal(mc[f"decoder.layers.0.{norm}"], hf["transformer.h.0.ln_2.bias"])
    assert torch.equal(mc["embedding.position_embeddings.weight"], hf["transformer.wpe.weight"])
    emb = mc["embedding.word_embeddings.weight"]
    assert emb.shape[0] == PADDED and not emb[VOCAB:].any() and ("output_layer.weight" in mc) is not tied
    back = hf_gpt2.to_hf(mc, LAYERS, HEADS, HEADS, VOCAB, fused_norm=fused)
    assert back.keys() == hf.keys() and all(torch.equal(back[k], v) for k, v in hf.items())
    # the bare GPT2Model's names (the published gpt2 weights: no "transformer." prefix) map the same
    bare = {k.removeprefix("transformer."): v for k, v in hf.items()}
    again = hf_gpt2.to_megatron(bare, LAYERS, HEADS, HEADS, PADDED, fused_norm=fused)
    assert again.keys() == mc.keys() and all(torch.equal(again[k], v) for k, v in mc.items())


@pytest.mark.mcore_lines
def test_megatron_cores_bias_gelu_is_gpt2s_gelu_new_and_exact_gelu_is_not():
    """model.activation=gelu with biases runs megatron-core's fused bias-GELU: GPT-2's activation within 1e-4 in fp32
    (the tolerance of the logits check), where exact GELU (megatron-core's without biases) is not."""
    from megatron.core.fusions.fused_bias_gelu import bias_gelu_impl
    from transformers.activations import ACT2FN

    x = torch.linspace(-20, 20, 40001)
    ours = bias_gelu_impl(x, torch.zeros(()))
    assert (ours - ACT2FN["gelu_new"](x)).abs().max().item() < 1e-6
    assert (torch.nn.functional.gelu(x) - ACT2FN["gelu_new"](x)).abs().max().item() > 1e-4
