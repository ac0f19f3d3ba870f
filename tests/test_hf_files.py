"""Issue 38: reading a sharded Hugging Face directory layer by layer; a missing shard is one error line."""

import os

import pytest
import torch
from test_hf_config import TINY  # the tiny Llama shape, stated once

from orchestrator.ckpt import hf_dir
from orchestrator.runtime.rank import hf_files, hf_llama

transformers = pytest.importorskip("transformers")


def test_sharded_directory_reads_per_layer_and_a_missing_shard_is_named(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(tmp_path, max_shard_size="20KB", safe_serialization=True)
    files = hf_dir.weight_map(str(tmp_path))
    assert len(set(files.values())) > 1  # really sharded
    sd = model.state_dict()
    names = hf_dir.layer_names(files, 1)
    got = hf_files.read_tensors(files, names)
    assert names and all(torch.equal(got[n], sd[n]) for n in names)
    whole = hf_files.read_tensors(files, sorted(files))
    mc = hf_llama.to_megatron(whole, 2, 4, 2, 64)
    assert mc["decoder.layers.1.self_attention.linear_qkv.weight"].shape == (64, 32)
    shard = sorted(set(files.values()))[-1]
    os.remove(shard)
    with pytest.raises(hf_dir.HfCheckpointError, match=f"shard {os.path.basename(shard)} .* missing") as e:
        hf_dir.weight_map(str(tmp_path))
    assert "\n" not in str(e.value)


def test_mapped_back_weights_written_as_shards_load_in_transformers_bitwise(tmp_path):
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(**TINY, tie_word_embeddings=False)
    src = transformers.LlamaForCausalLM(cfg)
    sd = {k: v for k, v in src.state_dict().items() if "rotary" not in k}
    back = hf_llama.to_hf(hf_llama.to_megatron(sd, 2, 4, 2, 64), 2, 4, 2, 50)
    out = tmp_path / "out"
    out.mkdir()
    shards = hf_files.write_shards(str(out), back, max_shard_bytes=20_000)
    cfg.save_pretrained(out)
    assert len(shards) > 1
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    for k, v in sd.items():
        assert torch.equal(loaded.state_dict()[k], v), k
