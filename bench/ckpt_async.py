"""Asynchronous vs synchronous checkpoint saves: gpt_125m + Adam on CPU, ~1.5 GB per checkpoint.

Runs the real CLI three times in a scratch directory (one rank, megatron's mock data, one sample of
128 tokens per iteration, a save after every iteration): ``checkpoint.async_save=false``, then
``true``, then a resume of the first (for the load time). The vocabulary is padded to GPT-2's
50304 rows (``model.make_vocab_size_divisible_by=50304``), so the model has GPT-2 small's 125M
parameters. Reads the ``saved`` and ``start`` records of each run's metrics.jsonl and prints, per
save, the slowest rank's blocking time (how long training waited) and write time, then

    blocking ratio = median async blocking / median sync blocking      (target <= 0.2)

the load time of the resume, and whether both runs trained the same losses (they must).

    python bench/ckpt_async.py                       # ~1.5 GB x 3 saves x 2 runs in a temporary directory
    python bench/ckpt_async.py --dir /scratch/bench --iters 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]


def _run(root: Path, name: str, iters: int, extra: List[str]) -> List[dict]:
    args = [
        "model=gpt_125m",
        "parallelism=none",
        "data=mock",
        "model.make_vocab_size_divisible_by=50304",
        "model.seq_length=128",
        "training.micro_batch_size=1",
        "training.global_batch_size=1",
        f"training.train_iters={iters}",
        "checkpoint.save_interval=1",
        "checkpoint.keep_last=2",
        "training.eval_iters=0",
        "training.log_interval=1",
        "logging.tensorboard=false",
        f"run.root={root}",
        f"run.name={name}",
        *extra,
    ]
    env = dict(os.environ, ORCHESTRATOR_CACHE=str(root / "cache"), PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"  {name} {' '.join(extra)}: {time.perf_counter() - t0:.0f} s wall", flush=True)
    return [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]


def _saves(records: List[dict]) -> List[dict]:
    return [r for r in records if r.get("event") == "saved"]


def _losses(records: List[dict]) -> Dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in records if "event" not in r}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed after)")
    parser.add_argument("--iters", type=int, default=3, help="iterations per run = saves per run")
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt_async_"))
    try:
        sync = _run(root, "sync", args.iters, [])
        asyn = _run(root, "async", args.iters, ["checkpoint.async_save=true"])
        resumed = _run(root, "sync", args.iters + 1, [])
        print(f"{'save':>6} {'GB':>6} {'sync blocked s':>15} {'async blocked s':>16} {'async written s':>16}")
        for s, a in zip(_saves(sync), _saves(asyn)):
            print(
                f"{s['iteration']:>6} {s['bytes'] / 1e9:>6.2f} {s['blocking_s']:>15.3f} {a['blocking_s']:>16.3f} "
                f"{a['write_s']:>16.3f}"
            )
        sync_b = statistics.median(r["blocking_s"] for r in _saves(sync))
        async_b = statistics.median(r["blocking_s"] for r in _saves(asyn))
        load_s = [r for r in resumed if r.get("event") == "start"][-1]["load_s"]
        same = _losses(sync) == _losses(asyn)
        print(
            f"median blocking: sync {sync_b:.3f} s, async {async_b:.3f} s; blocking ratio async/sync = "
            f"{async_b / sync_b:.3f} (target <= 0.2)"
        )
        print(f"load of a {_saves(sync)[-1]['bytes'] / 1e9:.2f} GB checkpoint (resume, slowest rank): {load_s:.2f} s")
        print(f"losses identical with and without async: {same}")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
