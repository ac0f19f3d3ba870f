"""What straggler detection (``training.straggler``) costs a step: goal <= 1% of the step time.

Two measures, printed with the load average (a shared machine's wall times are only as quiet as it is):

1. A/B jobs: ``+experiment=gpt_pp2_dp2`` (4 CPU ranks, PP=2 x DP=2; other overrides after ``--``) with the
   detector on (the default: windows of at least 8 iterations, closed at logging iterations) and off (``training.straggler.interval=null``),
   alternated ``--pairs`` times; per job the summary's median step wall time and the logging rank's median
   CPU time per step; the overhead is the difference of the medians over the pairs.
2. The detector's own work, timed directly on this machine: one timed call (the wrapper around a forward
   or backward step: two clock reads of each kind) and one window's verdict on 4 gloo ranks (an
   ``all_gather`` of 5 numbers and the judgement; since 2026-12-05 the rows ride on the loop's logging
   all-reduce instead, so the gather is an upper bound on what they add), combined for the job's calls per iteration
   (2 x micro-batches per rank) and divided by its step time: an upper bound that does not depend on the
   A/B noise.

    python bench/straggler.py                    # 3 pairs of 60-iteration jobs
    python bench/straggler.py --pairs 5 -- training.train_iters=100

3. ``--rule``: the default rule's two sides (issue 39): ``--runs`` unthrottled jobs of ``--iters`` iterations at
   the default ``training.straggler`` settings, each printing the load average and whom it named (goal: nobody);
   then one job whose rank 3 is held to ``--quota`` percent of a core (a cgroup v1 CPU quota, root) from
   iteration ``--at`` on, printing the iteration it was named at (goal: within 30 iterations)::

    python bench/straggler.py --rule --runs 3 --iters 120 --quota 20 --at 64
"""

from __future__ import annotations

import argparse
import contextlib
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


RULE = [a for a in BASE if not a.startswith(("training.train_iters=", "training.log_interval="))] + [
    "training.micro_batch_size=1",
    "training.global_batch_size=4",
    "training.log_interval=1",
]
"""The test's job (tests/test_straggler.py): 4 ranks, PP=2 x DP=2, one record per iteration."""


def _named(run_dir: Path) -> List[dict]:
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == "straggler"]


def rule(runs: int, iters: int, quota: int, at: int) -> None:
    """Option 3 of the module docstring."""
    cgroup = Path("/sys/fs/cgroup/cpu") / f"bench-straggler-{os.getpid()}"
    with tempfile.TemporaryDirectory(prefix="bench-straggler-") as root:
        for i in range(runs + 1):
            throttled = i == runs
            load0, t0, name = os.getloadavg()[0], time.monotonic(), f"rule{i}"
            args = [*RULE, f"training.train_iters={iters}", f"run.root={root}", f"run.name={name}"]
            env = dict(os.environ, PYTHONPATH=str(REPO))
            proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", *args],
                cwd=REPO,
                env=env,
                text=True,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
            moved = None
            try:
                while throttled and moved is None and proc.poll() is None:
                    beat, metrics = Path(root, name, "heartbeat", "rank_3"), Path(root, name, "metrics.jsonl")
                    done = metrics.exists() and sum(1 for x in metrics.read_text().splitlines() if '"lm_loss"' in x)
                    if done and done >= at and beat.exists():
                        cgroup.mkdir(exist_ok=True)
                        (cgroup / "cpu.cfs_period_us").write_text("100000")
                        (cgroup / "cpu.cfs_quota_us").write_text(str(quota * 1000))
                        (cgroup / "cgroup.procs").write_text(str(json.loads(beat.read_text())["pid"]))
                        moved = done
                    time.sleep(0.1)
                if proc.wait() != 0:
                    raise SystemExit(f"job {name} failed:\n{proc.stderr.read()[-2000:]}")
            finally:
                if cgroup.exists():
                    for pid in (cgroup / "cgroup.procs").read_text().split():
                        with contextlib.suppress(OSError):
                            Path("/sys/fs/cgroup/cpu/cgroup.procs").write_text(pid)
                    cgroup.rmdir()
            named = [(r.get("rank"), r["iteration"], r.get("slower_by")) for r in _named(Path(root, name))]
            what = f"rank 3 held to {quota}% of a core from iteration {moved}" if throttled else "unthrottled"
            print(
                f"{name}: {what}, {iters} iterations in {time.monotonic() - t0:.0f} s, load {load0:.1f} -> "
                f"{os.getloadavg()[0]:.1f}: named (rank, iteration, slower by) {named or 'nobody'}",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--rule", action="store_true", help="the default rule's two sides (option 3)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--iters", type=int, default=120)
    parser.add_argument("--quota", type=int, default=20)
    parser.add_argument("--at", type=int, default=64)
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.rule:
        rule(args.runs, args.iters, args.quota, args.at)
        return 0
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
