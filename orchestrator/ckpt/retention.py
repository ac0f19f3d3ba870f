"""Which checkpoints a run keeps (``checkpoint.keep_last``, ``checkpoint.keep_every``), and their safe removal.

The rule, applied by the job's rank 0 right after a checkpoint's manifest is written (never before,
never for a save still being written)::

    kept = the keep_last newest *complete* checkpoints            ("newest K")
         + every complete checkpoint at a multiple of keep_every  ("every N")
         + every torn or corrupt directory (never removed; a person decides)
    removed = the other complete checkpoints, oldest first

So the checkpoint a run resumed from is removed only once ``keep_last`` newer complete ones exist,
and a pending (manifest-less) save is never counted. Only ``iter_XXXXXXX`` directories of the run's
own ``<run.dir>/checkpoints`` whose manifest records that iteration are candidates; nothing else
there is touched. ``keep_last=null`` keeps every checkpoint.

Removal is kill-safe: the directory is first renamed to ``.trash-iter_XXXXXXX`` (atomic, and no
longer an ``iter_`` name, so no reader lists or loads it), then deleted. A kill in between leaves
every remaining ``iter_*`` checkpoint whole; the next prune deletes leftover ``.trash-*`` directories.
Pure Python, no torch import.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from orchestrator.ckpt.manifest import CheckpointInfo, list_checkpoints

TRASH_PREFIX = ".trash-"
PAUSE_ENV = "ORCHESTRATOR_PRUNE_PAUSE_S"
"""Test hook: seconds to pause after the first file of a directory being removed is deleted (a kill
test's window in which a checkpoint is half removed). Unset in real runs."""


@dataclass(frozen=True)
class Verdict:
    """One checkpoint directory and what retention does with it."""

    iteration: int
    path: Path
    status: str
    """complete | torn | corrupt (:class:`~orchestrator.ckpt.manifest.CheckpointInfo`)."""
    keep: bool
    why: str


def verdicts(infos: Sequence[CheckpointInfo], keep_last: Optional[int], keep_every: Optional[int]) -> List[Verdict]:
    """The retention rule (module docstring) applied to ``infos`` (one run's checkpoints), oldest first."""
    complete = sorted(i.iteration for i in infos if i.status == "complete")
    newest = set(complete if keep_last is None else complete[-keep_last:] if keep_last > 0 else [])
    out = []
    for info in sorted(infos, key=lambda i: i.iteration):
        if info.status != "complete":
            out.append(Verdict(info.iteration, info.path, info.status, True, f"{info.status}: never removed"))
            continue
        reasons = [f"keep_every={keep_every}"] if keep_every and info.iteration % keep_every == 0 else []
        if info.iteration in newest:
            reasons.append("keep_last=null (all)" if keep_last is None else f"newest {len(newest)} (keep_last={keep_last})")
        why = ", ".join(reasons) or f"older than the newest {keep_last} (keep_last={keep_last})"
        out.append(Verdict(info.iteration, info.path, info.status, bool(reasons), why))
    return out


def prune(save_dir: "str | os.PathLike", keep_last: Optional[int], keep_every: Optional[int], *,
          just_saved: int) -> List[Path]:
    """Remove what :func:`verdicts` does not keep, once ``just_saved`` is complete; returns what was removed.

    Nothing is removed unless the checkpoint at ``just_saved`` is the newest complete one (its
    manifest written and verified). Leftover ``.trash-*`` directories of an earlier kill go first.
    """
    root = Path(save_dir)
    clear_trash(root)
    if keep_last is None:
        return []
    infos = list_checkpoints(root, verify=True)
    complete = [i.iteration for i in infos if i.status == "complete"]
    if not complete or complete[-1] != just_saved:
        return []
    removed = []
    for verdict in verdicts(infos, keep_last, keep_every):
        if not verdict.keep:
            remove_safely(verdict.path)
            removed.append(verdict.path)
    return removed


def remove_safely(path: "str | os.PathLike") -> None:
    """Rename ``path`` to ``.trash-<name>`` in its directory (atomic), then delete it file by file."""
    path = Path(path)
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}")
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    _delete(trash)


def clear_trash(save_dir: Path) -> None:
    """Delete the ``.trash-*`` directories an interrupted prune left behind."""
    if save_dir.is_dir():
        for leftover in sorted(save_dir.glob(f"{TRASH_PREFIX}*")):
            if leftover.is_dir():
                _delete(leftover)


def _delete(trash: Path) -> None:
    pause = float(os.environ.get(PAUSE_ENV) or 0)
    for dirpath, _, filenames in os.walk(trash, topdown=False):
        for name in sorted(filenames):
            os.unlink(os.path.join(dirpath, name))
            if pause:
                time.sleep(pause)
                pause = 0.0
        os.rmdir(dirpath)


def describe(save_dir: "str | os.PathLike", infos: Sequence[CheckpointInfo]) -> List[str]:
    """``manifest list``'s "kept because" column, by the newest complete manifest's own retention settings."""
    newest = next((i for i in reversed(sorted(infos, key=lambda i: i.iteration)) if i.status == "complete"), None)
    ck = ((newest.manifest or {}).get("config") or {}).get("checkpoint", {}) if newest else {}
    return [v.why if v.keep else f"removed at the next save: {v.why}"
            for v in verdicts(infos, ck.get("keep_last"), ck.get("keep_every"))]
