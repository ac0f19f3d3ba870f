"""A checkpoint save that ran out of disk: recognise it, say so in one line.

:func:`explain_save_failure` turns whatever the writer raised (an ``OSError`` with ``ENOSPC``,
megatron's async writer's text "[Errno 28] No space left on device", or torch's zip writer's bare
"unexpected pos 704 vs 598" on a full filesystem) into a :class:`~orchestrator.errors.DiskFullError`
naming ENOSPC, the checkpoint path, the free space and the checkpoint a rerun resumes from. The
launcher uses :func:`out_of_space` / :func:`disk_full_message` when the ranks could not even write
their results (their logs and result files live on the same full filesystem). No torch import.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import List, Optional

from orchestrator.ckpt.rundir import CHECKPOINTS_DIR
from orchestrator.ckpt.space import disk_space as _disk_space
from orchestrator.ckpt.space import size_text as _size
from orchestrator.errors import DiskFullError

DISK_FULL = "no space left on device (ENOSPC)"
"""How every disk-full line starts (the launcher records a line that starts so as cause ``disk full``)."""


def _chain(exc: BaseException) -> List[BaseException]:
    chain, seen = [], set()
    e: Optional[BaseException] = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    return chain


def explain_save_failure(exc: BaseException, path: "str | os.PathLike") -> Optional[DiskFullError]:
    """A :class:`DiskFullError` when the failed save of checkpoint ``path`` ran out of space, else None.

    Out of space: an ``OSError`` with ``ENOSPC`` (or ``EDQUOT``) anywhere in the exception chain, a
    message saying so ("No space left", "Errno 28": megatron's async writer passes only the text, torch's
    ``CheckpointException`` holds each rank's error in its text), or any failure of the save on a filesystem that
    is out of space (:func:`out_of_space`): torch's zip writer says only "unexpected pos …", and a
    ``CheckpointException`` whose failing writer was another process says only ``ranks:dict_keys([])``.
    """
    chain = _chain(exc)
    errnos = {getattr(x, "errno", None) for x in chain}
    text = " ".join(str(x) for x in chain)
    said = bool({errno.ENOSPC, errno.EDQUOT} & errnos) or "No space left" in text or "Errno 28" in text
    if not (said or out_of_space(path)):
        return None
    return DiskFullError(disk_full_message(path))


def explain_write_failure(exc: BaseException, run_dir: "str | os.PathLike") -> Optional[DiskFullError]:
    """A :class:`DiskFullError` when ``exc`` (outside a save: metrics, logs, history) is an ``OSError`` with
    ``ENOSPC``/``EDQUOT`` in its chain, naming the file (else ``run_dir``) and the free space; else None."""
    full = [x for x in _chain(exc) if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT)]
    if not full:
        return None
    return DiskFullError(write_full_message(full[0].filename or run_dir, run_dir))


def out_of_space(path: "str | os.PathLike") -> bool:
    """Whether the filesystem holding ``path`` has less than 1 MiB (or 0.1 %) free."""
    free, total, _ = _disk_space(Path(path))
    return free is not None and (free < 2**20 or bool(total) and free < total / 1000)


def _space(path: Path) -> str:
    free, total, mount = _disk_space(path)
    return f"{_size(free)} free of {_size(total)} on {mount}" if free is not None else "free space unknown"


_FIX = "fix: free space there (or set run.root to a larger filesystem) and rerun to resume"


def disk_full_message(path: "str | os.PathLike") -> str:
    """One line: ENOSPC, the checkpoint ``path``, the free space and what a rerun resumes from."""
    path = Path(path)
    latest = latest_checkpoint(path.parent.parent)
    resume = f"the latest complete checkpoint is {latest}" if latest else "no complete checkpoint yet"
    return (
        f"{DISK_FULL} saving checkpoint {path}: {_space(path)}; the torn save has no "
        f"manifest and is skipped on resume, {resume}; {_FIX}"
    )


def write_full_message(path: "str | os.PathLike", run_dir: "str | os.PathLike") -> str:
    """One line: ENOSPC writing ``path`` (a file of ``run_dir``, or the run directory), the free space, and the
    checkpoint a rerun resumes from."""
    latest = latest_checkpoint(run_dir)
    resume = f"the latest complete checkpoint is {latest}" if latest else "no complete checkpoint yet"
    return f"{DISK_FULL} writing {path}: {_space(Path(run_dir))}; {resume}; {_FIX}"


def latest_checkpoint(run_dir: "str | os.PathLike") -> Optional[str]:
    """Name of the newest ``iter_*`` directory with a manifest (cheap: no digest check)."""
    base = Path(run_dir) / CHECKPOINTS_DIR if Path(run_dir).name != CHECKPOINTS_DIR else Path(run_dir)
    try:
        done = sorted(p.name for p in base.iterdir() if p.name.startswith("iter_") and (p / "manifest.json").exists())
    except OSError:
        return None
    return done[-1] if done else None
