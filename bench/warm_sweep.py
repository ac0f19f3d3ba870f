"""What does a local sweep spend on start-up, with warm ranks and without?

Runs the issue's sweep twice on this machine -- ``+experiment=gpt_pp2_dp2`` (4 CPU ranks),
``training.micro_batch_size=1,2,4``, 20 iterations -- once on warm ranks (``sweep.warm_pool=true``,
the default) and once with a fresh job per point (``sweep.warm_pool=false``), and prints per point:
the launcher's wall time (point.json ``started`` -> ``ended``), the training loop's wall time
(the summary's ``train_wall_s``) and their difference, the point's start-up; per sweep: the wall
time of the whole command and the share of it spent training (sum of ``train_wall_s`` / wall).
Then it checks that warm and fresh points trained the same: the loss at every iteration of every
point, and the peak memory per rank (warm ranks reset their peak before each trial).

    python bench/warm_sweep.py                       # ~2-4 minutes on 2 quiet cores
    python bench/warm_sweep.py --iters 20 --mbs 1,2,4 --root /tmp/bench_warm
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]


def run_sweep(root: Path, name: str, mbs: str, iters: int, warm: bool) -> float:
    args = [
        sys.executable,
        "-m",
        "orchestrator",
        "-m",
        "+experiment=gpt_pp2_dp2",
        f"training.micro_batch_size={mbs}",
        f"training.train_iters={iters}",
        f"run.root={root}",
        f"run.name={name}",
        f"sweep.warm_pool={str(warm).lower()}",
    ]
    start = time.time()
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.time() - start
    if proc.returncode != 0:
        sys.exit(f"sweep failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return wall


def points(root: Path, name: str) -> List[Dict]:
    (sweep_dir,) = sorted((root / "sweeps" / name).iterdir())
    out = []
    for point_file in sorted(sweep_dir.glob("*/point.json"), key=lambda p: int(p.parent.name)):
        point = json.loads(point_file.read_text())
        records = [json.loads(line) for line in (point_file.parent / "metrics.jsonl").read_text().splitlines()]
        summary = [r for r in records if r.get("event") == "summary"][-1]
        losses = {r["iteration"]: r["lm_loss"] for r in records if "event" not in r}
        out.append(
            {
                "overrides": [o for o in point["overrides"] if "micro_batch" in o][0],
                "wall": point["ended"] - point["started"],
                "train": summary["train_wall_s"],
                "peak": max(summary["peak_rss_mb_per_rank"]),
                "losses": losses,
                "job": point["job_id"],
            }
        )
    return out


def report(label: str, wall: float, pts: List[Dict]) -> None:
    train = sum(p["train"] for p in pts)
    print(
        f"\n{label}: whole sweep {wall:.1f} s, training {train:.1f} s = {100 * train / wall:.0f}% of it "
        f"(jobs: {', '.join(sorted({str(p['job']) for p in pts}))})"
    )
    print(f"  {'point':<30} {'wall s':>7} {'train s':>8} {'start-up s':>10} {'peak MiB':>9}")
    for p in pts:
        print(
            f"  {p['overrides']:<30} {p['wall']:7.2f} {p['train']:8.2f} {p['wall'] - p['train']:10.2f} {p['peak']:9.0f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--mbs", default="1,2,4")
    parser.add_argument("--root", type=Path, default=None)
    args = parser.parse_args()
    root = args.root or Path(tempfile.mkdtemp(prefix="bench_warm_"))
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; files in {root}")
    subprocess.run(
        [sys.executable, "-m", "orchestrator", "+experiment=gpt_pp2_dp2", "plan=true"], cwd=REPO, capture_output=True
    )  # nothing to time: warms the OS file cache for both sweeps alike
    walls = {warm: run_sweep(root, f"warm_{warm}", args.mbs, args.iters, warm) for warm in (True, False)}
    warm, fresh = points(root, "warm_True"), points(root, "warm_False")
    report("warm ranks (sweep.warm_pool=true)", walls[True], warm)
    report("fresh job per point (sweep.warm_pool=false)", walls[False], fresh)
    later = warm[1:]
    if later:
        print(
            "\nstart-up per warm point after the first: "
            + ", ".join(f"{p['wall'] - p['train']:.2f} s" for p in later)
            + " (target <= 3 s)"
        )
    same = all(w["losses"] == f["losses"] for w, f in zip(warm, fresh))
    print(f"losses warm == fresh at every iteration of every point: {same}")
    print(
        "peak memory per rank warm / fresh: " + ", ".join(f"{w['peak'] / f['peak']:.3f}" for w, f in zip(warm, fresh))
    )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
