"""``status --goodput RUN`` and ``status --timeline RUN out.png`` (orchestrator.ckpt.goodput's account)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from orchestrator.ckpt.goodput import account
from orchestrator.ckpt.goodput_report import draw_timeline, table
from orchestrator.ckpt.rundir import JOBS_FILE, METRICS_FILE


def goodput_main(run_dir: Path, show: bool, timeline: Optional[str], as_json: bool = False) -> int:
    """Print the account of the run in ``run_dir`` and/or draw its timeline; 2 with one ``error:`` line when
    ``run_dir`` is not a run directory or the picture cannot be written. ``as_json``: the account as one JSON
    object (:meth:`orchestrator.ckpt.goodput.Account.as_dict` with ``run_dir`` and ``live``; ``ettr`` null
    before any record), the timeline's line on stderr."""
    if not (run_dir / JOBS_FILE).exists() and not (run_dir / METRICS_FILE).exists():
        print(
            f"error: {run_dir}: not a run directory (no {JOBS_FILE} or {METRICS_FILE}); fix: name one run's "
            f"directory, e.g. runs/gpt_pp2_dp2 (status lists them)",
            file=sys.stderr,
        )
        return 2
    acc = account(run_dir)
    if acc is None:
        print(
            json.dumps({"run_dir": str(run_dir), "event": "goodput", "ettr": None})
            if as_json
            else f"{run_dir}: no records yet"
        )
        return 0
    if as_json:
        print(json.dumps({"run_dir": str(run_dir), **acc.as_dict(), "live": acc.live}))
    elif show or not timeline:
        print(table(acc, run_dir))
    if timeline:
        out = Path(timeline)
        if out.suffix.lower() != ".png":
            print(
                f"error: --timeline {timeline}: not a .png path; fix: --timeline {out.with_suffix('.png')}",
                file=sys.stderr,
            )
            return 2
        try:
            draw_timeline(acc, out, title=f"{run_dir.name}: ETTR {100 * (acc.ettr or 0):.1f}%")
        except OSError as exc:
            print(
                f"error: --timeline {timeline}: cannot write it ({exc.strerror}); fix: a writable path", file=sys.stderr
            )
            return 2
        print(f"timeline: {out}", file=sys.stderr if as_json else sys.stdout)
    return 0
