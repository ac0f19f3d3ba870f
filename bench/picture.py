"""What ``plan_picture=FILE.png`` adds to ``plan=true``: wall and CPU time of the plan with and without it.

Runs ``python -m orchestrator ARGS plan=true`` and the same with ``plan_picture=<tmp>/p.png``
alternately, ``--repeat`` times each, and prints the median wall and CPU seconds (the child's
user + system time) of both and their difference; the goal is under 1 s more. Default layout: the
README's seed case, gpt_6.7b on 32 x A100-40GB with PP4, m = 8, v = 2 (the interleaved schedule, 64
forward and backward blocks per rank to draw).

    python bench/picture.py
    python bench/picture.py --repeat 7 -- model=gpt_125m parallelism=pp2_dp2
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parents[1]
SEED = [
    "model=gpt_6.7b",
    "parallelism=pp4",
    "parallelism.data_parallel_size=null",
    "cluster=slurm_a100_4x8",
    "training.precision=bf16",
    "training.micro_batch_size=4",
    "training.global_batch_size=256",
    "gpu=A100-40GB",
    "model.recompute_granularity=full",
    "model.recompute_method=uniform",
    "model.recompute_num_layers=1",
    "parallelism.virtual_pipeline_model_parallel_size=2",
]


def timed(args: List[str], cwd: Path) -> Tuple[float, float]:
    """(wall s, CPU s) of one ``python -m orchestrator ARGS`` (exits 0 or the bench stops)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"orchestrator {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("overrides", nargs="*", help="the layout (default: the README's seed case, PP4 m=8 v=2)")
    args = ap.parse_args()
    base = (args.overrides or SEED) + ["plan=true"]
    with tempfile.TemporaryDirectory() as tmp:
        cwd, png = Path(tmp), Path(tmp) / "p.png"
        plain, drawn = [], []
        for _ in range(args.repeat):
            plain.append(timed(base, cwd))
            drawn.append(timed(base + [f"plan_picture={png}"], cwd))
        size = png.stat().st_size
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    print(
        f"plan=true, median of {args.repeat}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}: "
        f"{' '.join(base[:-1])}"
    )
    print(f"  plan alone:         {med(plain, 0):.2f} s wall, {med(plain, 1):.2f} s CPU")
    print(f"  with plan_picture:  {med(drawn, 0):.2f} s wall, {med(drawn, 1):.2f} s CPU ({size / 1024:.0f} KiB PNG)")
    print(
        f"  the picture adds:   {med(drawn, 0) - med(plain, 0):+.2f} s wall, {med(drawn, 1) - med(plain, 1):+.2f} s CPU"
        f" (goal: under 1 s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
