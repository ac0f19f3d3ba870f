"""The tokenizer a run uses, built with megatron-core's own classes, and its identity for manifests.

* :func:`build_tokenizer` — megatron-core's byte-level tokenizer (UTF-8 bytes, ids 0..255,
  ``<eod>`` = 256, ``<pad>`` = 257; nothing to download), or a user ``tokenizer.json`` through
  megatron-core's HuggingFace wrapper. megatron is imported only when a tokenizer is built.
* :func:`tokenizer_identity` — what a manifest records of it (torch-free).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Dict

from orchestrator.config.schema import DataConfig
from orchestrator.errors import DataError

BYTE_VOCAB = 256
"""Byte ids 0..255; ``<eod>`` is id 256 and ``<pad>`` 257, so the unpadded vocab is 258."""


def build_tokenizer(data: DataConfig):
    """megatron-core tokenizer for ``data.tokenizer`` ("byte" or a tokenizer.json path)."""
    from megatron.core.tokenizers import MegatronTokenizer

    if data.tokenizer == "byte":
        return MegatronTokenizer.from_pretrained(
            metadata_path={"library": "byte-level", "model_type": "gpt"},
            vocab_size=BYTE_VOCAB, special_tokens=["<pad>", "<eod>"], _eos_id=BYTE_VOCAB, _pad_id=BYTE_VOCAB + 1,
        )
    path = Path(data.tokenizer).expanduser()
    if not path.exists():
        raise DataError(f"data.tokenizer={data.tokenizer!r}: no such file; fix: 'byte' or a path to tokenizer.json")
    return MegatronTokenizer.from_pretrained(
        tokenizer_path=str(path.parent), metadata_path={"library": "huggingface", "model_type": "gpt"}
    )


def tokenizer_identity(data: DataConfig) -> Dict[str, object]:
    """What identifies the tokenizer in a manifest (name, vocab size, file digest)."""
    if data.tokenizer == "byte":
        return {"name": "byte-level", "vocab_size": BYTE_VOCAB + 2, "eod": BYTE_VOCAB, "pad": BYTE_VOCAB + 1}
    path = Path(data.tokenizer).expanduser()
    if not path.is_file():
        raise DataError(f"data.tokenizer={data.tokenizer!r}: no such file; fix: 'byte' or a path to tokenizer.json")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    return {"name": "huggingface", "path": str(data.tokenizer), "sha256": digest}
