"""Data preparation on the launching machine: the ``data`` config as Megatron indexed datasets.

* :func:`prepare` — turns the ``data`` config into Megatron indexed datasets (``.bin``/``.idx``
  prefixes), cached by content fingerprint (:func:`data_fingerprint`, cheap: it hashes the files,
  it does not tokenize). It prints, per source, documents, tokens, skipped lines and empty documents.
* :func:`indices_cached` — whether the GPTDataset sample indices of a request are built
  (:func:`orchestrator.runtime.rank.dataset.cache_indices` builds them, in the job).

Importing this module imports neither torch nor megatron-core; tokenizing does (megatron-core's
tokenizer and ``IndexedDatasetBuilder``). Corpus reading, its fault policy and the counts printed:
:mod:`orchestrator.data.corpus`; the tokenizer: :mod:`orchestrator.data.tokenizer`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from orchestrator.config.schema import DataConfig, JobConfig
from orchestrator.config.tokenizer import TokenizerFacts, tokenizer_facts
from orchestrator.data.corpus import Encoder, fingerprint_files, prepare_source, stdlib_documents, token_dtype
from orchestrator.data.tokenizer import build_tokenizer, tokenizer_identity
from orchestrator.errors import DataError
from orchestrator.meter import Meter, phase

Log = Callable[[str], None]


def _say(message: str) -> None:
    print(f"[orchestrator] {message}", flush=True)


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
        return {
            "kind": data.kind,
            "paths": list(data.paths),
            "weights": self.weights,
            "split": data.split,
            "fingerprint": self.fingerprint,
        }


def _cache_root(data: DataConfig) -> Path:
    return Path(os.path.expanduser(data.cache_dir))


def _sources(data: DataConfig) -> List[Tuple[str, List[Path]]]:
    """(name, files) of each source to tokenize; raises DataError for missing paths."""
    if data.kind == "stdlib":
        return [("stdlib", stdlib_documents(data.stdlib_max_mb))]
    if not data.paths:
        raise DataError(
            f"data.paths: data.kind={data.kind} needs at least one path; "
            f"fix: data.paths=[/path/{'file.jsonl' if data.kind == 'jsonl' else 'prefix'}]"
        )
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
        raise DataError(
            f"data.weights: {len(data.weights)} weights for {len(data.paths)} data.paths; "
            "fix: one weight per path, or data.weights=null"
        )


def data_fingerprint(data: DataConfig) -> str:
    """The content fingerprint :func:`prepare` reports, without tokenizing anything (it hashes the
    source files): for a resume check before the expensive preparation. Raises DataError."""
    _check_weights(data)
    if data.kind == "mock":
        return "mock"
    return _fingerprint(data, _sources(data))[0]


def _fingerprint(data: DataConfig, sources: List[Tuple[str, List[Path]]], log: Log = _say) -> Tuple[str, List[str]]:
    """(the data's fingerprint, one per source). Indexed prefixes hash their .idx files together."""
    tok_id = json.dumps(tokenizer_identity(data), sort_keys=True)
    meter = Meter("fingerprinting", sum(f.stat().st_size for _, files in sources for f in files), log=log)
    if data.kind == "indexed":
        whole = fingerprint_files([f for _, files in sources for f in files], tok_id, meter.advance)
        meter.close()
        return whole, []
    prints = [fingerprint_files(files, tok_id + data.json_key, meter.advance) for _, files in sources]
    meter.close()
    return hashlib.sha256("".join(prints).encode()).hexdigest()[:20], prints


def prepare(data: DataConfig, log: Log = _say) -> PreparedData:
    """Make the ``data`` config trainable: indexed datasets on disk, cached by content.

    Prints one line per source (documents, tokens, skipped lines, empty documents) and one warning
    line per file with skipped lines. Raises :class:`DataError` for missing files, mismatched blend
    weights or a file without any usable document.
    """
    _check_weights(data)
    root = _cache_root(data)
    if data.kind == "mock":
        root.mkdir(parents=True, exist_ok=True)
        return PreparedData(prefixes=[], weights=None, fingerprint="mock", cache_dir=str(root))
    sources = _sources(data)
    fingerprint, prints = _fingerprint(data, sources, log)
    facts = tokenizer_facts(data)
    if data.kind == "indexed":
        prefixes = [os.path.expanduser(p) for p in data.paths]
        check_token_ids(data, facts, prefixes, root, log)  # before anything is written
        root.mkdir(parents=True, exist_ok=True)
    else:
        root.mkdir(parents=True, exist_ok=True)
        paths = [root / "prepared" / f"{name}-{fp}" for (name, _), fp in zip(sources, prints)]
        cached = all(Path(f"{p}.bin").exists() and Path(f"{p}.idx").exists() for p in paths)
        encoder = None
        if not cached:  # megatron's import costs seconds: only to tokenize
            with phase(f"preparing data: loading the tokenizer ({data.tokenizer}; imports megatron-core)", log=log):
                encoder = Encoder(build_tokenizer(data), facts.eod, token_dtype(facts.vocab_size), data.json_key)
        prefixes = []
        for (name, files), prefix in zip(sources, paths):
            prepare_source(data, prefix, name, files, encoder, log)
            prefixes.append(str(prefix))
    weights = None
    if len(prefixes) > 1:
        weights = [float(w) for w in data.weights] if data.weights else [1.0 / len(prefixes)] * len(prefixes)
    return PreparedData(prefixes, weights, fingerprint, str(root))


def _token_range(prefix: str, cache: Path) -> Dict[str, object]:
    """{dtype, min, max} of the token ids in ``prefix.bin`` (megatron's IndexedDataset says the dtype),
    read once: cached in ``cache`` (keyed by the .idx content and the .bin size and time)."""
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dtype = np.dtype(IndexedDataset(prefix, mmap=True).index.dtype)
    tokens = np.memmap(f"{prefix}.bin", dtype=dtype, mode="r")
    lo, hi, step = None, None, 1 << 26
    for start in range(0, len(tokens), step):
        part = tokens[start : start + step]
        lo = int(part.min()) if lo is None else min(lo, int(part.min()))
        hi = int(part.max()) if hi is None else max(hi, int(part.max()))
    return {"dtype": dtype.name, "min": lo if lo is not None else 0, "max": hi if hi is not None else -1}


def check_token_ids(data: DataConfig, facts: TokenizerFacts, prefixes: List[str], root: Path, log: Log) -> None:
    """``data=indexed``: every prefix's .bin holds integer ids in [0, vocab) of the run's tokenizer;
    DataError (one line naming the prefix, the largest id and the vocabulary) otherwise. The range of
    each prefix is read once and cached under ``<cache_dir>/indexed/`` (only once it fits)."""
    from orchestrator.io import write_atomic

    for i, prefix in enumerate(prefixes):
        st = os.stat(f"{prefix}.bin")
        key = fingerprint_files([Path(f"{prefix}.idx")], f"{st.st_size}:{st.st_mtime_ns}")
        cache = root / "indexed" / f"{Path(prefix).name}-{key}.json"
        fresh = not cache.is_file()
        if fresh:
            log(f"checking the token ids of {prefix}.bin ({st.st_size / 1e6:,.1f} MB)")
        ids = _token_range(prefix, cache)
        where = f"data.paths[{i}]={data.paths[i]}"
        if ids["dtype"].startswith("float"):  # type: ignore[union-attr]
            raise DataError(
                f"{where}: its .idx says the tokens are {ids['dtype']}, not integer ids; "
                "fix: the prefix of a tokenized dataset"
            )
        if ids["max"] >= facts.vocab_size or ids["min"] < 0:  # type: ignore[operator]
            what = (
                f"largest token id {ids['max']}"
                if ids["max"] >= facts.vocab_size  # type: ignore[operator]
                else f"token id {ids['min']}"
            )
            raise DataError(
                f"{where}: {what} ({ids['dtype']}) does not fit the vocabulary of data.tokenizer="
                f"{data.tokenizer} ({facts.vocab_size} ids); fix: the tokenizer that made this data (e.g. "
                "data.tokenizer=GPT2BPETokenizer data.vocab_file=... data.merge_file=...), or "
                f"data.tokenizer=NullTokenizer data.vocab_size={int(ids['max']) + 1}"
            )  # type: ignore[call-overload]
        if fresh:
            write_atomic(cache, json.dumps(ids) + "\n")


def samples_needed(cfg: JobConfig) -> int:
    return cfg.training.train_iters * cfg.training.global_batch_size


def valid_samples_needed(cfg: JobConfig) -> int:
    """Validation samples one evaluation reads: ``training.eval_iters`` global batches (0: no evaluation)."""
    t = cfg.training
    return t.eval_iters * t.global_batch_size if t.train_iters > 0 else 0


def indices_marker(cfg: JobConfig, prepared: PreparedData) -> Path:
    """``<cache_dir>/indices/ready-<key>.json``: written once :func:`cache_indices` built the sample
    indices of exactly this request (data, split, sizes, sequence length, seed, megatron-core version)."""
    from importlib.metadata import version

    request = {
        "prefixes": prepared.prefixes,
        "weights": prepared.weights,
        "fingerprint": prepared.fingerprint,
        "kind": cfg.data.kind,
        "split": cfg.data.split,
        "tokenizer": tokenizer_identity(cfg.data),
        "seq_length": cfg.model.seq_length,
        "seed": cfg.training.seed,
        "train_samples": samples_needed(cfg),
        "valid_samples": valid_samples_needed(cfg),
        "megatron-core": version("megatron-core"),
    }
    key = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:20]
    return Path(prepared.cache_dir) / "indices" / f"ready-{key}.json"


def indices_cached(cfg: JobConfig, prepared: PreparedData) -> bool:
    """Whether :func:`cache_indices` has built exactly this request's sample indices (no torch import)."""
    return indices_marker(cfg, prepared).exists()
