"""Data preparation vs Megatron-LM's own: tokens/s of ours / tools/preprocess_data.py, same ids.

    python bench/preprocess.py --megatron-lm ~/src/Megatron-LM [--workers 2] [--mb 20]
        [--input corpus.jsonl] [--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt]
        [--upstream-tokenizer legacy|huggingface]

preprocess_data.py is not in the megatron-core wheel: ``--megatron-lm`` is a Megatron-LM checkout
(the tag matching the installed megatron-core, e.g. ``core_v0.16.1``; its ``megatron/training``
imports ``triton``, so ``pip install triton`` on a CPU machine). Both sides run as fresh processes
on the same JSONL file with the same GPT-2 BPE files and the same number of worker processes, and the
wall time of each (start-up and imports included, what a user waits for) gives its tokens/s:

* ours: ``orchestrator.data.prepare.prepare`` with ``data.tokenizer=GPT2BPETokenizer`` and
  ``data.workers`` (megatron-core's HuggingFaceTokenizer, IndexedDatasetBuilder);
* upstream: ``tools/preprocess_data.py --tokenizer-type GPT2BPETokenizer --append-eod --workers N``
  with ``--legacy-tokenizer`` (Megatron-LM's own GPT-2 BPE, the default ``legacy``) or
  ``--tokenizer-type HuggingFaceTokenizer`` over the same files (``huggingface``: the same library
  as ours; megatron-core 0.16.1's non-legacy GPT2BPETokenizer loads GPT-2 from the hub, offline it fails).

Without ``--input`` the corpus is this Python's standard-library sources, one JSON document per
file, up to ``--mb`` MB; without BPE files a GPT-2-style byte-level BPE (``--vocab-size`` ids, eod
``<|endoftext|>`` last) is trained on that corpus with the ``tokenizers`` package. At the end both
``.bin/.idx`` are read with megatron-core's IndexedDataset and compared document by document.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

OURS = """
import json, sys, time
t = time.perf_counter()
from orchestrator.config.schema import DataConfig
from orchestrator.data.prepare import prepare
a = json.loads(sys.argv[1])
p = prepare(DataConfig(kind="jsonl", paths=[a["input"]], tokenizer="GPT2BPETokenizer", vocab_file=a["vocab"],
                       merge_file=a["merges"], workers=a["workers"], cache_dir=a["cache"]), log=lambda m: None)
print(json.dumps({"prefix": p.prefixes[0], "inner_s": time.perf_counter() - t}))
"""


def corpus(path: Path, mb: float) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    total, budget = 0, int(mb * 1e6)
    with path.open("w", encoding="utf-8") as out:
        for f in sorted(root.rglob("*.py")):
            text = f.read_text(encoding="utf-8", errors="replace")
            if not text.strip() or "site-packages" in f.parts:
                continue
            out.write(json.dumps({"text": text}) + "\n")
            total += len(text.encode())
            if total >= budget:
                break


def train_bpe(corpus_file: Path, vocab_size: int, out: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    with corpus_file.open(encoding="utf-8") as f:
        texts = (json.loads(line)["text"] for line in f)
        tok.train_from_iterator(
            texts,
            trainers.BpeTrainer(
                vocab_size=vocab_size - 1, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
            ),
        )
    tok.add_special_tokens(["<|endoftext|>"])  # last id, as in GPT-2
    vocab, merges = tok.model.save(str(out), "bench")
    vocab_file = Path(vocab)
    ids = json.loads(vocab_file.read_text())
    ids["<|endoftext|>"] = max(ids.values()) + 1
    vocab_file.write_text(json.dumps(ids))
    return vocab_file, Path(merges)


def run_upstream(args, vocab: Path, merges: Path, work: Path) -> tuple:
    prefix = work / "upstream"
    if args.upstream_tokenizer == "legacy":
        tok = [
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            str(vocab),
            "--merge-file",
            str(merges),
            "--legacy-tokenizer",
        ]
    else:
        hf = work / "hf-gpt2"
        hf.mkdir(exist_ok=True)
        (hf / "vocab.json").write_bytes(vocab.read_bytes())
        (hf / "merges.txt").write_bytes(merges.read_bytes())
        (hf / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "GPT2Tokenizer",
                    "eos_token": "<|endoftext|>",
                    "bos_token": "<|endoftext|>",
                    "unk_token": "<|endoftext|>",
                    "model_max_length": 1 << 30,
                }
            )
        )
        tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(hf)]
    cmd = [
        sys.executable,
        str(Path(args.megatron_lm) / "tools" / "preprocess_data.py"),
        "--input",
        str(args.input),
        "--output-prefix",
        str(prefix),
        "--append-eod",
        "--workers",
        str(args.workers),
        *tok,
    ]
    env = dict(os.environ, PYTHONPATH=str(Path(args.megatron_lm).resolve()), TOKENIZERS_PARALLELISM="false")
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"preprocess_data.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return f"{prefix}_text_document", seconds


def run_ours(args, vocab: Path, merges: Path, work: Path) -> tuple:
    spec = json.dumps(
        {
            "input": str(args.input),
            "vocab": str(vocab),
            "merges": str(merges),
            "workers": args.workers,
            "cache": tempfile.mkdtemp(prefix="cache-", dir=work),
        }
    )  # cold
    env = dict(os.environ, PYTHONPATH=str(REPO))
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", OURS, spec], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if proc.returncode != 0:
        sys.exit(f"orchestrator's preparation failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["prefix"], seconds


def compare(ours: str, upstream: str) -> tuple:
    """(documents, tokens, first differing document or None, dtypes)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    a, b = IndexedDataset(ours, mmap=True), IndexedDataset(upstream, mmap=True)
    dtypes = (np.dtype(a.index.dtype).name, np.dtype(b.index.dtype).name)
    if len(a) != len(b):
        return len(a), int(a.sequence_lengths.sum()), f"{len(a)} vs {len(b)} documents", dtypes
    for i in range(len(a)):
        if not np.array_equal(a[i], b[i]):
            return len(a), int(a.sequence_lengths.sum()), i, dtypes
    return len(a), int(a.sequence_lengths.sum()), None, dtypes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout (holds tools/preprocess_data.py)")
    ap.add_argument("--input", type=Path, help="JSONL corpus ({'text': ...} per line); default: stdlib sources")
    ap.add_argument("--mb", type=float, default=20.0, help="MB of stdlib text when no --input")
    ap.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--vocab-file", type=Path)
    ap.add_argument("--merge-file", type=Path)
    ap.add_argument("--vocab-size", type=int, default=50257, help="ids of the BPE trained when no files are given")
    ap.add_argument("--upstream-tokenizer", choices=("legacy", "huggingface"), default="legacy")
    ap.add_argument("--work", type=Path, help="working directory (default: a temporary one)")
    args = ap.parse_args()
    if not (Path(args.megatron_lm) / "tools" / "preprocess_data.py").is_file():
        sys.exit(f"--megatron-lm {args.megatron_lm}: no tools/preprocess_data.py there")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-preprocess-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.input is None:
        args.input = work / "corpus.jsonl"
        corpus(args.input, args.mb)
    vocab, merges = args.vocab_file, args.merge_file
    if vocab is None or merges is None:
        vocab, merges = train_bpe(args.input, args.vocab_size, work)
    size_mb = args.input.stat().st_size / 1e6
    print(
        f"corpus {args.input} ({size_mb:.1f} MB), GPT-2 BPE {vocab} ({len(json.loads(vocab.read_text()))} ids), "
        f"{args.workers} workers, upstream tokenizer: {args.upstream_tokenizer}",
        flush=True,
    )
    up_prefix, up_s = run_upstream(args, vocab, merges, work)
    our_prefix, our_s = run_ours(args, vocab, merges, work)
    docs, tokens, diff, dtypes = compare(our_prefix, up_prefix)
    print(f"preprocess_data.py: {up_s:.1f} s, {tokens / up_s:,.0f} tokens/s")
    print(f"orchestrator:       {our_s:.1f} s, {tokens / our_s:,.0f} tokens/s")
    print(f"ours / preprocess_data.py: {up_s / our_s:.2f} (tokens/s)")
    same = diff is None and dtypes[0] == dtypes[1]
    print(
        f"same token ids: {'yes' if same else 'NO'} ({docs:,} documents, {tokens:,} tokens, dtype {dtypes[0]} "
        f"vs {dtypes[1]}{'' if diff is None else f'; first difference: document {diff}'})"
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
