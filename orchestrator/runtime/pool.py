"""Warm ranks: one job whose rank processes train trial after trial (sweep points, tune trials).

A fresh job pays its whole start-up for every trial: N processes start Python, import torch and
megatron-core, rendezvous and join the process group (10-30 s on a busy 2-core machine, for a
trial that trains for 5). :class:`PoolJob` is submitted once, like a training job (submitit,
one task per rank, local or one SLURM allocation); each rank imports what training needs, then
loops over trial files in the pool directory (the launcher's :class:`~orchestrator.submit.pool.WarmPool`
writes them):

    <pool>/trial_<n>.json             {"config", "prepared", "time"} or {"stop": true}
    <pool>/trial_<n>.result.json      rank 0: every rank's summary (by global rank)
    <pool>/trial_<n>.rank<r>.error    a rank's exception, before the rank exits

Per trial, each rank takes the trial's run lock as a job does, frees what the last trial left and
resets its peak memory (:func:`~orchestrator.runtime.summary.reset_peak_memory`), then runs
:func:`orchestrator.runtime.train.run` with ``keep_process_group=True``: megatron's parallel state,
seeds, model, optimizer and datasets are built from the trial's config exactly as in a fresh job
(same losses, tested), only the default process group is kept. Trials must share the world size,
device and backend (the launcher starts another pool otherwise).

A failing trial ends the pool: the failing rank writes its error file and raises, so its task
fails like a job's rank; the launcher cancels the rest and starts a fresh pool for the next trial
(a rank that raised may have left its peers inside a collective). The pool also ends on a ``stop``
file, when the launcher's process is gone (same host), or after :data:`IDLE_TIMEOUT_S` without a
trial.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Dict, Optional

IDLE_TIMEOUT_S = 900.0
"""A warm rank with no trial for this long exits (its launcher died without a stop file)."""
POLL_S = 0.05


def trial_path(pool_dir: "str | os.PathLike", num: int) -> Path:
    return Path(pool_dir) / f"trial_{num}.json"


def result_path(pool_dir: "str | os.PathLike", num: int) -> Path:
    return Path(pool_dir) / f"trial_{num}.result.json"


def error_path(pool_dir: "str | os.PathLike", num: int, rank: int) -> Path:
    return Path(pool_dir) / f"trial_{num}.rank{rank}.error"


def _launcher_alive(owner: Dict[str, Any]) -> bool:
    """False only when the launcher ran on this host and its process is gone."""
    if owner.get("host") != socket.gethostname():
        return True
    import psutil

    try:
        return psutil.Process(int(owner["pid"])).create_time() <= float(owner["pid_created"]) + 1.0
    except (psutil.NoSuchProcess, KeyError, ValueError):
        return False


def _next_trial(pool_dir: Path, num: int, owner: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The ``num``-th trial file (None: stop, launcher gone, or idle too long)."""
    path, deadline, checked = trial_path(pool_dir, num), time.monotonic() + IDLE_TIMEOUT_S, time.monotonic()
    while time.monotonic() < deadline:
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError):  # not there yet (the launcher writes it atomically)
            spec = None
        if spec is not None:
            return None if spec.get("stop") else spec
        if time.monotonic() - checked > 2.0:
            if not _launcher_alive(owner):
                return None
            checked = time.monotonic()
        time.sleep(POLL_S)
    return None


def _preload() -> None:
    """Import what every trial needs while the launcher prepares the first one."""
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.pipeline_parallel  # noqa: F401
    import megatron.core.datasets.gpt_dataset  # noqa: F401

    import orchestrator.runtime.train  # noqa: F401
    import orchestrator.runtime.build  # noqa: F401
    import orchestrator.runtime.loop  # noqa: F401


def _sample_indices(cfg, prepared, rank: int, timeout_s: float = 1800.0) -> None:
    """The trial's GPTDataset sample indices, built once: rank 0 builds what the cache lacks (the launcher
    of a warm pool does not), the others wait for its marker (every rank then loads them)."""
    from orchestrator.runtime.data import cache_indices, indices_cached

    if rank == 0:
        cache_indices(cfg, prepared)
        return
    deadline = time.monotonic() + timeout_s
    while not indices_cached(cfg, prepared):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 did not build the sample indices within {timeout_s:.0f} s")
        time.sleep(POLL_S)


def pid_path(pool_dir: "str | os.PathLike", num: int, rank: int) -> Path:
    """The process id of rank ``rank`` of trial ``num`` in a local pool (the launcher checks it is alive)."""
    return Path(pool_dir) / f"trial_{num}.rank{rank}.pid"


def resident_file_pages() -> list:
    """Addresses of this process's resident pages in readable file-backed mappings (shared libraries,
    bytecode caches), from ``/proc/self/maps`` and the present bit of ``/proc/self/pagemap`` (proc(5)).

    A forked child maps none of these until it touches them (the kernel does not copy page tables of
    file mappings at fork), so its RSS would read ~80 MiB lower than a fresh process's that imported the
    same libraries (measured: 306 vs 384 MiB); :func:`touch_pages` in the child makes them count again,
    so a forked rank's peak memory is a fresh job's. Empty where ``/proc`` is unavailable.
    """
    import struct

    found: list = []
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


def touch_pages(pages: list) -> None:
    """Read one byte of each page (the child's page tables then map them, and its RSS counts them)."""
    import ctypes

    for address in pages:
        ctypes.string_at(address, 1)


def sys_flush_and_exit(code: int) -> None:
    """End a forked rank now: flush its output, skip the interpreter's teardown and atexit handlers
    (they belong to the pool's submitit task)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class PoolJob:
    """``PoolJob(pool_dir, env, owner, fork_ranks)()``: warm ranks; returns how many trials ran.

    ``env`` is applied before torch is imported (as :class:`~orchestrator.runtime.job.TrainJob`);
    ``owner``: the launcher's ``{"host", "pid", "pid_created"}``.

    * ``fork_ranks`` = N > 1 (local pools): the job has one task, which imports torch and megatron-core
      once and then, for every trial, forks N fresh rank processes from itself (copy-on-write; it never
      starts a process group or a thread pool of its own, so every fork is clean). Each trial thus runs
      in new processes -- its own process group, memory and peak, exactly a fresh job's -- without the
      8 CPU-s import per rank.
    * otherwise (SLURM: one allocation): each task is a rank that serves every trial itself, keeping the
      default process group between trials (``train.run(keep_process_group=True)``).
    """

    def __init__(self, pool_dir: str, env: Optional[Dict[str, str]] = None,
                 owner: Optional[Dict[str, Any]] = None, fork_ranks: int = 0):
        self.pool_dir, self.env, self.owner = str(pool_dir), dict(env or {}), dict(owner or {})
        self.fork_ranks = fork_ranks

    def __call__(self) -> Dict[str, Any]:
        os.environ.update(self.env)
        from orchestrator.runtime.job import _whoami, exit_fast_after_success

        done = exit_fast_after_success()
        _preload()
        trials = self._zygote() if self.fork_ranks > 1 else self._serve(_whoami()[0])
        done()
        return {"trials": trials}

    def _zygote(self) -> int:
        """Fork ``fork_ranks`` fresh ranks per trial and wait for them; returns how many trials ran."""
        import submitit

        from orchestrator.runtime.distributed import LOCAL_PORT_VAR, reserve_local_port

        env = submitit.JobEnvironment()
        log_dir, job_id, pool_dir, num = Path(env.paths.stdout).parent, str(env.job_id), Path(self.pool_dir), 0
        import gc

        gc.collect()
        gc.freeze()  # the children's collector leaves the imported objects alone: fewer copy-on-write copies
        while True:
            spec = _next_trial(pool_dir, num, self.owner)
            if spec is None:
                return num
            ranks_env = {"SUBMITIT_LOCAL_NTASKS": str(self.fork_ranks), LOCAL_PORT_VAR: str(reserve_local_port())}
            pages = resident_file_pages()
            pids = [self._fork(spec, num, rank, ranks_env, log_dir / f"{job_id}_{rank}_log", pages)
                    for rank in range(self.fork_ranks)]
            for pid in pids:
                os.waitpid(pid, 0)
            num += 1

    def _fork(self, spec: Dict[str, Any], num: int, rank: int, ranks_env: Dict[str, str], log: Path,
              pages: list) -> int:
        """Fork rank ``rank`` of trial ``num``; in the child: run it and exit (0: done, 1: it failed)."""
        import sys

        from orchestrator.io import write_atomic

        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            return pid
        code = 1
        try:
            touch_pages(pages)  # memory accounting as in a fresh process that imported the same libraries
            os.environ.update(ranks_env, SUBMITIT_LOCAL_GLOBALID=str(rank), SUBMITIT_LOCAL_LOCALID=str(rank))
            if rank > 0:  # rank 0 keeps the task's own log
                for fd, suffix in ((1, "out"), (2, "err")):
                    out = os.open(f"{log}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(out, fd)
                    os.close(out)
            write_atomic(pid_path(self.pool_dir, num, rank), str(os.getpid()))
            print(f"warm trial {num}: rank {rank} of {self.fork_ranks} forked (pid {os.getpid()})", flush=True)
            summaries = self._trial(spec, rank)
            if rank == 0:
                write_atomic(result_path(self.pool_dir, num), json.dumps({"summaries": summaries}, default=str))
            else:  # outlive the trial's result: the launcher takes a rank gone before it for a death
                deadline = time.monotonic() + 60.0
                while not result_path(self.pool_dir, num).exists() and time.monotonic() < deadline:
                    time.sleep(POLL_S)
            code = 0
        except BaseException:  # noqa: BLE001 - the error file is what the launcher reads
            traceback.print_exc()
            try:
                write_atomic(error_path(self.pool_dir, num, rank), traceback.format_exc())
            except OSError:
                pass
        finally:
            sys_flush_and_exit(code)
        return 0  # never reached

    def _serve(self, rank: int) -> int:
        """Run trials until the stop file; returns how many ran (raises what a trial raised)."""
        from orchestrator.io import write_atomic
        from orchestrator.runtime.distributed import shutdown

        pool_dir, num = Path(self.pool_dir), 0
        try:
            while True:
                spec = _next_trial(pool_dir, num, self.owner)
                if spec is None:
                    break
                try:
                    summaries = self._trial(spec, rank)
                except BaseException:
                    write_atomic(error_path(pool_dir, num, rank), traceback.format_exc())
                    raise
                if rank == 0:
                    write_atomic(result_path(pool_dir, num), json.dumps({"summaries": summaries}, default=str))
                num += 1
        finally:
            shutdown()
        return num

    @staticmethod
    def _trial(spec: Dict[str, Any], rank: int) -> list:
        """Run one trial on this rank; rank 0 gets every rank's summary (others: [])."""
        import torch

        from orchestrator.runtime.data import PreparedData
        from orchestrator.runtime.job import hold_run_lock
        from orchestrator.runtime.summary import reset_peak_memory
        from orchestrator.runtime.train import run
        from orchestrator.spec.schema import from_dict

        cfg, prepared = from_dict(spec["config"]), PreparedData(**spec["prepared"])
        _sample_indices(cfg, prepared, rank)
        reset_peak_memory("cuda" if cfg.training.device != "cpu" and torch.cuda.is_available() else "cpu")
        with hold_run_lock(cfg.run.dir, since=float(spec["time"]) - 1.0):
            summary = run(cfg, prepared, keep_process_group=True)
        gathered = [None] * torch.distributed.get_world_size() if torch.distributed.get_rank() == 0 else None
        torch.distributed.gather_object(summary, gathered, dst=0)
        return list(gathered or [])
