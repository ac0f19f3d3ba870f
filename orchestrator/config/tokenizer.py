"""What a tokenizer is, decided once: its kind, files, vocabulary and end-of-document id (torch-free).

:func:`tokenizer_facts` reads the tokenizer's own files (``json``; ``sentencepiece`` for a
SentencePiece model) and answers the questions the plan, validate, the data preparation, the job and
the manifest ask, so they cannot disagree: the vocabulary the model is built with
(``vocab_size``, before Megatron's padding), the id appended after every document (``eod``) and
the identity a manifest records (every file that defines the tokenizer, by digest, and the eod).
Building the tokenizer with megatron-core's classes is :mod:`orchestrator.data.tokenizer`.

``data.tokenizer`` takes what Megatron-LM users have (``--tokenizer-type`` names) or a path:

=========================  ==========================================  ==============================
data.tokenizer             files                                       eod
=========================  ==========================================  ==============================
``byte``                   none (UTF-8 bytes 0..255, vocabulary 258)   256
``GPT2BPETokenizer``       ``data.vocab_file`` + ``data.merge_file``   ``<|endoftext|>`` (50256)
``HuggingFaceTokenizer``   ``data.tokenizer_model`` (dir or .json)     ``eos_token`` of its config
a path                     a ``tokenizer.json`` or its directory       ``eos_token`` of its config
``SentencePieceTokenizer`` ``data.tokenizer_model`` (a ``.model``)     the model's ``eos`` piece
``NullTokenizer``          none; ``data.vocab_size`` ids incl. eod     ``vocab_size - 1``
=========================  ==========================================  ==============================

``data.eod_id`` overrides the eod (and is the only way for a tokenizer that defines none).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from orchestrator.errors import ConfigError

BYTE_VOCAB = 256
"""Byte ids 0..255; ``<eod>`` is id 256 and ``<pad>`` 257, so the unpadded vocab is 258."""
GPT2_EOD_TOKEN = "<|endoftext|>"
HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
"""The files beside a tokenizer.json that HuggingFace's AutoTokenizer reads (class, special tokens)."""
TOKENIZER_TYPES = ("byte", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "NullTokenizer")
"""``data.tokenizer`` names (besides a path to a HuggingFace tokenizer)."""
_FIX = (
    "fix: data.tokenizer= one of "
    + ", ".join(TOKENIZER_TYPES)
    + " (with its files), or the path of a HuggingFace tokenizer.json or its directory"
)


@dataclass(frozen=True)
class TokenizerFacts:
    """One tokenizer as the run uses it. ``files``: (role, path) of every file that defines it."""

    kind: str
    """byte, gpt2-bpe, huggingface, sentencepiece or null."""
    vocab_size: int
    """Ids the tokenizer can produce (the model's vocabulary before Megatron's padding)."""
    eod: int
    eod_token: Optional[str]
    """The token string of ``eod`` (HuggingFace / GPT-2 vocabularies), else None."""
    files: Tuple[Tuple[str, str], ...] = ()
    model: Optional[str] = None
    """HuggingFace: the tokenizer's directory; SentencePiece: the .model file."""

    def identity(self) -> Dict[str, object]:
        """What a manifest records and a resume compares: kind, vocabulary, eod and each file's digest."""
        if self.kind == "byte":  # unchanged since the first manifests
            return {"name": "byte-level", "vocab_size": self.vocab_size, "eod": self.eod, "pad": self.eod + 1}
        out: Dict[str, object] = {"name": self.kind, "vocab_size": self.vocab_size, "eod": self.eod}
        for role, path in self.files:
            out[f"sha256:{role}"] = _digest(path, *_stat(path))
        return out


def _stat(path: str) -> Tuple[int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _digest(path: str, size: int, mtime_ns: int) -> str:  # size/mtime: a changed file is hashed again
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=64)
def _read_json(path: str, size: int, mtime_ns: int) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _json(key: str, value: str, path: str) -> Any:
    try:
        return _read_json(path, *_stat(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{key}={value}: {path} is not readable JSON ({type(exc).__name__}); fix: the tokenizer's own file"
        ) from None


def _existing(key: str, value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key}={value!r}: needs {what}; fix: {key}=/path/to/it")
    path = os.path.expanduser(value)
    if not os.path.exists(path):
        raise ConfigError(f"{key}={value!r}: no such file or directory (from {os.getcwd()}); fix: the path of {what}")
    return path


def _eod(
    data,
    kind: str,
    vocab_size: int,
    found: Optional[int],
    where: str,
    vocab: Optional[Dict[str, int]] = None,
    how: str = "a tokenizer that has one",
) -> Tuple[int, Optional[str]]:
    """(eod id, its token) from ``data.eod_id`` when set, else the tokenizer's own (``found``)."""
    eod = data.eod_id if data.eod_id is not None else found
    if eod is None:
        raise ConfigError(
            f"data.tokenizer={data.tokenizer}: the tokenizer defines no end-of-document token "
            f"({where}); fix: {how}, or data.eod_id=<the id that ends each document>"
        )
    if not 0 <= eod < vocab_size:
        raise ConfigError(
            f"data.eod_id={eod}: outside the {kind} tokenizer's {vocab_size} ids; "
            f"fix: data.eod_id between 0 and {vocab_size - 1}"
        )
    token = next((t for t, i in (vocab or {}).items() if i == eod), None)
    return eod, token


def _hf_vocab(spec: Any) -> Dict[str, int]:
    """token -> id of a tokenizer.json: its model's vocabulary and its added tokens."""
    model = spec.get("model", {}) if isinstance(spec, dict) else {}
    vocab = model.get("vocab", {})
    out = dict(vocab) if isinstance(vocab, dict) else {str(p[0]): i for i, p in enumerate(vocab)}
    for t in spec.get("added_tokens", []) if isinstance(spec, dict) else []:
        out[t.get("content")] = t.get("id", 0)
    return out


def _token_name(value: Any) -> Optional[str]:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _huggingface(data, key: str, value: str) -> TokenizerFacts:
    path = _existing(key, value, "a HuggingFace tokenizer.json or its directory")
    directory = path if os.path.isdir(path) else os.path.dirname(path) or "."
    tok_json = os.path.join(directory, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.isfile(tok_json):
        raise ConfigError(
            f"{key}={value}: no tokenizer.json in {directory}; fix: the path of a HuggingFace "
            "tokenizer.json or of the directory holding it"
        )
    config = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(config):
        raise ConfigError(
            f"{key}={value}: no tokenizer_config.json beside {tok_json} (HuggingFace's AutoTokenizer "
            f'needs it); fix: write {config} with {{"tokenizer_class": "PreTrainedTokenizerFast", '
            '"eos_token": "<your end-of-document token>"}'
        )
    vocab = _hf_vocab(_json(key, value, tok_json))
    if not vocab:
        raise ConfigError(f"{key}={value}: {tok_json} holds no vocabulary; fix: the tokenizer's own tokenizer.json")
    files = [("tokenizer.json", tok_json)] + [
        (n, os.path.join(directory, n)) for n in HF_CONFIG_FILES if os.path.isfile(os.path.join(directory, n))
    ]
    eos = None
    for _, f in files[1:]:
        eos = eos or _token_name(_json(key, value, f).get("eos_token"))
    if eos is not None and eos not in vocab:
        raise ConfigError(
            f"{key}={value}: eos_token {eos!r} is not in {tok_json}'s vocabulary; "
            "fix: an eos_token the vocabulary has, or data.eod_id=<id>"
        )
    size = max(vocab.values()) + 1
    eod, token = _eod(
        data,
        "huggingface",
        size,
        vocab.get(eos) if eos else None,
        f"no eos_token in {config}",
        vocab,
        f'add "eos_token": "<a token of its vocabulary>" to {config}',
    )
    return TokenizerFacts("huggingface", size, eod, token, tuple(files), directory)


def _gpt2(data) -> TokenizerFacts:
    vocab_file = _existing("data.vocab_file", data.vocab_file, "GPT-2 BPE's vocab.json (Megatron-LM's --vocab-file)")
    merge_file = _existing("data.merge_file", data.merge_file, "GPT-2 BPE's merges.txt (Megatron-LM's --merge-file)")
    vocab = _json("data.vocab_file", data.vocab_file, vocab_file)
    if not isinstance(vocab, dict) or not vocab or not all(isinstance(i, int) for i in vocab.values()):
        raise ConfigError(
            f"data.vocab_file={data.vocab_file}: not a token -> id JSON object; fix: GPT-2 BPE's vocab.json"
        )
    size = max(vocab.values()) + 1
    eod, token = _eod(
        data,
        "GPT2BPETokenizer",
        size,
        vocab.get(GPT2_EOD_TOKEN),
        f"{GPT2_EOD_TOKEN!r} is not in {data.vocab_file}",
        vocab,
    )
    return TokenizerFacts("gpt2-bpe", size, eod, token, (("vocab_file", vocab_file), ("merge_file", merge_file)))


def _sentencepiece(data) -> TokenizerFacts:
    model = _existing("data.tokenizer_model", data.tokenizer_model, "a SentencePiece .model file")
    try:
        import sentencepiece
    except ImportError:
        raise ConfigError(
            "data.tokenizer=SentencePieceTokenizer: the sentencepiece package is not installed; "
            "fix: pip install sentencepiece"
        ) from None
    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=model)
    except (OSError, RuntimeError) as exc:
        raise ConfigError(
            f"data.tokenizer_model={data.tokenizer_model}: not a SentencePiece model ({exc}); "
            "fix: the .model file the tokenizer was trained into"
        ) from None
    size = sp.get_piece_size()
    eos = sp.eos_id()
    eod, token = _eod(data, "SentencePieceTokenizer", size, eos if eos >= 0 else None, "its model has no eos piece")
    return TokenizerFacts("sentencepiece", size, eod, token, (("tokenizer_model", model),), model)


def tokenizer_facts(data) -> TokenizerFacts:
    """The facts of ``data.tokenizer`` (a :class:`~orchestrator.config.schema.DataConfig`); ConfigError
    (one line, with the fix) for a missing file, a missing key or a tokenizer without an eod."""
    tok = data.tokenizer
    if tok == "byte":
        facts = TokenizerFacts("byte", BYTE_VOCAB + 2, BYTE_VOCAB, None)
        if data.eod_id not in (None, BYTE_VOCAB):
            raise ConfigError(
                f"data.eod_id={data.eod_id}: the byte tokenizer's eod is {BYTE_VOCAB}; fix: data.eod_id=null"
            )
    elif tok == "NullTokenizer":
        if data.vocab_size is None:
            raise ConfigError(
                "data.tokenizer=NullTokenizer: needs data.vocab_size (the ids of the data, eod "
                "included); fix: data.vocab_size=<largest id + 1>, e.g. 50257 for GPT-2 token ids"
            )
        eod, _ = _eod(data, "NullTokenizer", data.vocab_size, data.vocab_size - 1, "")
        return TokenizerFacts("null", data.vocab_size, eod, None)
    elif tok == "GPT2BPETokenizer":
        facts = _gpt2(data)
    elif tok == "SentencePieceTokenizer":
        facts = _sentencepiece(data)
    elif tok == "HuggingFaceTokenizer":
        facts = _huggingface(data, "data.tokenizer_model", data.tokenizer_model)
    elif isinstance(tok, str) and tok and (os.sep in tok or tok.endswith(".json") or Path(tok).expanduser().exists()):
        facts = _huggingface(data, "data.tokenizer", tok)
    else:
        raise ConfigError(f"data.tokenizer={tok!r}: not a tokenizer this runtime builds; {_FIX}")
    if data.vocab_size is not None and data.vocab_size != facts.vocab_size:
        raise ConfigError(
            f"data.vocab_size={data.vocab_size}: data.tokenizer={tok} has {facts.vocab_size} ids; "
            f"fix: data.vocab_size=null (it is read from the tokenizer), or data.tokenizer=NullTokenizer "
            "for token ids without a tokenizer"
        )
    return facts


def model_vocab_size(cfg, tokenizer_vocab: int) -> Tuple[int, str]:
    """(the vocabulary the model is built with before Megatron's padding, where it comes from).

    The data's tokenizer (``tokenizer_vocab``, from :func:`tokenizer_facts`) unless the data names none
    (``data.tokenizer=byte`` and no ``data.vocab_size``) and the model preset carries its published
    tokenizer's size (``model.vocab_size``, e.g. Llama-3's 128256): then that, which the byte ids fit.
    The plan, the job's model, the manifest and the resume check all ask here.
    """
    d, m = cfg.data, cfg.model
    if m.vocab_size is not None and d.tokenizer == "byte" and d.vocab_size is None and m.vocab_size >= tokenizer_vocab:
        return m.vocab_size, f"model.vocab_size={m.vocab_size} ({m.name}'s tokenizer; the data names none)"
    source = f"data.tokenizer={d.tokenizer}"
    if m.vocab_size is not None and m.vocab_size != tokenizer_vocab:
        source += f" (model.vocab_size={m.vocab_size} not used: the data's tokenizer decides)"
    return tokenizer_vocab, source
