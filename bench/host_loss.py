"""A host lost mid-run under ``cluster=hosts``: how soon the launcher names it and how soon everything has ended.

Runs ``python -m orchestrator +experiment=gpt_pp2_dp2 cluster=hosts_dev`` (PP=2 x DP=2, 2 ranks on each of
hnode1 and hnode2: ``launch/hosts-dev-up.sh``) in a fresh run directory, waits for iteration ``--at``, kills
(SIGKILL) the launcher's SSH client to ``--host``, and prints: the time to the first iteration, the time from
the kill to the launcher's line naming the host, the time to the launcher's exit (its exit code), the
processes of the job left on any host (one pid namespace here), and the load average.

    python bench/host_loss.py                      # hnode2 at iteration 4
    python bench/host_loss.py --host hnode1 --at 2
    python bench/host_loss.py --signal TERM        # SIGTERM to the launcher instead (INT: Ctrl-C)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]


def _iteration(metrics: Path) -> int:
    if not metrics.exists():
        return 0
    its = [json.loads(ln).get("iteration", 0) for ln in metrics.read_text().splitlines() if '"iteration"' in ln]
    return max(its or [0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="hnode2")
    parser.add_argument("--at", type=int, default=4, help="kill once this iteration is logged")
    parser.add_argument("--signal", default=None, help="send this signal (TERM, INT, HUP) to the launcher instead")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="host_loss-"))
    log = root / "launcher.log"
    cmd = [
        sys.executable,
        "-m",
        "orchestrator",
        "+experiment=gpt_pp2_dp2",
        "cluster=hosts_dev",
        "data.stdlib_max_mb=2",
        "training.eval_iters=0",
        f"run.root={root}",
        "run.name=job",
        "training.train_iters=12",
        "checkpoint.save_interval=3",
    ]
    load = os.getloadavg()[0]
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1")
        )
    metrics = root / "job" / "metrics.jsonl"
    while _iteration(metrics) < 1:
        if proc.poll() is not None:
            print(log.read_text()[-3000:])
            return 1
        time.sleep(0.2)
    print(f"first iteration {time.monotonic() - start:.1f} s after the launch")
    while _iteration(metrics) < args.at:
        time.sleep(0.1)
    if args.signal:
        proc.send_signal(getattr(signal, f"SIG{args.signal.upper()}"))
        killed = time.monotonic()
    else:
        ssh = next(
            c for c in psutil.Process(proc.pid).children() if c.cmdline()[:1] == ["ssh"] and args.host in c.cmdline()
        )
        ssh.kill()
        killed = time.monotonic()
        while f"{args.host}: session ended" not in log.read_text() and proc.poll() is None:
            time.sleep(0.05)
        print(f"{args.host} named {time.monotonic() - killed:.1f} s after kill -9 of its SSH client")
    code = proc.wait()
    print(
        f"launcher exited {code}, {time.monotonic() - killed:.1f} s after the {args.signal or 'kill'}; "
        f"checkpoints: {sorted(p.name for p in (root / 'job' / 'checkpoints').glob('iter_*'))}"
    )
    job = next((root / "job" / "agents").iterdir()).name
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if job in " ".join(p.info["cmdline"] or [])]
    print(
        f"processes of job {job} left: {left or 'none'}; load average {load:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
