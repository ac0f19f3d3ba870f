"""Tokenizer, corpus preparation and megatron-core GPT datasets.

* :func:`build_tokenizer` — megatron-core's byte-level tokenizer (UTF-8 bytes,
  ids 0..255, ``<eod>`` = 256, ``<pad>`` = 257; nothing to download), or a user ``tokenizer.json``
  through megatron-core's HuggingFace wrapper.
* :func:`prepare` — turns the ``data`` config into Megatron indexed datasets
  (``.bin``/``.idx`` prefixes) on the launching machine, cached by content
  fingerprint (:func:`data_fingerprint`, cheap: it hashes the files, it does not tokenize).
  It prints, per source, documents, tokens, skipped lines and empty documents.
* :func:`build_train_dataset` — megatron-core's ``GPTDataset`` (a ``BlendedDataset`` over several
  prefixes) through ``BlendedMegatronDatasetBuilder``. The launcher calls it once, before any rank
  starts, to build and cache every sample index; the ranks then only load those files (no rank
  waits at a barrier while rank 0 builds). Megatron's blended index build asks
  ``torch.distributed.get_rank()`` on a cold cache; the launcher has no process group, so that one
  build runs inside a process group of one (gloo over an in-process ``HashStore``: no port, no
  network), destroyed right after — a real world of size 1, in which megatron's own rank-0 path
  builds and caches, rather than a copy of megatron's private cache-file naming.
* :class:`MicroBatchIterator` — samples in Megatron's pretraining order: global batch ``k`` holds
  samples ``[k*GBS, (k+1)*GBS)``; within it, micro-batch ``j`` of DP rank ``r`` holds samples
  ``k*GBS + j*MBS*DP + r*MBS + [0, MBS)``. The order depends only on the consumed-sample count, so
  every layout sees the same global batches.

Corpus reading, its fault policy and the counts printed: :mod:`orchestrator.runtime.corpus`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple


from orchestrator.errors import DataError
from orchestrator.runtime.corpus import fingerprint_files, prepare_source, stdlib_documents
from orchestrator.spec.schema import DataConfig, JobConfig

BYTE_VOCAB = 256
"""Byte ids 0..255; ``<eod>`` is id 256 and ``<pad>`` 257, so the unpadded vocab is 258."""

Log = Callable[[str], None]


def _say(message: str) -> None:
    print(f"[orchestrator] {message}", flush=True)


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


@dataclass(frozen=True)
class PreparedData:
    """Indexed-dataset prefixes and blend weights ready for GPTDataset (paths without .bin/.idx).

    ``weights``: one per prefix (equal when ``data.weights`` is null and there are several), None
    for a single prefix.
    """

    prefixes: List[str]
    weights: Optional[List[float]]
    fingerprint: str
    cache_dir: str

    def identity(self, data: DataConfig) -> Dict[str, object]:
        """The data identity a manifest records: kind, paths, blend weights, split and content fingerprint."""
        return {"kind": data.kind, "paths": list(data.paths), "weights": self.weights, "split": data.split,
                "fingerprint": self.fingerprint}


def _cache_root(data: DataConfig) -> Path:
    return Path(os.path.expanduser(data.cache_dir))


def _sources(data: DataConfig) -> List[Tuple[str, List[Path]]]:
    """(name, files) of each source to tokenize; raises DataError for missing paths."""
    if data.kind == "stdlib":
        return [("stdlib", stdlib_documents(data.stdlib_max_mb))]
    if not data.paths:
        raise DataError(f"data.paths: data.kind={data.kind} needs at least one path; "
                        f"fix: data.paths=[/path/{'file.jsonl' if data.kind == 'jsonl' else 'prefix'}]")
    out = []
    for i, p in enumerate(data.paths):
        if data.kind == "indexed":
            for ext in (".idx", ".bin"):
                f = Path(os.path.expanduser(p) + ext)
                if not f.exists():
                    raise DataError(f"data.paths[{i}]: {f} does not exist; fix: give the prefix of a .bin/.idx pair")
            out.append((p, [Path(os.path.expanduser(p) + ".idx")]))
        else:
            path = Path(os.path.expanduser(p))
            if not path.is_file():
                raise DataError(f"data.paths[{i}]: {p!r} does not exist; fix the path")
            out.append((path.stem, [path]))
    return out


def _check_weights(data: DataConfig) -> None:
    if data.weights is not None and len(data.weights) != len(data.paths):
        raise DataError(f"data.weights: {len(data.weights)} weights for {len(data.paths)} data.paths; "
                        "fix: one weight per path, or data.weights=null")


def data_fingerprint(data: DataConfig) -> str:
    """The content fingerprint :func:`prepare` reports, without tokenizing anything (it hashes the
    source files): for a resume check before the expensive preparation. Raises DataError."""
    _check_weights(data)
    if data.kind == "mock":
        return "mock"
    return _fingerprint(data, _sources(data))[0]


def _fingerprint(data: DataConfig, sources: List[Tuple[str, List[Path]]]) -> Tuple[str, List[str]]:
    """(the data's fingerprint, one per source). Indexed prefixes hash their .idx files together."""
    tok_id = json.dumps(tokenizer_identity(data), sort_keys=True)
    if data.kind == "indexed":
        return fingerprint_files([f for _, files in sources for f in files], tok_id), []
    prints = [fingerprint_files(files, tok_id + data.json_key) for _, files in sources]
    return hashlib.sha256("".join(prints).encode()).hexdigest()[:20], prints


def prepare(data: DataConfig, log: Log = _say) -> PreparedData:
    """Make the ``data`` config trainable: indexed datasets on disk, cached by content.

    Prints one line per source (documents, tokens, skipped lines, empty documents) and one warning
    line per file with skipped lines. Raises :class:`DataError` for missing files, mismatched blend
    weights or a file without any usable document.
    """
    _check_weights(data)
    root = _cache_root(data)
    root.mkdir(parents=True, exist_ok=True)
    if data.kind == "mock":
        return PreparedData(prefixes=[], weights=None, fingerprint="mock", cache_dir=str(root))
    sources = _sources(data)
    fingerprint, prints = _fingerprint(data, sources)
    if data.kind == "indexed":
        prefixes = [os.path.expanduser(p) for p in data.paths]
    else:
        paths = [root / "prepared" / f"{name}-{fp}" for (name, _), fp in zip(sources, prints)]
        cached = all(Path(f"{p}.bin").exists() and Path(f"{p}.idx").exists() for p in paths)
        tokenizer = None if cached else build_tokenizer(data)  # megatron's import costs seconds: only to tokenize
        prefixes = []
        for (name, files), prefix in zip(sources, paths):
            prepare_source(data, prefix, name, files, tokenizer, log)
            prefixes.append(str(prefix))
    weights = None
    if len(prefixes) > 1:
        weights = [float(w) for w in data.weights] if data.weights else [1.0 / len(prefixes)] * len(prefixes)
    return PreparedData(prefixes, weights, fingerprint, str(root))


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


@contextlib.contextmanager
def _process_group_of_one(needed: bool) -> Iterator[None]:
    """A gloo process group of world size 1 (in-process HashStore: no port, no network) for the
    ``with`` block, when ``needed`` and none exists; destroyed afterwards. See the module docstring."""
    import torch.distributed as dist

    if not needed or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _check_splits(cfg: JobConfig, config, prepared: PreparedData) -> None:
    """Refuse a data.split part with a weight that gets none of a prefix's documents: megatron's
    builder would loop forever on it (GPTDataset asks for epochs of an empty range)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in prepared.prefixes:
        n = len(IndexedDataset(prefix, mmap=True))
        for name, bounds in zip(("train", "validation", "test"), config.split_matrix):
            if bounds is not None and int(round(bounds[1] * n)) - int(round(bounds[0] * n)) == 0:
                raise DataError(f"data.split={cfg.data.split!r}: the {name} part of {Path(prefix).name} gets none "
                                f"of its {n} documents; fix: data.split=100,0,0 training.eval_iters=0 "
                                "(no held-out data), or more documents")


def build_datasets(cfg: JobConfig, prepared: PreparedData, tokenizer, num_samples: int):
    """(train, validation) megatron-core GPTDatasets (MockGPTDataset; a BlendedDataset over several
    prefixes): train with at least ``num_samples`` samples of seq_length+1 tokens, validation with
    :func:`valid_samples_needed` samples of ``data.split``'s held-out part (None when that is 0).

    Called by the launcher without torch.distributed, once, to build and cache every index under
    ``<cache_dir>/indices``, and inside the job, where every rank then loads those files.
    Raises DataError for an empty split part, or a blend that oversamples a source.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    config = _dataset_config(cfg, prepared, tokenizer)
    _check_splits(cfg, config, prepared)
    cls = MockGPTDataset if cfg.data.kind == "mock" else GPTDataset
    sizes = [num_samples, valid_samples_needed(cfg), 0]
    try:
        with _process_group_of_one(needed=len(prepared.prefixes) > 1):
            train, valid, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    except IndexError as exc:  # megatron: "The train blend oversamples the contributing datasets ..."
        raise DataError(f"data.weights: {str(exc).split('. ')[0]}; fix: change data.weights or add data") from None
    if train is None:
        raise DataError(f"data.split: the train split is empty (data.split={cfg.data.split!r}); "
                        "fix: give the train split weight")
    return train, (valid if sizes[1] else None)


def build_train_dataset(cfg: JobConfig, prepared: PreparedData, tokenizer, num_samples: int):
    """The train dataset of :func:`build_datasets` (which also builds and caches the validation one)."""
    return build_datasets(cfg, prepared, tokenizer, num_samples)[0]


def _indices_marker(cfg: JobConfig, prepared: PreparedData) -> Path:
    """``<cache_dir>/indices/ready-<key>.json``: written once :func:`cache_indices` built the sample
    indices of exactly this request (data, split, sizes, sequence length, seed, megatron-core version)."""
    from importlib.metadata import version

    request = {"prefixes": prepared.prefixes, "weights": prepared.weights, "fingerprint": prepared.fingerprint,
               "kind": cfg.data.kind, "split": cfg.data.split, "tokenizer": tokenizer_identity(cfg.data),
               "seq_length": cfg.model.seq_length, "seed": cfg.training.seed, "train_samples": samples_needed(cfg),
               "valid_samples": valid_samples_needed(cfg), "megatron-core": version("megatron-core")}
    key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:20]
    return Path(prepared.cache_dir) / "indices" / f"ready-{key}.json"


def indices_cached(cfg: JobConfig, prepared: PreparedData) -> bool:
    """Whether :func:`cache_indices` has built exactly this request's sample indices (no torch import)."""
    return _indices_marker(cfg, prepared).exists()


def cache_indices(cfg: JobConfig, prepared: PreparedData) -> None:
    """Build and cache the train and validation sample indices once, in the launcher, before any rank
    starts (the ranks then only load them). Nothing at all — not even the torch/megatron import, which
    takes seconds — when a marker says an earlier launch built exactly these. Raises DataError."""
    from orchestrator.io import write_atomic

    marker = _indices_marker(cfg, prepared)
    if marker.exists():
        return
    build_datasets(cfg, prepared, build_tokenizer(cfg.data), samples_needed(cfg))
    write_atomic(marker, json.dumps({"built": True}) + "\n")


def samples_needed(cfg: JobConfig) -> int:
    return cfg.training.train_iters * cfg.training.global_batch_size


def valid_samples_needed(cfg: JobConfig) -> int:
    """Validation samples one evaluation reads: ``training.eval_iters`` global batches (0: no evaluation)."""
    t = cfg.training
    return t.eval_iters * t.global_batch_size if t.train_iters > 0 else 0


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
