"""Corpus sources into Megatron indexed datasets (``.bin``/``.idx``), with the counts printed.

Sources: this Python's standard library (:func:`stdlib_documents`, offline) or JSONL files.

Corpus faults (``data=jsonl``), one policy: **a line that is not a usable document is skipped and
counted, never fatal**. Each line is decoded as UTF-8, parsed as JSON and must be an object with a
string ``data.json_key``; a line failing any of these (or blank, or text the tokenizer rejects) is
skipped. Each file with skipped lines gets one warning line: the count per cause and the first line
number of each. A document whose text is empty is counted and left out (Megatron's index holds no
empty documents). A file with no document at all is refused (:class:`DataError`, one line). The
tokenized output is written to ``<prefix>.tmp.bin``/``.tmp.idx`` and renamed into place only when
complete; on any failure (or Ctrl-C) the temporary files are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np

from orchestrator.config.schema import DataConfig
from orchestrator.errors import DataError
from orchestrator.io import file_lock, write_atomic
from orchestrator.meter import Meter


def stdlib_documents(max_mb: float) -> List[Path]:
    """This Python's standard-library ``.py`` files, sorted, up to ``max_mb`` MB: real text, offline."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )
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


@dataclass
class CorpusStats:
    """Counts of one prepared source. ``skipped``: cause -> [lines, first line number]."""

    documents: int = 0
    tokens: int = 0
    """Tokens written, one ``<eod>`` per document included."""
    empty: int = 0
    skipped: Dict[str, List[int]] = field(default_factory=dict)

    def skip(self, cause: str, lineno: int) -> None:
        entry = self.skipped.setdefault(cause, [0, lineno])
        entry[0] += 1

    @property
    def skipped_lines(self) -> int:
        return sum(n for n, _ in self.skipped.values())

    def describe(self) -> str:
        return (
            f"{self.documents:,} documents, {self.tokens:,} tokens, {self.skipped_lines:,} skipped lines, "
            f"{self.empty:,} empty documents"
        )

    def warning(self, source: str) -> Optional[str]:
        """One line naming each cause's count and first line number, or None when nothing was skipped."""
        if not self.skipped:
            return None
        ordered = sorted(self.skipped.items(), key=lambda item: item[1][1])  # by first line
        causes = ", ".join(f"{n:,} {cause} (first: line {first})" for cause, (n, first) in ordered)
        return f"{source}: skipped {self.skipped_lines:,} lines: {causes}"


def _jsonl_lines(path: Path, chunk_lines: int) -> Iterator[List[Tuple[int, bytes]]]:
    """Chunks of (line number, raw line) of a JSONL file."""
    with path.open("rb") as f:
        chunk: List[Tuple[int, bytes]] = []
        for lineno, raw in enumerate(f, 1):
            chunk.append((lineno, raw))
            if len(chunk) == chunk_lines:
                yield chunk
                chunk = []
        if chunk:
            yield chunk


def _document(raw: bytes, key: str) -> Tuple[Optional[str], Optional[str]]:
    """(text, None) of a usable JSONL line, or (None, the cause it is skipped for)."""
    if not raw.strip():
        return None, "blank"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "invalid UTF-8"
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None, "not JSON"
    if not isinstance(rec, dict) or not isinstance(rec.get(key), str):
        return None, f"without a string {key!r} field"
    return rec[key], None


def fingerprint_files(paths: List[Path], extra: str, on_bytes: Optional[Callable[[int], None]] = None) -> str:
    """The content hash of ``paths`` (names and bytes) and ``extra``; ``on_bytes``: called with each
    chunk's size (a progress meter)."""
    h = hashlib.sha256(extra.encode())
    for p in paths:
        h.update(str(p.name).encode())
        with p.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
    return h.hexdigest()[:20]


@dataclass(frozen=True)
class Encoder:
    """What a tokenizing process needs: the tokenizer, the eod appended after each document, the
    .bin dtype and the JSON key. One per source; worker processes inherit it (fork)."""

    tokenizer: object
    eod: int
    dtype: type
    key: str

    def encode(self, chunk: List[Tuple[int, object]]) -> List[Tuple[int, object]]:
        """(line number, token ids with the eod | a skip cause | None for an empty document) per item;
        an item is a JSONL line (bytes) or, for stdlib, a file path (str)."""
        out: List[Tuple[int, object]] = []
        for lineno, item in chunk:
            if isinstance(item, bytes):
                text, cause = _document(item, self.key)
                if cause is not None:
                    out.append((lineno, cause))
                    continue
            else:
                text = Path(item).read_text(encoding="utf-8", errors="replace")
            try:
                ids = self.tokenizer.tokenize(text)  # type: ignore[attr-defined]
            except (UnicodeError, ValueError):
                out.append((lineno, "text the tokenizer rejects"))
                continue
            if len(ids) == 0:
                out.append((lineno, None))
                continue
            doc = np.empty(len(ids) + 1, dtype=self.dtype)
            doc[:-1] = ids
            doc[-1] = self.eod
            out.append((lineno, doc))
        return out


def _encoded(encoder: Encoder, chunks: Iterator[list], workers: int) -> Iterator[List[Tuple[int, object]]]:
    """Each chunk encoded, in order: in this process (``workers`` 1) or in ``workers`` forked processes
    (:func:`orchestrator.data.workers.encoded_in_workers`: a signal ends them at once, none left; Megatron-LM's
    tools/preprocess_data.py uses a multiprocessing.Pool, whose ``terminate()`` could hang on Ctrl-C)."""
    if workers <= 1:
        yield from (encoder.encode(c) for c in chunks)
        return
    from orchestrator.data.workers import encoded_in_workers

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # HuggingFace's Rust pool, in a forked child
    yield from encoded_in_workers(encoder.encode, iter(chunks), workers)


def _write_indexed(
    prefix: Path, chunks: Iterator[list], encoder: Encoder, workers: int, stats: CorpusStats, source: str
) -> None:
    """Tokenize documents into ``prefix.bin``/``prefix.idx`` (megatron IndexedDatasetBuilder) and
    ``prefix.stats.json``. Writes ``prefix.tmp.*`` first and renames; removes them on any failure."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    tmp_bin, tmp_idx = Path(f"{prefix}.tmp.bin"), Path(f"{prefix}.tmp.idx")
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=encoder.dtype)
    encoded = _encoded(encoder, chunks, workers)
    try:
        for results in encoded:
            for lineno, got in results:
                if isinstance(got, str):
                    stats.skip(got, lineno)
                elif got is None:
                    stats.empty += 1
                else:
                    builder.add_document(got, [len(got)])
                    stats.documents += 1
                    stats.tokens += len(got)
        if stats.documents == 0:
            raise DataError(f"{source}: no usable document ({stats.describe()}); fix: check the file and data.json_key")
        builder.finalize(str(tmp_idx))
        write_atomic(f"{prefix}.stats.json", json.dumps(stats.__dict__, sort_keys=True))
        os.replace(tmp_idx, f"{prefix}.idx")
        os.replace(tmp_bin, f"{prefix}.bin")
    except BaseException:
        encoded.close()  # its workers end now (SIGKILL), not when the generator is collected
        builder.data_file.close()
        for tmp in (tmp_bin, tmp_idx):
            tmp.unlink(missing_ok=True)
        raise


def token_dtype(vocab_size: int) -> type:
    """The .bin dtype for ``vocab_size`` ids: megatron-core's choice (``DType.optimal_dtype``, the one
    Megatron-LM's preprocess_data.py makes)."""
    from megatron.core.datasets.indexed_dataset import DType

    return DType.optimal_dtype(vocab_size)


def workers_for(data: DataConfig, files: List[Path]) -> int:
    """Tokenizing processes: ``data.workers``, or (null) one per core this process may use, one
    for less than 4 MB of text (a pool would cost more than it saves)."""
    if data.workers is not None:
        return data.workers
    if sum(f.stat().st_size for f in files) < 4e6:
        return 1
    return max(1, min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1, 32))


def _cached_stats(prefix: Path) -> Tuple[CorpusStats, str]:
    """The counts recorded when ``prefix`` was prepared; for an older cache without them, the
    documents and tokens read from its .idx."""
    try:
        return CorpusStats(**json.loads(Path(f"{prefix}.stats.json").read_text())), ""
    except (OSError, ValueError, TypeError):
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        ds = IndexedDataset(str(prefix), mmap=True)
        stats = CorpusStats(documents=len(ds), tokens=int(ds.sequence_lengths.sum()))
        return stats, "; skipped lines and empty documents were not recorded by the older preparation"


def prepare_source(
    data: DataConfig, prefix: Path, name: str, files: List[Path], encoder: Optional[Encoder], log: Callable[[str], None]
) -> None:
    """Tokenize one source into ``prefix`` unless cached; print its counts (and skipped lines)."""
    source = str(files[0]) if data.kind == "jsonl" else f"data.kind=stdlib ({len(files)} files)"
    with file_lock(prefix):  # concurrent launchers prepare once
        if Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists():
            stats, note = _cached_stats(prefix)
            state = f"cached in {prefix}{note}"
        else:
            workers = workers_for(data, files)
            log(
                f"preparing data: tokenizing {source} into {prefix}.bin/.idx ({workers} "
                f"process{'es' if workers > 1 else ''})"
            )
            stats = CorpusStats()
            chunks = (
                _jsonl_lines(files[0], 256) if data.kind == "jsonl" else ([(i, str(f))] for i, f in enumerate(files, 1))
            )
            meter = Meter(
                "tokenizing",
                sum(f.stat().st_size for f in files),
                log=log,
                counts=lambda: {"documents": stats.documents, "tokens": stats.tokens},
            )
            sized = meter.wrap(
                chunks, lambda chunk: sum(len(x) if isinstance(x, bytes) else os.path.getsize(x) for _, x in chunk)
            )
            _write_indexed(prefix, sized, encoder, workers, stats, source)  # type: ignore[arg-type]
            meter.close()
            state = f"prepared in {prefix}"
    log(f"data {name}: {stats.describe()} ({state})")
    warning = stats.warning(source)
    if warning:
        log(f"warning: {warning}")
