"""What the step breakdown (``training.breakdown_interval``) costs, and whether it explains the step.

1. In process: the cost of one timed section (megatron's ``config.timers(name).start()`` ... ``.stop()``
   on :class:`orchestrator.runtime.training.breakdown.StepClock`, CPU clock), in microseconds.
2. The 4-rank ``gpt_pp2_dp2`` job (gpt_tiny, PP2 x DP2, 2 micro-batches), ``--iters`` iterations, with the
   breakdown off (0) and on (10), alternating, ``--repeat`` times each: the logging rank's median step and
   median CPU time per step, and the on/off ratios; the sections per step; the breakdown's per-stage
   shares and its ``other`` (what no section covers: the step is explained within 5% when |other| <= 5%).

On a shared machine wall times move with the load; the CPU time per step and the in-process section cost
are what to read. Measured here 2026-12-03, --repeat 3: at load 2-3, one section 1.00 us, ~18 per step ->
0.015% of the CPU time per step; on / off: step 0.993, CPU per step 0.998; largest |other| 0.8%. At load
9-15 (3 other agents): 1.73 us, on / off 0.987 and 0.971 (noise); largest |other| 0.7%.

    python bench/breakdown.py                       # ~2 minutes on 2 quiet cores
    python bench/breakdown.py --iters 40 --repeat 3 --root /tmp/bench_breakdown
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def section_cost_us(n: int = 200_000) -> float:
    """Microseconds per start/stop pair of a megatron-named section (the clock built without a process
    group: only its timing path runs here)."""
    from orchestrator.plan.step_breakdown import CATEGORIES
    from orchestrator.runtime.training.breakdown import RunQueueDelay, StepClock

    clock = StepClock.__new__(StepClock)
    clock.cuda, clock._sections, clock._open, clock._intervals = False, {}, [], []
    clock.delay = RunQueueDelay()
    clock._step = dict.fromkeys(CATEGORIES, 0.0)
    start = time.perf_counter()
    for _ in range(n):
        clock("forward-compute", log_level=2).start()
        clock("forward-compute").stop()
    return 1e6 * (time.perf_counter() - start) / n


def run(root: Path, name: str, interval: int, iters: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "orchestrator",
        "+experiment=gpt_pp2_dp2",
        f"training.train_iters={iters}",
        "training.eval_iters=0",
        "checkpoint.save_interval=null",
        "checkpoint.save_at_end=false",
        "logging.tensorboard=false",
        "data.stdlib_max_mb=2",
        f"training.breakdown_interval={interval}",
        f"run.root={root}",
        f"run.name={name}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        sys.exit(f"run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reversed(records) if r.get("event") == "summary")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--root", default=None)
    args = ap.parse_args()
    root = Path(args.root or tempfile.mkdtemp(prefix="bench_breakdown_"))
    cost = section_cost_us()
    print(f"one timed section (start + stop, CPU clock): {cost:.2f} us; load {load()}", flush=True)
    got = {0: [], 10: []}
    for r in range(args.repeat):
        for interval in (0, 10):
            s = run(root, f"b{interval}_{r}", interval, args.iters)
            got[interval].append(s)
            print(
                f"  breakdown_interval={interval:<2} run {r}: median step {1e3 * s['step_time_median_s']:.1f} ms, "
                f"CPU {1e3 * s['step_cpu_time_median_s']:.1f} ms/step; load {load()}",
                flush=True,
            )
    med = {
        k: (
            statistics.median(s["step_time_median_s"] for s in v),
            statistics.median(s["step_cpu_time_median_s"] for s in v),
        )
        for k, v in got.items()
    }
    print(
        f"on / off: step {med[10][0] / med[0][0]:.3f}, CPU per step {med[10][1] / med[0][1]:.3f} "
        f"(medians of {args.repeat} alternating runs each, the logging rank)"
    )
    pairs = 4 * 2 + 2 + 2 + 4 + 2  # PP2 m=2: F, B, data and p2p per micro-batch; grad syncs; optimizer; loss, sync
    print(
        f"sections per step on a rank of PP2, m = 2: about {pairs} -> {pairs * cost:.0f} us, "
        f"{pairs * cost / (1e6 * med[10][1]):.3%} of its CPU time per step"
    )
    worst = max(abs(st["other"]) for s in got[10] for st in s["breakdown"]["stages"])
    for st in got[10][-1]["breakdown"]["stages"]:
        print(
            "  stage {stage}: ".format(**st)
            + " ".join(
                f"{k} {st[k]:.1%}"
                for k in ("compute", "bubble", "dp_comm", "optimizer", "data", "sync", "cpu_wait", "other")
            )
        )
    print(
        f"largest |other| over stages and runs: {worst:.1%} ({'within' if worst <= 0.05 else 'NOT within'} 5%); "
        f"load {load()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
