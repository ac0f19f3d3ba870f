"""Corpus preparation and data blends, with real files, megatron-core's tokenizer and datasets.

* Corpus faults (one policy: skip and count): a JSONL fixture with each bad line type prepares,
  the counts and a warning line naming the file and each first bad line number are printed, no
  temporary file is left; a file without any document is refused in one line.
* A two-file blend prepares from a cold cache in the launcher (no process group there), trains,
  the ranks only load the indices the launcher built, and changing the weights is refused with a
  diff naming data.weights.

Text: tests/fixtures/data/tinyshakespeare_300.jsonl, the first 300 speeches of Tiny Shakespeare (public
domain; one JSON document per speech), shipped with the tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import numpy as np
import pytest
from conftest import REPO, read_metrics, run_cli

from orchestrator.config.schema import DataConfig
from orchestrator.data import corpus
from orchestrator.data.prepare import prepare
from orchestrator.data.tokenizer import build_tokenizer, tokenizer_identity
from orchestrator.errors import DataError

SHAKESPEARE = REPO / "tests" / "fixtures" / "data" / "tinyshakespeare_300.jsonl"


def speeches(start: int, count: int) -> List[str]:
    """``count`` JSONL lines of the fixture from line ``start`` (0-based), as bytes-safe text."""
    with SHAKESPEARE.open(encoding="utf-8") as f:
        lines = [line.rstrip("\n") for i, line in enumerate(f) if start <= i < start + count]
    assert len(lines) == count, f"{SHAKESPEARE} has fewer than {start + count} speeches"
    return lines


def leftovers(cache: Path) -> List[str]:
    return sorted(p.name for p in cache.rglob("*") if ".tmp" in p.name)


@pytest.fixture(scope="module")
def byte_tokenizer():
    return build_tokenizer(DataConfig())


@pytest.mark.mcore_lines
def test_identity_is_megatrons_byte_tokenizer(byte_tokenizer):
    ident = tokenizer_identity(DataConfig())
    assert ident["vocab_size"] == byte_tokenizer.vocab_size == 258 and ident["eod"] == byte_tokenizer.eod == 256


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_lines_are_skipped_counted_and_reported(tmp_path, byte_tokenizer, workers):
    """In this process or in two tokenizing processes (data.workers=2): the same counts, lines and ids."""
    good = speeches(0, 3)
    lines = [
        good[0].encode(),  # 1 document
        b'{"text": "caf\xe9 au lait"}',  # 2 invalid UTF-8 (latin-1 byte)
        b'{"text": "unterminated',  # 3 not JSON
        b'{"id": 7, "body": "no text key"}',  # 4 without the text key
        b'{"text": ""}',  # 5 empty document
        b"",  # 6 blank
        b'{"text": "\\ud800 lone surrogate"}',  # 7 text the tokenizer rejects
        b'["text", "not an object"]',  # 8 without the text key (not an object)
        good[1].encode(),
        b'{"text": 42}',  # 9 document, 10 text not a string
        good[2].encode(),
    ]  # 11 document
    path = tmp_path / "corpus.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cache = tmp_path / "cache"
    said: List[str] = []
    prepared = prepare(
        DataConfig(kind="jsonl", paths=[str(path)], cache_dir=str(cache), workers=workers), log=said.append
    )
    texts = [json.loads(g)["text"] for g in good]
    tokens = sum(len(t.encode()) + 1 for t in texts)  # UTF-8 bytes + one <eod> each
    summary = [s for s in said if s.startswith("data corpus: ")]
    assert summary and summary[0].startswith(
        f"data corpus: 3 documents, {tokens:,} tokens, 7 skipped lines, 1 empty documents"
    ), said
    (warning,) = [s for s in said if s.startswith("warning: ")]
    assert warning == (
        f"warning: {path}: skipped 7 lines: 1 invalid UTF-8 (first: line 2), 1 not JSON (first: "
        "line 3), 3 without a string 'text' field (first: line 4), 1 blank (first: line 6), "
        "1 text the tokenizer rejects (first: line 7)"
    ), warning
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prepared.prefixes[0], mmap=True)
    assert len(ds) == 3
    for i, text in enumerate(texts):
        assert ds[i].tolist() == list(text.encode()) + [byte_tokenizer.eod]
    assert leftovers(cache) == []
    again: List[str] = []  # cached: the same counts and warning, nothing tokenized
    prepare(DataConfig(kind="jsonl", paths=[str(path)], cache_dir=str(cache)), log=again.append)
    assert [s.split(" (")[0] for s in again] == [s.split(" (")[0] for s in said if not s.startswith("preparing")]


def test_a_file_without_documents_is_refused_in_one_line_and_leaves_nothing(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": ""}\nnot json\n\xff\xfe\n')
    cache = tmp_path / "cache"
    with pytest.raises(DataError) as err:
        prepare(DataConfig(kind="jsonl", paths=[str(path)], cache_dir=str(cache)), log=lambda _: None)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg and "no usable document" in msg and "1 empty documents" in msg
    assert leftovers(cache) == [] and not list(cache.rglob("*.bin"))


def test_a_failure_while_writing_removes_the_temporary_files(tmp_path, byte_tokenizer):
    def chunks():
        yield [(1, b'{"text": "first document"}')]
        raise KeyboardInterrupt  # Ctrl-C in the middle of a preparation

    prefix = tmp_path / "prepared" / "x"
    prefix.parent.mkdir()
    encoder = corpus.Encoder(byte_tokenizer, 256, np.uint16, "text")
    with pytest.raises(KeyboardInterrupt):
        corpus._write_indexed(prefix, chunks(), encoder, 1, corpus.CorpusStats(), "x.jsonl")
    assert list(prefix.parent.iterdir()) == []


def _big_corpus(path: Path, docs: int, words: int) -> Path:
    """``docs`` JSONL documents of ``words`` words each (about 6 bytes a word): results of 256 documents
    (a chunk) far larger than a pipe's 64 KB buffer."""
    vocab = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda"]
    with path.open("w") as f:
        for d in range(docs):
            f.write(json.dumps({"text": " ".join(vocab[(d * 7 + w * 3) % 9] for w in range(words))}) + "\n")
    return path


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_tokenizing_in_workers_stops_the_launcher_and_its_workers(tmp_path, sig):
    """A signal to the launcher while 2 worker processes tokenize a JSONL corpus (results of 256 documents, about
    0.5 MB): the launcher exits 128 + the signal with one line naming it, and no worker is left. With
    multiprocessing.Pool, SIGINT hung launcher and workers for good (3 of 3): the pool's terminate() waited on the
    result queue's lock, held by a worker writing its result into a pipe nobody read any more."""
    import psutil

    corpus_path = _big_corpus(tmp_path / "big.jsonl", 8000, 300)  # 14 MB: under a second of tokenizing, quiet
    args = ["+experiment=gpt_pp2_dp2", "data=jsonl", f"data.paths=[{corpus_path}]", "data.workers=2"]
    args += ["training.train_iters=2", f"run.root={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1"),
    )
    lines, workers = [], []
    try:
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if "preparing data: tokenizing " in line:
                break
        # The workers are forked after megatron-core's indexed-dataset writer is imported (a CI run's meter line
        # came before them): the signal goes once both exist, while they tokenize.
        deadline = time.monotonic() + 60
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            workers = psutil.Process(proc.pid).children(recursive=True)
            time.sleep(0.01)
        proc.send_signal(sig)
        lines += proc.communicate(timeout=60)[0].splitlines()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    name = signal.Signals(sig).name
    assert len(workers) == 2, lines  # the signal landed while the workers tokenized
    assert proc.returncode == 128 + sig, lines
    assert lines[-1].startswith(f"interrupted ({name}): stopped (the job's ranks too, if any had started); "), lines
    assert "Traceback" not in "\n".join(lines), lines
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], workers
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").rglob("config.yaml"))
    assert leftovers(tmp_path / "cache") == []


def _megabyte_each(chunk):
    if chunk == "bad":
        raise ValueError("not a chunk")
    return [chunk] * (1 << 20)  # pickled: ~2 MB, far beyond a pipe's buffer


def test_tokenizing_workers_keep_order_raise_a_failure_and_none_outlives_its_consumer():
    """orchestrator.data.workers: results in the order of the chunks; a worker's exception raised in the launcher
    naming it; a consumer that stops after the first result (a signal's KeyboardInterrupt) leaves no worker, though
    the others are blocked writing 2 MB results nobody reads (the deadlock of multiprocessing.Pool.terminate())."""
    import psutil

    from orchestrator.data.workers import encoded_in_workers

    got = [r[0] for r in encoded_in_workers(_megabyte_each, iter(range(7)), 3)]
    assert got == list(range(7))
    with pytest.raises(RuntimeError, match=r"tokenizing worker \d+: ValueError: not a chunk"):
        list(encoded_in_workers(_megabyte_each, iter([1, "bad", 2]), 2))
    before = set(psutil.Process().children())  # an earlier test's child of this process is not a worker
    results = encoded_in_workers(_megabyte_each, iter(range(100)), 3)
    assert next(results)[0] == 0
    workers = [p for p in psutil.Process().children() if p not in before]
    assert len(workers) == 3, workers
    results.close()
    assert not [p for p in workers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], workers


# ---- a blend through the CLI ------------------------------------------------------------------------
@pytest.mark.slow
def test_blend_trains_from_a_cold_cache_and_changed_weights_are_refused(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("\n".join(speeches(0, 150)) + "\n")
    b.write_text("\n".join(speeches(150, 150)) + "\n")
    cache = tmp_path / "cache"  # cold
    run_dir = tmp_path / "run"
    common = [
        "parallelism=none",
        "data=jsonl",
        f"data.paths=[{a},{b}]",
        f"run.dir={run_dir}",
        "training.train_iters=4",
        "checkpoint.save_interval=2",
        "training.global_batch_size=8",
        "training.micro_batch_size=4",
        "training.eval_iters=0",
        "training.log_interval=1",
    ]
    first = run_cli(common + ["data.weights=[0.5,0.5]"], cache=cache, timeout=400)
    assert "data a: 150 documents" in first.stdout and "data b: 150 documents" in first.stdout
    assert [r["iteration"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    manifest = json.loads((run_dir / "checkpoints" / "iter_0000004" / "manifest.json").read_text())
    assert manifest["data"]["weights"] == [0.5, 0.5] and manifest["config"]["data"]["weights"] == [0.5, 0.5]
    # A job of one task builds the indices itself, once, before its first iteration (the launcher, which
    # would import torch and megatron-core for them, does not); none was rebuilt by the resume below.
    submitted = min(
        r["time"]
        for r in map(json.loads, (run_dir / "jobs.jsonl").read_text().splitlines())
        if r["event"] == "submitted"
    )
    first_step = min(r["time"] for r in read_metrics(run_dir))
    indices = sorted((cache / "indices").iterdir())
    built = {p.name: p.stat().st_mtime for p in indices}
    assert any("BlendedDataset" in p.name for p in indices)
    assert all(submitted < t < first_step for t in built.values()), (built, submitted, first_step)

    refused = run_cli(common + ["data.weights=[0.7,0.3]", "training.train_iters=6"], cache=cache, check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    err = refused.stderr.strip().splitlines()
    assert err[0].startswith("error: ") and "Traceback" not in refused.stderr
    (row,) = [line for line in err if line.startswith("data.weights ")]
    assert "[0.5,0.5]" in row and "[0.7,0.3]" in row and "refused" in row
    assert "data.weights=[0.5,0.5]" in refused.stderr  # the override that matches the checkpoint
    assert [r["iteration"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]  # nothing trained
    assert {p.name: p.stat().st_mtime for p in (cache / "indices").iterdir()} == built
    assert np.isfinite([r["lm_loss"] for r in read_metrics(run_dir)]).all()
