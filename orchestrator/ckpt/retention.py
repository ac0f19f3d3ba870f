"""Which checkpoints a run keeps (``checkpoint.keep_last``, ``checkpoint.keep_every``), and their safe removal.

The rule, applied for the job's rank 0 right after a checkpoint's manifest is written (never before,
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

Flat cost over a long run (:class:`Pruner`, one per job on rank 0): each checkpoint is verified once
per job — those on disk when the job starts by a thread started with the job, each new one right after
its manifest is written — and trusted from then on (a resume verifies again what it loads), so a save
costs the same at the 200th checkpoint as at the first (a save made while that start-up check still
runs removes nothing; the next one does). On the training ranks' path only the decision and the renames
happen; deleting the files is the pruner's own thread's work, one directory at a time.

Set-aside directories (``iter_XXXXXXX.torn.<time>``, ``iter_XXXXXXX.replaced.<time>``: a save into an
existing directory moves the old one aside, :func:`~orchestrator.ckpt.manifest.set_aside`) are removed
by that thread too, by one rule (:func:`set_aside_to_remove`): the newest one is kept for diagnosis,
and an older one is removed once no file in it changed for ``checkpoint.save_timeout_s`` (any writer
still at it would have been aborted by then), never while it could still be completing.
Pure Python, no torch import.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from orchestrator.ckpt.catalogue import CheckpointInfo, inspect_checkpoint, iter_dirs
from orchestrator.ckpt.manifest import iteration_dir

TRASH_PREFIX = ".trash-"
SET_ASIDE_RE = re.compile(r"^iter_\d+\.(torn|replaced)\.(\d{8}_\d{6})(\.\d+)?$")
"""A directory :func:`~orchestrator.ckpt.manifest.set_aside` renamed (the tag, the time it was set aside)."""
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
            reasons.append(
                "keep_last=null (all)" if keep_last is None else f"newest {len(newest)} (keep_last={keep_last})"
            )
        why = ", ".join(reasons) or f"older than the newest {keep_last} (keep_last={keep_last})"
        out.append(Verdict(info.iteration, info.path, info.status, bool(reasons), why))
    return out


class Pruner:
    """Retention for one job's saves (module docstring): ``after_save`` decides and renames on the caller's
    thread, a thread of its own deletes; ``close`` waits for it. Rank 0 only.

    ``settle_s``: how long a set-aside directory must be unchanged before it may go
    (``checkpoint.save_timeout_s``).
    """

    def __init__(
        self,
        save_dir: "str | os.PathLike",
        keep_last: Optional[int],
        keep_every: Optional[int],
        settle_s: float = 600.0,
    ):
        self.root, self.keep_last, self.keep_every, self.settle_s = Path(save_dir), keep_last, keep_every, settle_s
        self._known: Dict[str, CheckpointInfo] = {}
        self._work: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._scan = threading.Thread(target=self._scan_existing, name="orchestrator-retention-scan", daemon=True)
        self._worker = threading.Thread(target=self._serve, name="orchestrator-retention", daemon=True)
        self._scan.start()
        self._worker.start()
        self._work.put(self._tidy)  # what an earlier job left: trash, old set-aside directories

    def _scan_existing(self) -> None:
        for path in iter_dirs(self.root):
            try:
                self._known.setdefault(path.name, _light(inspect_checkpoint(path, verify=True)))
            except OSError:  # moved away meanwhile (a save set it aside): looked at again by after_save
                continue

    def _serve(self) -> None:
        while (job := self._work.get()) is not None:
            try:
                job()
            except OSError as exc:  # a removal that fails is retried at the next save; never fatal
                print(f"warning: checkpoint retention: {exc}", flush=True)

    def after_save(self, just_saved: int) -> List[Path]:
        """Apply the rule once ``just_saved``'s manifest is written; returns the checkpoints removed (renamed
        away now, their files deleted by the pruner's thread). Only ``just_saved`` is verified here; while the
        start-up check of what was on disk is still running (a save soon after a resume), nothing is
        removed: the next save does it."""
        if self._scan.is_alive():
            return []
        names = {p.name: p for p in iter_dirs(self.root)}
        self._known = {name: info for name, info in self._known.items() if name in names}
        just = iteration_dir(self.root, just_saved)
        self._known[just.name] = _light(inspect_checkpoint(just, verify=True))  # what was just written
        for name in names.keys() - self._known.keys():  # appeared meanwhile (not by this job's saves)
            self._known[name] = _light(inspect_checkpoint(names[name], verify=True))
        removed: List[Path] = []
        infos = list(self._known.values())
        complete = sorted(i.iteration for i in infos if i.status == "complete")
        if self.keep_last is not None and complete and complete[-1] == just_saved:
            for verdict in verdicts(infos, self.keep_last, self.keep_every):
                if not verdict.keep:
                    self._work.put(partial(_delete, to_trash(verdict.path)))  # renamed now, deleted there
                    self._known.pop(verdict.path.name, None)
                    removed.append(verdict.path)
        self._work.put(self._tidy)
        return removed

    def _tidy(self) -> None:
        clear_trash(self.root)
        for path in set_aside_to_remove(set_aside_dirs(self.root), time.time(), self.settle_s):
            _delete(to_trash(path))

    def close(self, timeout_s: float = 300.0) -> bool:
        """Wait (up to ``timeout_s``) for the deletions asked so far; False if some are left (a kill-safe
        ``.trash-*`` leftover, deleted by the next job)."""
        self._work.put(None)
        self._worker.join(timeout_s)
        return not self._worker.is_alive()


def _light(info: CheckpointInfo) -> CheckpointInfo:
    """``info`` without its manifest (a long run's pruner keeps only iteration, path and status)."""
    return CheckpointInfo(info.iteration, info.path, info.status, info.reason)


def set_aside_dirs(save_dir: "str | os.PathLike") -> List[Tuple[Path, float]]:
    """Every set-aside directory of ``save_dir`` (:data:`SET_ASIDE_RE`) and when a file in it last changed."""
    root = Path(save_dir)
    if not root.is_dir():
        return []
    out = []
    for path in root.iterdir():
        if SET_ASIDE_RE.match(path.name) and path.is_dir():
            out.append((path, _last_change(path)))
    return out


def set_aside_to_remove(found: Sequence[Tuple[Path, float]], now: float, settle_s: float) -> List[Path]:
    """The cleanup rule for set-aside directories ``(path, last change)``: keep the one set aside last (its
    name's time, then its last change) for diagnosis; remove each other one unchanged for over ``settle_s``."""

    def order(item: Tuple[Path, float]) -> Tuple[str, float]:
        match = SET_ASIDE_RE.match(item[0].name)
        return (match.group(2) if match else "", item[1])

    ranked = sorted(found, key=order)
    return [path for path, changed in ranked[:-1] if now - changed > settle_s]


def _last_change(path: Path) -> float:
    """The newest mtime of ``path`` and everything under it."""
    newest = 0.0
    for dirpath, _, filenames in os.walk(path):
        for name in [""] + filenames:
            try:
                newest = max(newest, os.stat(os.path.join(dirpath, name)).st_mtime)
            except OSError:
                continue
    return newest


def to_trash(path: "str | os.PathLike") -> Path:
    """Rename ``path`` to ``.trash-<name>`` in its directory (atomic; a free name if that one is taken)."""
    path = Path(path)
    trash, n = path.with_name(f"{TRASH_PREFIX}{path.name}"), 0
    while trash.exists():
        n += 1
        trash = path.with_name(f"{TRASH_PREFIX}{path.name}.{n}")
    os.rename(path, trash)
    return trash


def remove_safely(path: "str | os.PathLike") -> None:
    """Rename ``path`` to ``.trash-<name>`` in its directory (atomic), then delete it file by file."""
    _delete(to_trash(path))


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
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(dirpath, name))
            if pause:
                time.sleep(pause)
                pause = 0.0
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(dirpath)


def describe(save_dir: "str | os.PathLike", infos: Sequence[CheckpointInfo]) -> List[str]:
    """``manifest list``'s "kept because" column, by the newest complete manifest's own retention settings."""
    newest = next((i for i in reversed(sorted(infos, key=lambda i: i.iteration)) if i.status == "complete"), None)
    ck = ((newest.manifest or {}).get("config") or {}).get("checkpoint", {}) if newest else {}
    return [
        v.why if v.keep else f"removed at the next save: {v.why}"
        for v in verdicts(infos, ck.get("keep_last"), ck.get("keep_every"))
    ]
