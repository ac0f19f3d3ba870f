"""This rank's process: die with its parent, exit without teardown, count shared pages as its own.

Used by forked ranks (:mod:`orchestrator.runtime.start.forked`) and by the checkpoint writer's
results Manager a CPU rank forks (:mod:`orchestrator.runtime.training.checkpoint`). Linux-only
calls degrade to no-ops elsewhere.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional


def resident_file_pages() -> List[int]:
    """Addresses of this process's resident pages in readable file-backed mappings (shared libraries,
    bytecode caches), from ``/proc/self/maps`` and the present bit of ``/proc/self/pagemap`` (proc(5)).

    A forked child maps none of these until it touches them (the kernel does not copy page tables of
    file mappings at fork), so its RSS would read ~80 MiB lower than a fresh process's that imported the
    same libraries (measured: 306 vs 384 MiB); :func:`touch_pages` in the child makes them count again,
    so a forked rank's peak memory is a fresh rank's. Empty where ``/proc`` is unavailable.
    """
    import struct

    found: List[int] = []
    try:
        with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
            for line in maps:
                parts = line.split()
                if len(parts) < 6 or parts[4] == "0" or "r" not in parts[1] or parts[5].startswith("["):
                    continue
                start, end = (int(x, 16) for x in parts[0].split("-"))
                pagemap.seek(start // 4096 * 8)
                entries = pagemap.read((end - start) // 4096 * 8)
                found += [start + i * 4096 for i, (e,) in enumerate(struct.iter_unpack("<Q", entries)) if e >> 63]
    except (OSError, ValueError, struct.error):
        return []
    return found


def touch_pages(pages: List[int]) -> None:
    """Read one byte of each page (the child's page tables then map them, and its RSS counts them)."""
    import ctypes

    for address in pages:
        ctypes.string_at(address, 1)


def flush_and_exit(code: int) -> None:
    """End a forked rank: run its ``atexit`` handlers (multiprocessing's shuts down the results Manager
    that megatron's checkpoint writer started, which would otherwise outlive the rank; TensorBoard and
    logging flush), flush its output and exit without the interpreter's teardown (module clean-up and
    garbage collection cost ~1.5 CPU-s per rank, see :func:`orchestrator.runtime.start.job.exit_fast_after_success`)."""
    import atexit

    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - exiting anyway
        pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_parent(parent: Optional[int] = None) -> None:
    """SIGKILL this process when its parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``); exit now if the
    parent (``parent``, default: the current one) is already gone. Forked ranks call it, and so does the
    checkpoint writer's results Manager that a CPU rank forks (:func:`orchestrator.runtime.training.checkpoint.start_writer_queue`):
    a multiprocessing Manager never notices that its parent died."""
    import ctypes
    import signal

    parent = os.getppid() if parent is None else parent

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: a killed parent leaves the fork to the launcher's cancel
        pass
    if os.getppid() != parent:
        os._exit(1)
