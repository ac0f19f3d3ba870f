"""The tokenizer a run uses, built with megatron-core's own classes, and its identity for manifests.

What the tokenizer *is* (kind, files, vocabulary, eod) is decided once, torch-free, by
:func:`orchestrator.config.tokenizer.tokenizer_facts`; this module builds it:

* :func:`build_tokenizer` — the tokenizer that tokenizes text (data preparation): megatron-core's
  byte-level tokenizer; its HuggingFaceTokenizer (a tokenizer.json, or GPT-2 BPE's vocab.json +
  merges.txt, which megatron-core 0.16.1's own GPT2BPETokenizer path only takes from the hub: they are
  given to the same HuggingFaceTokenizer as a local GPT-2 tokenizer directory, ``gpt2_directory``);
  its SentencePieceTokenizer; its NullTokenizer.
* :func:`dataset_tokenizer` — what the ranks give megatron's GPTDataset. Ranks read token ids, they
  never tokenize: byte runs get the byte tokenizer, every other run megatron-core's NullTokenizer of
  the same vocabulary (what Megatron-LM runs pre-tokenized data with), so no rank imports transformers
  (seconds each). The eod matters only to preparation here (reset_position_ids, reset_attention_mask
  and eod_mask_loss are off).
* :func:`tokenizer_identity` — what a manifest records of it (torch-free).

megatron (and transformers) are imported only when a tokenizer is built.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Dict

from orchestrator.config.schema import DataConfig
from orchestrator.config.tokenizer import BYTE_VOCAB, GPT2_EOD_TOKEN, TokenizerFacts, tokenizer_facts
from orchestrator.errors import DataError
from orchestrator.io import write_atomic

GPT2_FILES = {"vocab_file": "vocab.json", "merge_file": "merges.txt"}


def _byte():
    from megatron.core.tokenizers import MegatronTokenizer

    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "byte-level", "model_type": "gpt"},
        vocab_size=BYTE_VOCAB,
        special_tokens=["<pad>", "<eod>"],
        _eos_id=BYTE_VOCAB,
        _pad_id=BYTE_VOCAB + 1,
    )


def _null(vocab_size: int):
    from megatron.core.tokenizers import MegatronTokenizer

    # megatron's NullTokenizer adds the eod after its vocab_size ids
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": "null", "model_type": "gpt"}, vocab_size=vocab_size - 1
    )


def gpt2_directory(facts: TokenizerFacts, cache_dir: str) -> str:
    """``<cache_dir>/tokenizers/gpt2-bpe-<digest>/``: the vocab.json and merges.txt (copied) and a
    tokenizer_config.json naming GPT-2's tokenizer class and special tokens, which HuggingFace's
    AutoTokenizer (under megatron-core's HuggingFaceTokenizer) loads offline. Written atomically once."""
    ident = facts.identity()
    key = ident["sha256:vocab_file"] + ident["sha256:merge_file"]  # type: ignore[operator]
    root = Path(os.path.expanduser(cache_dir)) / "tokenizers" / f"gpt2-bpe-{key}"
    if not (root / "tokenizer_config.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        for role, path in facts.files:
            tmp = root / f".{GPT2_FILES[role]}.{os.getpid()}"
            shutil.copyfile(path, tmp)
            os.replace(tmp, root / GPT2_FILES[role])
        special = facts.eod_token or GPT2_EOD_TOKEN
        write_atomic(
            root / "tokenizer_config.json",
            json.dumps(
                {
                    "tokenizer_class": "GPT2Tokenizer",
                    "model_max_length": 1 << 30,
                    "add_prefix_space": False,
                    "bos_token": special,
                    "eos_token": special,
                    "unk_token": special,
                },
                indent=1,
            ),
        )
    return str(root)


def _huggingface(directory: str, facts: TokenizerFacts):
    from megatron.core.tokenizers import MegatronTokenizer

    kwargs = {"eos_token": facts.eod_token} if facts.eod_token is not None else {}
    try:
        return MegatronTokenizer.from_pretrained(
            tokenizer_path=directory,
            use_fast=True,
            metadata_path={"library": "huggingface", "model_type": "gpt"},
            **kwargs,
        )
    except ValueError as exc:  # megatron: "Unable to instantiate HuggingFace AutoTokenizer for ..."
        raise DataError(
            f"data.tokenizer={directory}: HuggingFace cannot load it ({str(exc)[:300]}); "
            "fix: the tokenizer's own files (tokenizer.json and tokenizer_config.json)"
        ) from None


def build_tokenizer(data: DataConfig):
    """megatron-core tokenizer for ``data.tokenizer`` (see the module docstring); DataError when what
    megatron-core builds disagrees with the vocabulary and eod the run was planned with."""
    facts = tokenizer_facts(data)
    if facts.kind == "byte":
        return _byte()
    if facts.kind == "null":
        return _null(facts.vocab_size)
    if facts.kind == "sentencepiece":
        from megatron.core.tokenizers import MegatronTokenizer

        tok = MegatronTokenizer.from_pretrained(
            tokenizer_path=facts.model, metadata_path={"library": "sentencepiece", "model_type": "gpt"}
        )
    else:
        directory = gpt2_directory(facts, data.cache_dir) if facts.kind == "gpt2-bpe" else facts.model
        tok = _huggingface(str(directory), facts)
    if tok.vocab_size > facts.vocab_size:
        raise DataError(
            f"data.tokenizer={data.tokenizer}: megatron-core's tokenizer has {tok.vocab_size} ids, "
            f"its files {facts.vocab_size}; fix: the tokenizer's own files"
        )
    return tok


def dataset_tokenizer(data: DataConfig):
    """The tokenizer megatron's GPTDataset gets, in the launcher and on every rank alike (its
    ``unique_identifiers`` key the cached sample indices): see the module docstring."""
    facts = tokenizer_facts(data)
    return _byte() if facts.kind == "byte" else _null(facts.vocab_size)


def tokenizer_identity(data: DataConfig) -> Dict[str, object]:
    """What identifies the tokenizer in a manifest: kind, vocabulary, eod and the digest of every file."""
    return tokenizer_facts(data).identity()
