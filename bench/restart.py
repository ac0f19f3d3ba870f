"""In-place restart (``cluster.max_restarts=1``): the time from a rank's kill -9 to the first new iteration.

Runs ``python -m orchestrator +experiment=gpt_pp2_dp2`` (PP=2 x DP=2, gpt_tiny) in a fresh run directory, locally
(the 4 ranks under one torch elastic agent) and on the SLURM dev cluster (2 nodes x 2 ranks, one agent a node:
``launch/slurm-dev-up.sh``), kills (SIGKILL) rank ``--rank``'s process once iteration ``--at`` is logged, and
prints for each: the job's own start-up (launch to its first iteration), the checkpoint load of the restarted
ranks, the time from the kill to the first new iteration (and as the job recorded it, from the failure it saw),
the goal (start-up + load + 15 s), the SLURM job's requeue count, and the load average.

    python bench/restart.py                 # local, then slurm
    python bench/restart.py --only local --at 10 --rank 1
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
sys.path.insert(0, str(REPO / "tests"))
from conftest import agent_worker  # noqa: E402  (the rank's process under its agent, as the tests find it)

CLUSTERS = {"local": [], "slurm": ["cluster=slurm_dev", "cluster.nodes=2", "cluster.tasks_per_node=2"]}


def _records(run_dir: Path) -> List[Dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def one(kind: str, at: int, rank: int) -> Dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix=f"restart-{kind}-"))
    run_dir = root / "job"
    cmd = [
        sys.executable,
        "-m",
        "orchestrator",
        "+experiment=gpt_pp2_dp2",
        "data.stdlib_max_mb=2",
        "training.eval_iters=0",
        "training.log_interval=1",
        f"run.root={root}",
        "run.name=job",
        f"training.train_iters={at + 6}",
        "checkpoint.save_interval=4",
        "cluster.max_restarts=1",
        *CLUSTERS[kind],
    ]
    launched = time.time()
    with open(root / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        while not any(r.get("iteration", 0) >= at for r in _records(run_dir) if "event" not in r):
            if proc.poll() is not None:
                raise SystemExit(f"{kind}: the job ended before iteration {at}; see {root / 'launcher.log'}")
            time.sleep(0.05)
        first = next(r["time"] for r in _records(run_dir) if "event" not in r)
        before = len([r for r in _records(run_dir) if "event" not in r])
        victim = agent_worker(run_dir, rank)
        if victim is None:
            raise SystemExit(f"{kind}: no process of rank {rank} under {run_dir}")
        victim.kill()
        killed = time.time()
        while len([r for r in _records(run_dir) if "event" not in r]) <= before:
            if proc.poll() is not None:
                raise SystemExit(f"{kind}: the job ended without a new iteration; see {root / 'launcher.log'}")
            time.sleep(0.05)
        new_iteration = time.time()
        code = proc.wait(timeout=600)
    starts = [r for r in _records(run_dir) if r.get("event") == "start"]
    jobs = [json.loads(ln) for ln in (run_dir / "jobs.jsonl").read_text().splitlines()]
    resumed = next((r for r in jobs if r.get("event") == "restart_resumed"), {})
    job_id = next(str(r["job_id"]) for r in jobs if r.get("event") == "submitted")
    requeues = "-"
    if kind == "slurm":
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
        requeues = next((f.split("=", 1)[1] for f in out.split() if f.startswith("Restarts=")), "?")
    load_s = float(starts[-1].get("load_s") or 0.0)
    start_up = first - launched
    return {
        "cluster": kind,
        "exit": code,
        "start_up_s": round(start_up, 1),
        "load_s": round(load_s, 2),
        "kill_to_new_iteration_s": round(new_iteration - killed, 1),
        "recorded_recovery_s": resumed.get("recovery_s"),
        "goal_s": round(start_up + load_s + 15, 1),
        "within_goal": new_iteration - killed <= start_up + load_s + 15,
        "slurm_requeues": requeues,
        "job": job_id,
        "run_dir": str(run_dir),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", type=int, default=10, help="kill once this iteration is logged")
    parser.add_argument("--rank", type=int, default=2, help="the rank killed")
    parser.add_argument("--only", choices=sorted(CLUSTERS), default=None)
    args = parser.parse_args()
    for kind in [args.only] if args.only else ["local", "slurm"]:
        load = os.getloadavg()[0]
        result = one(kind, args.at, args.rank)
        result["load_before"], result["load_after"] = round(load, 1), round(os.getloadavg()[0], 1)
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
