"""What straggler detection (``training.straggler``) costs a step: goal <= 1% of the step time.

Two measures, printed with the load average (a shared machine's wall times are only as quiet as it is):

1. A/B jobs: ``+experiment=gpt_pp2_dp2`` (4 CPU ranks, PP=2 x DP=2; other overrides after ``--``) with the
   detector on (the default, every 8 iterations) and off (``training.straggler.interval=null``),
   alternated ``--pairs`` times; per job the summary's median step wall time and the logging rank's median
   CPU time per step; the overhead is the difference of the medians over the pairs.
2. The detector's own work, timed directly on this machine: one timed call (the wrapper around a forward
   or backward step: two clock reads of each kind) and one window's verdict on 4 gloo ranks (the
   ``all_gather`` of 5 numbers and the judgement), combined for the job's calls per iteration
   (2 x micro-batches per rank) and divided by its step time: an upper bound that does not depend on the
   A/B noise.

    python bench/straggler.py                    # 3 pairs of 60-iteration jobs
    python bench/straggler.py --pairs 5 -- training.train_iters=100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parents[1]
BASE = [
    "+experiment=gpt_pp2_dp2",
    "data.stdlib_max_mb=2",
    "training.eval_iters=0",
    "training.log_interval=20",
    "checkpoint.save_interval=null",
    "checkpoint.save_at_end=false",
    "training.train_iters=60",
]


def job(root: str, name: str, on: bool, extra: List[str]) -> Tuple[float, float, int]:
    """(median step wall s, median step CPU s of the logging rank, stragglers named) of one job."""
    args = [*BASE, *extra, f"run.root={root}", f"run.name={name}"]
    if not on:
        args.append("training.straggler.interval=null")
    subprocess.run(
        [sys.executable, "-m", "orchestrator", *args],
        cwd=REPO,
        check=True,
        capture_output=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    records = [json.loads(x) for x in (Path(root) / name / "metrics.jsonl").read_text().splitlines()]
    summary = [r for r in records if r.get("event") == "summary"][-1]
    named = sum(1 for r in records if r.get("event") == "straggler")
    return summary["step_time_median_s"], summary["step_cpu_time_median_s"], named


def wrapper_cost(n: int = 200_000) -> float:
    """Seconds one timed call adds on a CPU (the clock reads and the closure), by timing a no-op both ways."""

    def noop():
        return None

    def timed():
        w0, c0 = time.perf_counter(), time.thread_time()
        out = noop()
        _ = time.perf_counter() - w0, time.thread_time() - c0
        return out

    t0 = time.perf_counter()
    for _ in range(n):
        noop()
    bare = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        timed()
    return max(0.0, (time.perf_counter() - t0 - bare) / n)


VERDICT = r"""
import os, statistics, time, torch, torch.distributed as dist
from orchestrator.runtime.faults.straggler import judge
dist.init_process_group("gloo")
group = dist.new_group(backend="gloo")
times = []
for i in range(60):
    dist.barrier()
    t0 = time.perf_counter()
    mine = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0], dtype=torch.float64)
    got = [torch.zeros(5, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(got, mine, group=group)
    judge([g[0].item() for g in got], 0.2)
    times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    print(statistics.median(times[10:]))
dist.destroy_process_group()
"""


def verdict_cost() -> float:
    """Median seconds of one window's verdict on 4 gloo ranks of this machine (torchrun's env, one process each)."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(VERDICT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", "--master-port=29613", f.name],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
    )
    os.unlink(f.name)
    if out.returncode != 0:
        raise SystemExit(f"verdict timing failed:\n{out.stderr[-2000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}", flush=True)
    on: List[Tuple[float, float, int]] = []
    off: List[Tuple[float, float, int]] = []
    with tempfile.TemporaryDirectory(prefix="bench-straggler-") as root:
        for i in range(args.pairs):
            on.append(job(root, f"on{i}", True, extra))
            off.append(job(root, f"off{i}", False, extra))
            print(
                f"pair {i}: on {on[-1][0] * 1e3:.1f} ms/step ({on[-1][1] * 1e3:.1f} CPU-ms), "
                f"off {off[-1][0] * 1e3:.1f} ms/step ({off[-1][1] * 1e3:.1f} CPU-ms); named {on[-1][2]}",
                flush=True,
            )
    wall_on, wall_off = statistics.median(x[0] for x in on), statistics.median(x[0] for x in off)
    cpu_on, cpu_off = statistics.median(x[1] for x in on), statistics.median(x[1] for x in off)
    print(
        f"A/B step wall: on {wall_on * 1e3:.1f} ms, off {wall_off * 1e3:.1f} ms: {(wall_on / wall_off - 1) * 100:+.2f}%"
    )
    print(
        f"A/B step CPU (logging rank): on {cpu_on * 1e3:.2f} ms, off {cpu_off * 1e3:.2f} ms: "
        f"{(cpu_on / cpu_off - 1) * 100:+.2f}%"
    )
    call, verdict = wrapper_cost(), verdict_cost()
    calls = 2 * 2 * 1  # forward + backward, 2 micro-batches (GBS 16 / (MBS 4 x DP 2)), one chunk per rank
    per_iter = calls * call + verdict / 8  # a verdict every training.straggler.interval = 8 iterations
    print(
        f"direct: one timed call {call * 1e6:.2f} us, one verdict {verdict * 1e3:.3f} ms (4 gloo ranks); "
        f"per iteration {per_iter * 1e6:.1f} us = {per_iter / wall_off * 100:.3f}% of the {wall_off * 1e3:.1f} ms "
        f"step (goal <= 1%)"
    )
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
