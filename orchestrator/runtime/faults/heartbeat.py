"""Heartbeat files: one record per rank, in a file of its own and in a slot of one shared file.

    <run_dir>/heartbeat/rank_<r>   rank r's record (rewritten in place; tools that want one rank read it)
    <run_dir>/heartbeat/ranks      every rank's record, rank r's in bytes [r x SLOT_BYTES, (r+1) x SLOT_BYTES)

Readers of every rank (a rank's hang watchdog, the launcher's backstop) open ``ranks`` once per poll,
whatever the number of ranks, instead of one file per rank. Writers open, ``pwrite`` their own slot and
close (a shared filesystem publishes on close). Torch-free; :mod:`orchestrator.runtime.faults.watchdog`
writes them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, Optional, Union

from orchestrator.ckpt.rundir import HEARTBEAT_DIR

PathLike = Union[str, Path]

SLOT_BYTES = 4096
"""Bytes of one rank's slot in the ``ranks`` file: a page, so ranks on different hosts never write into
the same page of a shared filesystem's file (a record is ~250 bytes)."""


def heartbeat_path(run_dir: PathLike, rank: int) -> Path:
    return Path(run_dir) / HEARTBEAT_DIR / f"rank_{rank}"


def slots_path(run_dir: PathLike) -> Path:
    """``<run_dir>/heartbeat/ranks``: every rank's heartbeat record, one slot per rank."""
    return Path(run_dir) / HEARTBEAT_DIR / "ranks"


def write_slot(path: Path, rank: int, record: Dict[str, Any]) -> None:
    """Rewrite rank ``rank``'s slot of the ``ranks`` file ``path``: the record's JSON, a newline, spaces to
    the slot's end (one ``pwrite``, then close; a record longer than a slot is not written)."""
    data = json.dumps(record, separators=(",", ":")).encode() + b"\n"
    if len(data) > SLOT_BYTES:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data.ljust(SLOT_BYTES), rank * SLOT_BYTES)
    finally:
        os.close(fd)


def read_slot_bytes(path: Path, world_size: int) -> bytes:
    """The slots of ranks ``0..world_size-1`` of the ``ranks`` file as they are on disk (one open, one read;
    ``b""`` when there is no file)."""
    try:
        with open(path, "rb") as f:
            return f.read(world_size * SLOT_BYTES)
    except OSError:
        return b""


def read_slots(path: Path, world_size: int, data: Optional[bytes] = None) -> Dict[int, Dict[str, Any]]:
    """rank -> record of ranks ``0..world_size-1`` from the ``ranks`` file (or its bytes ``data``), in one
    open and one read (a slot never written, or caught mid-write, is left out)."""
    if data is None:
        data = read_slot_bytes(path, world_size)
    out: Dict[int, Dict[str, Any]] = {}
    for rank, start in enumerate(range(0, len(data), SLOT_BYTES)):
        end = data.find(b"\n", start, start + SLOT_BYTES)
        if end < 0 or data[start] != 0x7B:  # "{": a slot never written is zeros
            continue
        try:
            rec = json.loads(data[start:end])
        except ValueError:
            continue
        if isinstance(rec, dict):
            out[rank] = rec
    return out


def write_heartbeat(path: Path, record: Dict[str, Any]) -> None:
    """Rewrite ``path`` in place with ``record`` (one write, then close; no fsync)."""
    data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def read_heartbeat(path: Path) -> Optional[Dict[str, Any]]:
    """The record of a heartbeat file; None when missing or caught mid-write."""
    try:
        rec = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None
