"""Megatron-LM's tokenizers through megatron-core, and one vocabulary for the plan and the job (issue 20).

Assets are made here, nothing is downloaded: a GPT-2-sized byte-level BPE (vocab.json with 50257
ids, ``<|endoftext|>`` = 50256, 50000 merges over GPT-2's byte alphabet), ``.bin/.idx`` datasets
written by megatron-core's ``IndexedDatasetBuilder`` (uint16), a small BPE trained with the
``tokenizers`` package (tokenizer.json + tokenizer_config.json) and a SentencePiece model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import GPT2_EOD, GPT2_VOCAB, gpt2_args, make_gpt2_assets, run_cli

from orchestrator.config.schema import DataConfig
from orchestrator.config.tokenizer import tokenizer_facts
from orchestrator.errors import ConfigError

TEXTS_DIR = Path(json.__file__).parent  # real text every machine has: the json package's sources


def texts():
    return [p.read_text(encoding="utf-8") for p in sorted(TEXTS_DIR.glob("*.py"))]


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(dir, vocab.json, merges.txt, ok prefix, bad prefix): conftest.make_gpt2_assets."""
    return make_gpt2_assets(tmp_path_factory.mktemp("gpt2"))


@pytest.fixture()
def hf_dir(tmp_path):
    """A BPE trained with the tokenizers package: tokenizer.json (``</s>`` special) and a
    tokenizer_config.json naming no eos token; plus a JSONL corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts(),
        trainers.BpeTrainer(
            vocab_size=600, special_tokens=["</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    with open(tmp_path / "c.jsonl", "w") as f:
        for t in texts() * 4:
            f.write(json.dumps({"text": t}) + "\n")
    return tmp_path


def test_gpt2_bpe_files_decide_the_vocabulary_of_plan_and_job(gpt2):
    from orchestrator.config.compose import compose_config
    from orchestrator.plan.inputs import vocab_size_of

    _, vocab, merges, ok, _ = gpt2
    data = DataConfig(
        kind="indexed", paths=[str(ok)], tokenizer="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges)
    )
    facts = tokenizer_facts(data)
    assert (facts.vocab_size, facts.eod, facts.eod_token) == (GPT2_VOCAB, GPT2_EOD, "<|endoftext|>")
    ident = facts.identity()
    assert ident["eod"] == GPT2_EOD and {"sha256:vocab_file", "sha256:merge_file"} <= set(ident)
    cfg = compose_config(gpt2_args(gpt2, ok))
    assert vocab_size_of(cfg) == (GPT2_VOCAB, None)
    assert tokenizer_facts(DataConfig(tokenizer="NullTokenizer", vocab_size=GPT2_VOCAB)).eod == GPT2_EOD
    for bad, needle in (
        (dict(tokenizer="GPT2BPETokenizer", vocab_file=str(vocab)), "data.merge_file"),
        (dict(tokenizer="NullTokenizer"), "data.vocab_size"),
        (dict(tokenizer="byte", vocab_size=GPT2_VOCAB), "NullTokenizer"),
        (
            dict(tokenizer="GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges), eod_id=GPT2_VOCAB),
            "data.eod_id=50257",
        ),
        (dict(tokenizer="BertWordPieceCase"), "GPT2BPETokenizer"),
    ):
        with pytest.raises(ConfigError) as err:
            tokenizer_facts(DataConfig(**bad))
        assert needle in str(err.value) and "fix:" in str(err.value) and "\n" not in str(err.value)


def test_a_tokenizer_without_eos_is_refused_in_one_line(tmp_path, hf_dir):
    proc = run_cli(
        ["data=jsonl", f"data.paths=[{hf_dir / 'c.jsonl'}]", f"data.tokenizer={hf_dir}", f"run.root={tmp_path}/runs"],
        cache=tmp_path / "cache",
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"error: data.tokenizer={hf_dir}: the tokenizer defines no end-of-document token (no eos_token in "
        f'{hf_dir}/tokenizer_config.json); fix: add "eos_token": "<a token of its vocabulary>" to '
        f"{hf_dir}/tokenizer_config.json, or data.eod_id=<the id that ends each document>"
    )
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_prepared_ids_are_the_tokenizers_own(tmp_path, hf_dir, gpt2):
    """tokenizer.json with eos and GPT-2 BPE files through megatron-core's HuggingFaceTokenizer, a
    SentencePiece model through its SentencePieceTokenizer, 2 worker processes: each document's ids
    are the tokenizer library's own, then the eod."""
    import sentencepiece
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from tokenizers import Tokenizer, models, pre_tokenizers

    from orchestrator.data.prepare import prepare

    (hf_dir / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"})
    )
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(texts()), model_prefix=str(tmp_path / "sp"), vocab_size=300, model_type="bpe"
    )
    reference = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    bpe = Tokenizer(models.BPE.from_file(str(gpt2[1]), str(gpt2[2])))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for data, encode, eod in (
        (
            DataConfig(tokenizer="GPT2BPETokenizer", vocab_file=str(gpt2[1]), merge_file=str(gpt2[2])),
            lambda t: bpe.encode(t).ids,
            GPT2_EOD,
        ),
        (DataConfig(tokenizer=str(hf_dir)), lambda t: reference.encode(t).ids, reference.token_to_id("</s>")),
        (
            DataConfig(tokenizer="SentencePieceTokenizer", tokenizer_model=str(tmp_path / "sp.model")),
            sp.encode,
            sp.eos_id(),
        ),
    ):
        data = DataConfig(
            **{
                **data.__dict__,
                "kind": "jsonl",
                "paths": [str(hf_dir / "c.jsonl")],
                "cache_dir": str(tmp_path / "cache"),
                "workers": 2,
            }
        )
        assert tokenizer_facts(data).eod == eod
        ds = IndexedDataset(prepare(data, log=lambda _: None).prefixes[0], mmap=True)
        assert len(ds) == 4 * len(texts())
        for i, text in enumerate(texts()):
            assert ds[i].tolist() == list(encode(text)) + [eod], i


@pytest.mark.slow
def test_a_tokenizers_json_with_eos_trains_and_a_changed_config_is_refused_on_resume(tmp_path, hf_dir):
    config = hf_dir / "tokenizer_config.json"
    config.write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}))
    args = [
        "data=jsonl",
        f"data.paths=[{hf_dir / 'c.jsonl'}]",
        f"data.tokenizer={hf_dir / 'tokenizer.json'}",
        "data.split='100,0,0'",
        "training.eval_iters=0",
        "training.global_batch_size=4",
        f"run.root={tmp_path}",
        "run.name=hf",
    ]
    run_cli(args + ["training.train_iters=2"], cache=tmp_path / "cache", timeout=600)
    manifest = json.loads((tmp_path / "hf" / "checkpoints" / "iter_0000002" / "manifest.json").read_text())
    assert manifest["tokenizer"]["eod"] == 0 and "sha256:tokenizer_config.json" in manifest["tokenizer"]
    config.write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "model_max_length": 64})
    )
    proc = run_cli(args + ["training.train_iters=4"], cache=tmp_path / "cache", check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "tokenizer.sha256:tokenizer_config.json" in proc.stderr + proc.stdout
