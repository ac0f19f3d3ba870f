"""Tokenizer, corpus preparation and megatron-core GPT datasets.

* :func:`build_tokenizer` — megatron-core's byte-level tokenizer (UTF-8 bytes,
  ids 0..255, ``<eod>`` = 256, ``<pad>`` = 257; nothing to download), or a user ``tokenizer.json``
  through megatron-core's HuggingFace wrapper.
* :func:`prepare` — turns the ``data`` config into Megatron indexed datasets
  (``.bin``/``.idx`` prefixes) on the launching machine, cached by content
  fingerprint, and builds the GPTDataset sample indices once, before any rank
  starts (so no rank waits at a barrier while rank 0 builds them).
* :func:`build_train_dataset` / :class:`MicroBatchIterator` — megatron-core's
  ``GPTDataset`` through ``BlendedMegatronDatasetBuilder``, sampled in
  Megatron's pretraining order: global batch ``k`` holds samples
  ``[k*GBS, (k+1)*GBS)``; within it, micro-batch ``j`` of DP rank ``r`` holds
  samples ``k*GBS + j*MBS*DP + r*MBS + [0, MBS)``. The order depends only on the
  consumed-sample count, so every layout sees the same global batches.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import numpy as np

from orchestrator.spec.schema import DataConfig, JobConfig
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


# ---------------------------------------------------------------- corpus sources
def stdlib_documents(max_mb: float) -> List[Path]:
    """This Python's standard-library ``.py`` files, sorted, up to ``max_mb`` MB: real text, offline."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts
                   and "tests" not in p.parts)
    out, total, budget = [], 0, int(max_mb * 1e6)
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        if total + size > budget:
            break
        out.append(path)
        total += size
    if not out:
        raise DataError(f"data.kind=stdlib: no .py files under {root}; fix: use data=jsonl with your own text")
    return out


def _iter_jsonl(path: Path, key: str) -> Iterator[str]:
    with path.open("r", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg}); fix the line or the file") from None
            if key not in rec or not isinstance(rec[key], str):
                raise DataError(f"{path}:{lineno}: no string field {key!r}; fix: set data.json_key to the text field")
            yield rec[key]


def _fingerprint_files(paths: List[Path], extra: str) -> str:
    h = hashlib.sha256(extra.encode())
    for p in paths:
        h.update(str(p.name).encode())
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:20]


def _write_indexed(prefix: Path, documents: Iterator[str], tokenizer) -> int:
    """Tokenize documents into ``prefix.bin``/``prefix.idx`` (megatron IndexedDatasetBuilder). Returns doc count."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    tmp = prefix.with_name(prefix.name + ".tmp")
    builder = IndexedDatasetBuilder(str(tmp) + ".bin", dtype=dtype)
    n = 0
    for text in documents:
        ids = tokenizer.tokenize(text)
        if len(ids) == 0:
            continue
        ids = list(ids) + [tokenizer.eod]
        builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
        n += 1
    if n == 0:
        raise DataError(f"no non-empty documents to write into {prefix}")
    builder.finalize(str(tmp) + ".idx")
    os.replace(str(tmp) + ".bin", str(prefix) + ".bin")
    os.replace(str(tmp) + ".idx", str(prefix) + ".idx")
    return n


@dataclass(frozen=True)
class PreparedData:
    """Indexed-dataset prefixes and blend weights ready for GPTDataset (paths without .bin/.idx)."""

    prefixes: List[str]
    weights: Optional[List[float]]
    fingerprint: str
    cache_dir: str

    def identity(self, data: DataConfig) -> Dict[str, object]:
        return {"kind": data.kind, "paths": list(data.paths), "weights": self.weights,
                "fingerprint": self.fingerprint}


def _cache_root(data: DataConfig) -> Path:
    return Path(os.path.expanduser(data.cache_dir))


def prepare(data: DataConfig) -> PreparedData:
    """Make the ``data`` config trainable: indexed datasets on disk, cached by content.

    Raises :class:`DataError` for missing files, bad JSON or mismatched blend weights.
    """
    root = _cache_root(data)
    root.mkdir(parents=True, exist_ok=True)
    if data.weights is not None and len(data.weights) != len(data.paths):
        raise DataError(
            f"data.weights has {len(data.weights)} entries but data.paths has {len(data.paths)}; "
            "fix: one weight per path, or data.weights=null"
        )
    if data.kind == "mock":
        return PreparedData(prefixes=[], weights=None, fingerprint="mock", cache_dir=str(root))
    tok_id = json.dumps(tokenizer_identity(data), sort_keys=True)
    if data.kind == "indexed":
        if not data.paths:
            raise DataError("data.kind=indexed needs data.paths (dataset prefixes); fix: data.paths=[/path/prefix]")
        files = []
        for p in data.paths:
            for ext in (".bin", ".idx"):
                f = Path(os.path.expanduser(p) + ext)
                if not f.exists():
                    raise DataError(f"data.paths entry {p!r}: {f} does not exist; fix: give the prefix of a .bin/.idx pair")
            files.append(Path(os.path.expanduser(p) + ".idx"))
        return PreparedData([os.path.expanduser(p) for p in data.paths], data.weights,
                            _fingerprint_files(files, tok_id), str(root))
    tokenizer = build_tokenizer(data)
    if data.kind == "stdlib":
        groups = [("stdlib", stdlib_documents(data.stdlib_max_mb))]
    else:
        if not data.paths:
            raise DataError("data.kind=jsonl needs data.paths; fix: data.paths=[/path/file.jsonl]")
        groups = []
        for p in data.paths:
            path = Path(os.path.expanduser(p))
            if not path.exists():
                raise DataError(f"data.paths entry {p!r} does not exist; fix the path")
            groups.append((path.stem, [path]))
    prefixes, prints = [], []
    for stem, files in groups:
        fp = _fingerprint_files(files, tok_id + data.json_key)
        prints.append(fp)
        prefix = root / "prepared" / f"{stem}-{fp}"
        prefix.parent.mkdir(parents=True, exist_ok=True)
        with open(str(prefix) + ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent launchers prepare once
            if not (Path(str(prefix) + ".bin").exists() and Path(str(prefix) + ".idx").exists()):
                if data.kind == "stdlib":
                    docs = (f.read_text(encoding="utf-8", errors="replace") for f in files)
                else:
                    docs = _iter_jsonl(files[0], data.json_key)
                _write_indexed(prefix, docs, tokenizer)
        prefixes.append(str(prefix))
    return PreparedData(prefixes, data.weights, hashlib.sha256("".join(prints).encode()).hexdigest()[:20], str(root))


# ---------------------------------------------------------------- datasets
def _dataset_config(cfg: JobConfig, prepared: PreparedData, tokenizer):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    blend = None
    if prepared.prefixes:
        blend = (list(prepared.prefixes), list(prepared.weights) if prepared.weights else None)
    return GPTDatasetConfig(
        random_seed=cfg.training.seed,
        sequence_length=cfg.model.seq_length,
        blend=blend,
        split=cfg.data.split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=os.path.join(prepared.cache_dir, "indices"),
        mmap_bin_files=True,
    )


def build_train_dataset(cfg: JobConfig, prepared: PreparedData, tokenizer, num_samples: int):
    """megatron-core GPTDataset (or MockGPTDataset) with at least ``num_samples`` samples of seq_length+1 tokens.

    Safe to call without torch.distributed (the launcher does it once to build and cache
    the sample indices) and inside the job (every rank then loads from the cache).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    config = _dataset_config(cfg, prepared, tokenizer)
    cls = MockGPTDataset if cfg.data.kind == "mock" else GPTDataset
    train, _, _ = BlendedMegatronDatasetBuilder(cls, [num_samples, 0, 0], lambda: True, config).build()
    if train is None:
        raise DataError(f"the train split is empty (data.split={cfg.data.split!r}); fix: give the train split weight")
    return train


def samples_needed(cfg: JobConfig) -> int:
    return cfg.training.train_iters * cfg.training.global_batch_size


class MicroBatchIterator:
    """Yields this DP rank's micro-batches in Megatron's pretraining order, from ``consumed_samples`` on.

    Each item: dict of ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` tensors, shape
    ``[micro_batch_size, seq_length]``.
    """

    def __init__(self, dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 device: str = "cpu"):
        self.dataset = dataset
        self.next_sample = consumed_samples
        self.mbs, self.dp_rank, self.dp_size, self.device = micro_batch_size, dp_rank, dp_size, device

    def __iter__(self):
        return self

    def __next__(self) -> Dict[str, "object"]:
        import torch

        start = self.next_sample + self.dp_rank * self.mbs
        idx = [(start + i) % len(self.dataset) for i in range(self.mbs)]
        self.next_sample += self.mbs * self.dp_size
        items = [self.dataset[i] for i in idx]
        batch = {}
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            batch[key] = torch.stack([it[key] for it in items]).to(self.device, non_blocking=True)
        return batch
