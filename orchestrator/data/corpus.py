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

from orchestrator.errors import DataError
from orchestrator.io import file_lock, write_atomic
from orchestrator.meter import Meter
from orchestrator.config.schema import DataConfig


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
        return (f"{self.documents:,} documents, {self.tokens:,} tokens, {self.skipped_lines:,} skipped lines, "
                f"{self.empty:,} empty documents")

    def warning(self, source: str) -> Optional[str]:
        """One line naming each cause's count and first line number, or None when nothing was skipped."""
        if not self.skipped:
            return None
        ordered = sorted(self.skipped.items(), key=lambda item: item[1][1])  # by first line
        causes = ", ".join(f"{n:,} {cause} (first: line {first})" for cause, (n, first) in ordered)
        return f"{source}: skipped {self.skipped_lines:,} lines: {causes}"


def _jsonl_documents(path: Path, key: str, stats: CorpusStats) -> Iterator[Tuple[int, str]]:
    """(line number, text) of each usable line of a JSONL file; the others are counted in ``stats``."""
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                stats.skip("blank", lineno)
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                stats.skip("invalid UTF-8", lineno)
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                stats.skip("not JSON", lineno)
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get(key), str):
                stats.skip(f"without a string {key!r} field", lineno)
                continue
            yield lineno, rec[key]


def _stdlib_texts(files: List[Path]) -> Iterator[Tuple[int, str]]:
    for i, f in enumerate(files, 1):
        yield i, f.read_text(encoding="utf-8", errors="replace")


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


def _write_indexed(prefix: Path, documents: Iterator[Tuple[int, str]], tokenizer, stats: CorpusStats,
                   source: str) -> None:
    """Tokenize documents into ``prefix.bin``/``prefix.idx`` (megatron IndexedDatasetBuilder) and
    ``prefix.stats.json``. Writes ``prefix.tmp.*`` first and renames; removes them on any failure."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = np.uint16 if tokenizer.vocab_size <= 65536 else np.int32
    tmp_bin, tmp_idx = Path(f"{prefix}.tmp.bin"), Path(f"{prefix}.tmp.idx")
    builder = IndexedDatasetBuilder(str(tmp_bin), dtype=dtype)
    try:
        for lineno, text in documents:
            try:
                ids = tokenizer.tokenize(text)
            except (UnicodeError, ValueError):
                stats.skip("text the tokenizer rejects", lineno)
                continue
            if len(ids) == 0:
                stats.empty += 1
                continue
            ids = list(ids) + [tokenizer.eod]
            builder.add_document(np.asarray(ids, dtype=dtype), [len(ids)])
            stats.documents += 1
            stats.tokens += len(ids)
        if stats.documents == 0:
            raise DataError(f"{source}: no usable document ({stats.describe()}); fix: check the file "
                            f"and data.json_key")
        builder.finalize(str(tmp_idx))
        write_atomic(f"{prefix}.stats.json", json.dumps(stats.__dict__, sort_keys=True))
        os.replace(tmp_idx, f"{prefix}.idx")
        os.replace(tmp_bin, f"{prefix}.bin")
    except BaseException:
        builder.data_file.close()
        for tmp in (tmp_bin, tmp_idx):
            tmp.unlink(missing_ok=True)
        raise


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


def prepare_source(data: DataConfig, prefix: Path, name: str, files: List[Path], tokenizer,
                   log: Callable[[str], None]) -> None:
    """Tokenize one source into ``prefix`` unless cached; print its counts (and skipped lines)."""
    source = str(files[0]) if data.kind == "jsonl" else f"data.kind=stdlib ({len(files)} files)"
    with file_lock(prefix):  # concurrent launchers prepare once
        if Path(f"{prefix}.bin").exists() and Path(f"{prefix}.idx").exists():
            stats, note = _cached_stats(prefix)
            state = f"cached in {prefix}{note}"
        else:
            log(f"preparing data: tokenizing {source} into {prefix}.bin/.idx")
            stats = CorpusStats()
            docs = _jsonl_documents(files[0], data.json_key, stats) if data.kind == "jsonl" else _stdlib_texts(files)
            meter = Meter("tokenizing", sum(f.stat().st_size for f in files), log=log,
                          counts=lambda: {"documents": stats.documents, "tokens": stats.tokens})
            _write_indexed(prefix, meter.wrap(docs, lambda doc: len(doc[1])), tokenizer, stats, source)
            meter.close()
            state = f"prepared in {prefix}"
    log(f"data {name}: {stats.describe()} ({state})")
    warning = stats.warning(source)
    if warning:
        log(f"warning: {warning}")
