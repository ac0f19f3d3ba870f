"""Issue 38 item 1: the Llama weight mapping on a real (tiny, random) transformers LlamaForCausalLM."""

import pytest
import torch

from orchestrator.runtime.rank import hf_llama

transformers = pytest.importorskip("transformers")

HEADS, GROUPS, HIDDEN, LAYERS, VOCAB, PADDED = 4, 2, 32, 2, 50, 64


def _tiny(tied: bool, bias: bool = False) -> dict:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=GROUPS,
        tie_word_embeddings=tied,
        attention_bias=bias,
    )
    sd = transformers.LlamaForCausalLM(cfg).state_dict()
    if tied:
        sd.pop("lm_head.weight", None)
    return {k: v.clone() for k, v in sd.items() if "rotary" not in k}


@pytest.mark.parametrize("tied,bias,fused", [(False, False, False), (True, True, True)])
def test_llama_mapping_groups_qkv_and_round_trips_bitwise(tied, bias, fused):
    hf = _tiny(tied, bias)
    mc = hf_llama.to_megatron(hf, LAYERS, HEADS, GROUPS, PADDED, fused_norm=fused)
    d = HIDDEN // HEADS
    qkv = mc["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((HEADS + 2 * GROUPS) * d, HIDDEN)
    a = "model.layers.1.self_attn."
    per = HEADS // GROUPS
    for g in range(GROUPS):  # group g: its q heads, then its k head, then its v head
        blk = qkv[g * (per + 2) * d : (g + 1) * (per + 2) * d]
        assert torch.equal(blk[: per * d], hf[a + "q_proj.weight"][g * per * d : (g + 1) * per * d])
        assert torch.equal(blk[per * d : (per + 1) * d], hf[a + "k_proj.weight"][g * d : (g + 1) * d])
        assert torch.equal(blk[(per + 1) * d :], hf[a + "v_proj.weight"][g * d : (g + 1) * d])
    fc1 = mc["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:48], hf["model.layers.0.mlp.gate_proj.weight"])
    emb = mc["embedding.word_embeddings.weight"]
    assert emb.shape[0] == PADDED and not emb[VOCAB:].any()
    assert ("output_layer.weight" in mc) is not tied
    assert ("decoder.layers.0.self_attention.linear_qkv.bias" in mc) is bias
    back = hf_llama.to_hf(mc, LAYERS, HEADS, GROUPS, VOCAB, fused_norm=fused)
    assert back.keys() == hf.keys()
    for k, v in hf.items():
        assert torch.equal(back[k], v), k
