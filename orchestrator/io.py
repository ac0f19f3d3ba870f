"""File primitives shared by every layer: one atomic write, one JSONL append/read, one file lock.

* :func:`write_atomic` — temp file in the same directory, fsync, ``os.replace``, fsync of the
  directory: a reader sees the old or the new content, never a torn file (POSIX rename).
* :func:`append_jsonl` / :func:`read_jsonl` — one JSON object per line. Appends hold
  :func:`file_lock` and write a whole line with one ``write`` call, so concurrent writers on one
  machine never interleave and readers never see half a line except the last, which
  :func:`read_jsonl` skips.
* :func:`file_lock` — an advisory ``flock`` on ``<path>.lock`` (blocking, or raising
  ``BlockingIOError`` with ``blocking=False``).

No torch, no third-party import.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List, Union

PathLike = Union[str, "os.PathLike[str]"]


def fsync_dir(path: PathLike) -> None:
    """fsync a directory so a rename inside it survives a crash (no-op where unsupported)."""
    with contextlib.suppress(OSError):
        fd = os.open(str(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _current_umask()
"""The process's umask, read once at import (os.umask can only be read by setting it)."""


def write_atomic(path: PathLike, data: Union[str, bytes], *, fsync: bool = True) -> Path:
    """Write ``data`` to ``path`` atomically (temp file + rename); returns the path.

    Raises ``OSError`` (e.g. ``ENOSPC``) with the temp file removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; a written file gets the usual permissions
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)
    return path


@contextlib.contextmanager
def file_lock(path: PathLike, *, blocking: bool = True) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``<path>.lock`` for the ``with`` block.

    ``blocking=False`` raises ``BlockingIOError`` at once when another process holds it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def append_jsonl(path: PathLike, record: Dict[str, Any]) -> Dict[str, Any]:
    """Append ``record`` as one line to the JSONL file ``path`` (created with its parents)."""
    path = Path(path)
    line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
    with file_lock(path):
        with open(path, "ab") as f:
            if f.tell() > 0:  # a previous writer killed mid-line must not glue its half to ours
                with open(path, "rb") as r:
                    r.seek(-1, os.SEEK_END)
                    if r.read(1) != b"\n":
                        line = b"\n" + line
            f.write(line)
            f.flush()
    return record


def read_jsonl(path: PathLike) -> List[Dict[str, Any]]:
    """Every JSON object in ``path`` (one per line); malformed or partial lines are skipped.

    A missing file reads as ``[]``.
    """
    path = Path(path)
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out
