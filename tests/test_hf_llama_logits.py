"""Issue 38 item 1: megatron-core's GPTModel loaded through hf_llama gives transformers' Llama logits (fp32, 1e-4)."""

from __future__ import annotations

import os

import pytest
import torch

from orchestrator.runtime.rank.distributed import reserve_local_port

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.mcore_lines]  # one spawned process importing megatron-core

HEADS, GROUPS, HIDDEN, FFN, LAYERS, VOCAB, PADDED, EPS = 4, 2, 32, 48, 2, 50, 64, 1e-5


def _rank_main(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from orchestrator.runtime.rank import cpu, hf_llama

    cpu.activate()
    torch.distributed.init_process_group("gloo")
    ps.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    try:
        torch.manual_seed(0)
        hf_cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=GROUPS,
            rms_norm_eps=EPS,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        )
        ref = transformers.LlamaForCausalLM(hf_cfg).eval()
        tokens = torch.randint(0, VOCAB, (2, 8))
        with torch.no_grad():
            want = ref(tokens).logits
        cfg = TransformerConfig(
            num_layers=LAYERS,
            hidden_size=HIDDEN,
            ffn_hidden_size=FFN,
            num_attention_heads=HEADS,
            num_query_groups=GROUPS,
            normalization="RMSNorm",
            layernorm_epsilon=EPS,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
            use_cpu_initialization=True,
        )
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=PADDED,
            max_sequence_length=64,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=10000,
        ).eval()
        sd = {k: v for k, v in ref.state_dict().items() if "rotary" not in k}
        missing, unexpected = model.load_state_dict(
            hf_llama.to_megatron(sd, LAYERS, HEADS, GROUPS, PADDED), strict=False
        )
        assert not unexpected and all("_extra_state" in k for k in missing), (missing, unexpected)
        pos = torch.arange(tokens.shape[1]).repeat(tokens.shape[0], 1)
        with torch.no_grad():
            got = model(tokens, pos, None)[..., :VOCAB]
        torch.save({"got": got, "want": want}, os.path.join(out_dir, "logits.pt"))
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_imported_llama_logits_equal_transformers_fp32(tmp_path):
    torch.multiprocessing.spawn(_rank_main, args=(reserve_local_port(), str(tmp_path)), nprocs=1, join=True)
    out = torch.load(tmp_path / "logits.pt")
    assert out["got"].shape == out["want"].shape
    assert out["want"].abs().max().item() > 0.05  # real logits, not zeros
    assert (out["got"] - out["want"]).abs().max().item() < 1e-4
