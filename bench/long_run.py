"""Costs over a run that lasts days, at the state it reaches (issue 26): status, saves, launcher polls.

Builds what a real run would take days to leave behind, then measures:

1. ``status``: a run whose ``metrics.jsonl`` holds 100,000 iteration records (~28 MB, one per
   iteration, the ``start`` record at the top) of a live local job: the wall time of ``run_status`` +
   the table (median of 5, in process) and of the ``python -m orchestrator status`` command, and whether
   the total, the ETA and tokens/s are shown.                                 (target: <= 0.5 s)
2. Saves: real gpt_tiny jobs (one rank, megatron's mock data, a save after every iteration, every
   checkpoint kept: ``checkpoint.keep_every=1``, milestones). A run saves iteration 1; 198 faithful
   copies of it (shards hard-linked, ``common.pt``'s progress and the manifest rewritten) fill
   iterations 2..199; that run then resumes and saves checkpoints 200-209, between two fresh runs that
   save checkpoints 1-10 (the baseline, before and after: the machine's load drifts). From the
   ``saved`` records, the slowest rank's ``blocking_s``: the job's first save (checkpoint 200 vs 1)
   and the median of the later ones, and  ratio = checkpoints 200.. / checkpoints 1..  (target <= 1.1)
   For comparison: what re-verifying the 200 kept checkpoints costs (what every save used to add).
3. The launcher's poll at 1,024 ranks: every rank's heartbeat record written as the ranks' threads
   write them, then the backstop's read (:class:`~orchestrator.runtime.faults.watchdog.JobWatch`):
   median wall time of 20 polls and the files opened per poll (Python's audit hook), against reading
   one file per rank (what it used to do).                     (target: <= 50 ms, opens constant)

    python bench/long_run.py                    # a temporary directory, removed after
    python bench/long_run.py --dir /scratch/b   # kept
    python bench/long_run.py --skip-saves       # parts 1 and 3 only (seconds)
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
from typing import List

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.ckpt import history  # noqa: E402
from orchestrator.io import append_jsonl  # noqa: E402

RECORD = (
    '{{"consumed_samples": {s}, "grad_norm": 1.25, "iteration": {i}, "lm_loss": {loss:.4f}, "lr": 0.0003, '
    '"max_gpu_mem_mb": null, "max_rss_mb": 1630.2, "skipped": false, "step_time_s": 0.5, '
    '"throughput_tflops": 0.012, "time": {t:.3f}, "tokens_per_s": 8192.0}}\n'
)


# ---- 1. status ---------------------------------------------------------------------------------------
def bench_status(root: Path, iterations: int = 100_000) -> None:
    from orchestrator.submit import status

    run = root / "runs" / "long"
    run.mkdir(parents=True)
    append_jsonl(
        run / "metrics.jsonl",
        {
            "event": "start",
            "iteration": 0,
            "train_iters": 2 * iterations,
            "resumed_from": None,
            "load_s": None,
            "time": time.time(),
        },
    )
    with open(run / "metrics.jsonl", "a") as f:
        f.writelines(RECORD.format(s=8 * i, i=i, loss=10 - i * 1e-5, t=1.7e9 + i) for i in range(1, iterations + 1))
    job_id = str(os.getpid())  # a live local job: this process
    history.record_submission(run, job_id, "local", num_tasks=1, folder=str(run / "submitit"))
    history.record_attempt_started(run, job_id, 0, iteration=0, host="h", world_size=1, train_iters=2 * iterations)
    walls = []
    for _ in range(5):
        t0 = time.perf_counter()
        table = status.format_table([status.run_status(d) for d in status.find_runs(root / "runs")], root / "runs")
        walls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    cli = subprocess.run(
        [sys.executable, "-m", "orchestrator", "status", str(root / "runs")],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    cli_s = time.perf_counter() - t0
    row = table.splitlines()[1].split()
    size = (run / "metrics.jsonl").stat().st_size / 2**20
    print(f"1. status of a run with {iterations:,} iteration records ({size:.1f} MiB metrics.jsonl):")
    print(f"   {table.splitlines()[0]}\n   {table.splitlines()[1]}")
    print(f"   total shown: {'/' in row[5]}, tokens/s shown: {row[7] != '-'}, ETA shown: {row[8] != '-'}")
    print(
        f"   in process: {statistics.median(walls) * 1000:.1f} ms median of 5 (target <= 500 ms); "
        f"`python -m orchestrator status` command: {cli_s:.2f} s wall (exit {cli.returncode})"
    )


# ---- 2. saves --------------------------------------------------------------------------------------
def _job(root: Path, name: str, iters: int) -> List[dict]:
    """The real CLI: gpt_tiny, one rank, mock data, a save after every iteration, every checkpoint kept."""
    args = [
        "model=gpt_tiny",
        "parallelism=none",
        "data=mock",
        "training.micro_batch_size=1",
        "training.global_batch_size=1",
        f"training.train_iters={iters}",
        "checkpoint.save_interval=1",
        "checkpoint.keep_last=3",
        "checkpoint.keep_every=1",
        "training.eval_iters=0",
        "training.log_interval=50",
        "logging.tensorboard=false",
        f"run.root={root}",
        f"run.name={name}",
    ]
    env = dict(
        os.environ,
        ORCHESTRATOR_CACHE=str(root / "cache"),
        PYTHONUNBUFFERED="1",
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"the job failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    print(f"   {name} to iteration {iters}: {time.perf_counter() - t0:.0f} s wall", flush=True)
    return [
        r
        for r in map(json.loads, (root / name / "metrics.jsonl").read_text().splitlines())
        if r.get("event") == "saved" and r["iteration"] > iters - saves_of(iters)
    ]


def saves_of(iters: int) -> int:
    return iters if iters < 199 else iters - 199


def faithful_copy(source: Path, iteration: int) -> Path:
    """``source`` at another iteration: its shards hard-linked, ``common.pt``'s progress and the manifest
    (iteration, file digest, checksum) rewritten, so that the copy is what a save at ``iteration`` writes."""
    import torch

    from orchestrator.ckpt.digest import file_digest
    from orchestrator.ckpt.manifest import MANIFEST_NAME, iteration_dir, write_manifest

    target = iteration_dir(source.parent, iteration)
    shutil.copytree(source, target, copy_function=os.link, ignore=shutil.ignore_patterns(MANIFEST_NAME, "common.pt"))
    common = torch.load(source / "common.pt", weights_only=False)
    common["progress"] = {"iteration": iteration, "consumed_samples": iteration}
    torch.save(common, target / "common.pt")
    manifest = json.loads((source / MANIFEST_NAME).read_text())
    manifest.pop("manifest_sha256")
    manifest["iteration"], manifest["consumed_samples"] = iteration, iteration
    manifest["files"] = file_digest(target, manifest["files"]["mode"])
    write_manifest(target, manifest)
    return target


def bench_saves(root: Path, saves: int = 20) -> None:
    from orchestrator.ckpt.catalogue import list_checkpoints

    print(
        f"2. saves (gpt_tiny, 1 rank, a save per iteration, every checkpoint kept; {saves} saves per job):", flush=True
    )
    _job(root, "long", 1)
    save_dir = root / "long" / "checkpoints"
    for it in range(2, 200):
        faithful_copy(save_dir / "iter_0000001", it)
    fresh = _job(root, "fresh", saves)  # checkpoints 1.. of a run
    long = _job(root, "long", 199 + saves)  # checkpoints 200.. of a run holding 199
    again = _job(root, "fresh_again", saves)  # the baseline once more, after (the machine's load drifts)
    n = len([p for p in save_dir.iterdir() if p.name.startswith("iter_")])

    def med(recs: List[dict]) -> float:
        return statistics.median(r["blocking_s"] for r in recs)

    base_first = statistics.mean([fresh[0]["blocking_s"], again[0]["blocking_s"]])
    base_rest = statistics.mean([med(fresh[1:]), med(again[1:])])
    print(
        f"   first save of the job: checkpoint 1 {fresh[0]['blocking_s']:.3f} / {again[0]['blocking_s']:.3f} s, "
        f"checkpoint 200 {long[0]['blocking_s']:.3f} s -> ratio {long[0]['blocking_s'] / base_first:.2f}"
    )
    print(
        f"   later saves (median): checkpoints 2-{saves} {med(fresh[1:]):.3f} / {med(again[1:]):.3f} s, "
        f"checkpoints 201-{199 + saves} {med(long[1:]):.3f} s -> ratio {med(long[1:]) / base_rest:.2f} (target <= 1.1)"
    )
    scanning = [r["iteration"] for r in long if r["prune_s"] == 0.0]  # after_save returns at once while it runs
    print(
        f"   saves made while the job's start-up check of the {n - saves} checkpoints on disk still ran (a thread; "
        f"they pay its share of the interpreter): {scanning}, blocking "
        f"{[round(r['blocking_s'], 3) for r in long if r['iteration'] in scanning]} s"
    )
    print(
        f"   retention's part (prune_s, median): {statistics.median(r['prune_s'] for r in fresh) * 1000:.1f} ms with "
        f"1-{saves} on disk, {statistics.median(r['prune_s'] for r in long) * 1000:.1f} ms with {n}"
    )
    t0 = time.perf_counter()
    infos = list_checkpoints(save_dir, verify=True)
    print(
        f"   re-verifying all {len(infos)} kept checkpoints (what each save used to add): "
        f"{time.perf_counter() - t0:.3f} s"
    )


# ---- 3. launcher poll ------------------------------------------------------------------------------
def bench_poll(root: Path, world: int = 1024) -> None:
    from orchestrator.runtime.faults.watchdog import (
        JobWatch,
        heartbeat_path,
        read_heartbeat,
        slots_path,
        write_heartbeat,
        write_slot,
    )

    run = root / "hb"
    (run / "heartbeat").mkdir(parents=True)
    for r in range(world):
        rec = {
            "rank": r,
            "host": f"node{r // 8:03d}",
            "pid": 10_000 + r,
            "job_id": "4711",
            "attempt": 0,
            "iteration": 99_999,
            "beats": 99_999,
            "phase": "train",
            "allowance_s": 300.0,
            "alive": 20_000,
            "time": time.time(),
        }
        write_heartbeat(heartbeat_path(run, r), rec)
        write_slot(slots_path(run), r, rec)
    opened: List[str] = []
    counting = [False]
    sys.addaudithook(lambda event, args: opened.append(str(args[0])) if counting[0] and event == "open" else None)

    def measure(poll) -> tuple:
        walls = []
        for n in range(20):
            rec["alive"] += 1  # a rank's thread wrote since the last poll (as in a healthy job)
            write_slot(slots_path(run), n * 37 % world, rec)
            write_heartbeat(heartbeat_path(run, n * 37 % world), rec)
            opened.clear()
            counting[0] = True
            t0 = time.perf_counter()
            poll()
            walls.append(time.perf_counter() - t0)
            counting[0] = False
        return statistics.median(walls) * 1000, len(opened)

    watch = JobWatch(run, "4711", world, timeout_s=300.0, every_s=0.0)
    now_ms, now_opens = measure(watch.silent_for)
    assert len(watch.last) == world and watch.hung() is None, len(watch.last)
    old_ms, old_opens = measure(lambda: [read_heartbeat(heartbeat_path(run, r)) for r in range(world)])
    print(
        f"3. the launcher's poll at {world:,} ranks: {now_ms:.1f} ms, {now_opens} file open(s) per poll "
        f"(target <= 50 ms, constant); one file per rank (before): {old_ms:.1f} ms, {old_opens} opens"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed after)")
    parser.add_argument("--skip-saves", action="store_true", help="parts 1 and 3 only")
    args = parser.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="long_run."))
    root.mkdir(parents=True, exist_ok=True)
    try:
        bench_status(root)
        bench_poll(root)
        if not args.skip_saves:
            bench_saves(root)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
