"""The longest silence of a run: how long the launcher says nothing, and between which lines.

Runs ``python -m orchestrator +experiment=gpt_pp2_dp2`` (the README's main job; other overrides
after ``--``) in a fresh run directory, reads its stdout and stderr line by line as they come (a
pipe, not a terminal: the plain-line form of every progress display), stamps each line, and prints
the time to the first line, the longest gap between two lines (and the lines around it), the
gaps over the goal, the total, and the load average before and after (wall-clock silences on a
shared machine are only as quiet as the machine). Exit 0 when the longest silence is within
``--goal`` seconds (default 3), 1 otherwise.

    python bench/silence.py                               # the main job, warm data cache
    python bench/silence.py --cold                        # a fresh data cache: tokenizing too
    python bench/silence.py -- training.train_iters=20    # a shorter run
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import List, Tuple

REPO = Path(__file__).resolve().parents[1]


def stamped_run(argv: List[str], env: dict, cwd: str) -> Tuple[int, List[Tuple[float, str]], float]:
    """(exit code, [(seconds since start, line)], total seconds) of ``argv``, stdout and stderr merged."""
    start = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    lines: List[Tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.monotonic() - start, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait()
    reader.join(timeout=10)
    return code, lines, time.monotonic() - start


def gaps(lines: List[Tuple[float, str]], total: float) -> List[Tuple[float, int]]:
    """(silence in seconds, index of the line that ended it) from the start to the exit, longest first."""
    times = [0.0] + [t for t, _ in lines] + [total]
    return sorted(((times[i + 1] - times[i], i) for i in range(len(times) - 1)), reverse=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cold", action="store_true", help="a fresh data cache (the run tokenizes its corpus)")
    parser.add_argument("--goal", type=float, default=3.0, help="seconds of silence allowed (default 3)")
    parser.add_argument("--experiment", default="gpt_pp2_dp2")
    parser.add_argument("--show", action="store_true", help="print every line with its time")
    parser.add_argument("overrides", nargs="*", help="more overrides, after --")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="orchestrator-silence-")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    if args.cold:
        env["ORCHESTRATOR_CACHE"] = str(Path(work) / "cache")
    argv = [
        sys.executable,
        "-m",
        "orchestrator",
        f"+experiment={args.experiment}",
        f"run.root={work}/runs",
        *args.overrides,
    ]
    load_before = os.getloadavg()
    code, lines, total = stamped_run(argv, env, work)
    load_after = os.getloadavg()
    ranked = gaps(lines, total)
    longest, at = ranked[0]
    text = [line for _, line in lines]
    if args.show:
        print("\n".join(f"{t:7.2f}  {line}" for t, line in lines))
    print(f"command: {' '.join(argv[2:])}{' (cold data cache)' if args.cold else ''}")
    print(
        f"exit {code} after {total:.1f} s, {len(lines)} lines; first line after {lines[0][0] if lines else total:.2f} s"
    )
    before = text[at - 1] if at > 0 else "(start)"
    after = text[at] if at < len(text) else "(exit)"
    print(f"longest silence: {longest:.2f} s, between\n  {before!r}\n  {after!r}")
    over = [(g, i) for g, i in ranked if g > args.goal]
    for g, i in over[1:6]:
        print(f"  also {g:.2f} s before {text[i] if i < len(text) else '(exit)'!r}")
    print(
        f"silences over {args.goal:g} s: {len(over)}; load average before {load_before[0]:.1f}, "
        f"after {load_after[0]:.1f} ({os.cpu_count()} cores)"
    )
    if code != 0:
        print("\n".join(text[-20:]))
    return 0 if longest <= args.goal and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
