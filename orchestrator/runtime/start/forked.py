"""Forked ranks: one process imports torch and megatron-core once, then forks the other ranks.

A fresh rank process spends ~3 s of CPU importing torch and megatron-core on this project's CI
machine (once :mod:`orchestrator.runtime.rank.startup` keeps out what a rank never uses; 7 s before).
A local job of N CPU ranks on a machine with fewer than N cores would pay it N times, one core after
another. A local CPU job therefore runs as **one** submitit task that
imports once and forks ranks 1..N-1 from itself (:func:`fork_ranks`); the task itself is rank 0.
Each forked rank is a process of its own -- its own process group, memory, peak and result file
(``<job_id>_<rank>_result.pkl``, written as submitit writes it) and its own log
(``<job_id>_<rank>_log.out|err``) -- so the launcher, ``status`` and the run directory see the
same job as with one task per rank. Warm pools (:mod:`orchestrator.runtime.start.pool`) fork their
trials' ranks the same way.

Forking is safe here because nothing has started a thread, a process group or a device context
when it happens: the parent only imported modules. GPU jobs (and SLURM jobs: one task per rank,
started by srun) never fork.

``<job_id>_ranks.json`` (in the submitit folder) lists every rank's process id
(:func:`ranks_path`): the launcher checks them to find a rank that died without a result. Forked
ranks die with their parent (``PR_SET_PDEATHSIG``), so no rank outlives a killed job.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set

from orchestrator.runtime.rank.process import die_with_parent, flush_and_exit, resident_file_pages, touch_pages
from orchestrator.runtime.start.worker_deaths import signal_line

PRELOADED = (
    "torch._dynamo",  # torch.optim's step imports it (the first step of every rank otherwise)
    "megatron.core.datasets.blended_megatron_dataset_builder",
    "megatron.core.datasets.gpt_dataset",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron.core.tokenizers.text",
    "megatron.core.tokenizers.text.models",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.torch",
    "psutil",
    "orchestrator.runtime.rank.build",
    "orchestrator.runtime.training.loop",
    "orchestrator.runtime.training.run",
    "orchestrator.runtime.training.checkpoint",
    "orchestrator.runtime.training.resume",
    "orchestrator.runtime.faults.diskspace",
    "orchestrator.runtime.faults.guard",
    "orchestrator.runtime.faults.requeue",
    "orchestrator.runtime.faults.watchdog",
    "orchestrator.runtime.faults.preempt",
    "orchestrator.ckpt.lock",
    "orchestrator.ckpt.manifest",
    "orchestrator.ckpt.resume",
    "orchestrator.plan.ckpt_size",
    "orchestrator.plan.memory",
)
"""What a rank imports to train, save and resume: imported once before forking, the forks share it. A
module a rank imports after the fork costs every rank its import again (megatron's tokenizers, layer
specs and checkpoint strategies did: 0.5 CPU-s per forked rank, on top of transformers' 0.9, which a
rank no longer imports at all: :mod:`orchestrator.runtime.rank.startup`)."""


def preload() -> None:
    """Import :data:`PRELOADED` (before forking: the forks share it)."""
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)


def ranks_path(folder: "str | os.PathLike", job_id: str) -> Path:
    """``{rank: pid}`` of a job whose ranks were forked (JSON, written by rank 0 after forking)."""
    return Path(folder) / f"{job_id}_ranks.json"


def read_rank_pids(folder: "str | os.PathLike", job_id: str) -> Dict[int, int]:
    """The process id of each rank of a forked job ({} when its ranks were not forked, or not yet)."""
    try:
        return {int(r): int(p) for r, p in json.loads(ranks_path(folder, job_id).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def alive_forked_ranks(folder: "str | os.PathLike", job_id: str) -> Optional[Set[int]]:
    """The forked ranks (1..N-1) of job ``job_id`` whose process is alive and not a zombie (a fork that
    died stays one until rank 0 reaps it); None when the job recorded no forked ranks (yet)."""
    import psutil

    pids = read_rank_pids(folder, job_id)
    if not pids:
        return None
    alive: Set[int] = set()
    for rank, pid in pids.items():
        try:
            if rank and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(rank)
        except psutil.NoSuchProcess:
            pass
    return alive


def _redirect_output(log_prefix: str) -> None:
    """stdout/stderr to ``<log_prefix>.out|err`` (appended), as submitit names a task's logs."""
    for fd, suffix in ((1, "out"), (2, "err")):
        out = os.open(f"{log_prefix}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)


def fork_child(
    rank: int,
    world_size: int,
    env: Dict[str, str],
    log_prefix: Optional[str],
    pages: List[int],
    body: Callable[[], Any],
) -> int:
    """Fork rank ``rank``; returns the child's pid in the parent. In the child: die with the parent,
    count the shared pages, take the rank's environment and its logs (``log_prefix``; None keeps the
    parent's), run ``body()`` and exit: 0 when it returned, a ``SystemExit``'s status, 1 when it raised
    (never returns)."""
    sys.stdout.flush()
    sys.stderr.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        die_with_parent(parent)
        touch_pages(pages)
        os.environ.update(
            env,
            SUBMITIT_LOCAL_NTASKS=str(world_size),
            SUBMITIT_LOCAL_GLOBALID=str(rank),
            SUBMITIT_LOCAL_LOCALID=str(rank),
        )
        if log_prefix is not None:
            _redirect_output(log_prefix)
        body()
        code = 0
    except SystemExit as exc:  # a graceful stop or requeue (runtime.preempt): its exit status
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - printed; the body wrote what the launcher reads
        traceback.print_exc()
    finally:
        flush_and_exit(code)
    return 0  # never reached


def fork_ranks(world_size: int, body: Callable[[], Any]) -> Dict[int, int]:
    """In the one submitit task of a local CPU job: import what training needs, fork ranks
    1..``world_size``-1 (each runs ``body()`` and exits), record every rank's pid and make this
    process rank 0. Returns ``{rank: pid}`` of the forked ranks."""
    import gc

    import submitit

    env = submitit.JobEnvironment()
    folder, job_id = Path(env.paths.folder), str(env.job_id)
    preload()
    gc.collect()  # the imports' garbage (the collector is off during start-up: startup.pause_collector) is freed
    gc.freeze()  # the forks' collectors leave the imported objects alone: fewer copy-on-write copies
    pages = resident_file_pages()
    os.environ["SUBMITIT_LOCAL_NTASKS"] = str(world_size)
    pids = {
        rank: fork_child(rank, world_size, {}, str(folder / f"{job_id}_{rank}_log"), pages, body)
        for rank in range(1, world_size)
    }
    from orchestrator.io import write_atomic

    write_atomic(ranks_path(folder, job_id), json.dumps({0: os.getpid(), **pids}))
    return pids


def status_line(status: int) -> Optional[str]:
    """``"exit by signal 9, SIGKILL"`` for a wait status ``status`` that a signal ended, else None."""
    return signal_line(os.WTERMSIG(status)) if os.WIFSIGNALED(status) else None


def zombie_signals(folder: "str | os.PathLike", job_id: str) -> Dict[int, str]:
    """How the forked ranks of job ``job_id`` that died and are not reaped yet ended, read by any process (the
    launcher is not their parent) from ``/proc/<pid>/stat``'s ``exit_code`` (field 52, a wait status, Linux >= 3.5):
    ``{rank: "exit by signal 9, SIGKILL"}``. Empty where ``/proc`` does not say."""
    found = {rank: zombie_signal(pid) for rank, pid in (read_rank_pids(folder, job_id) or {}).items()}
    return {rank: line for rank, line in found.items() if line}


def zombie_signal(pid: int) -> str:
    """How process ``pid`` ended when it is a zombie that a signal killed (``exit by signal 9, SIGKILL``), read by any
    process from ``/proc/<pid>/stat``'s ``exit_code`` (field 52, a wait status, Linux >= 3.5); "" otherwise."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat[stat.rindex(")") + 2 :].split()  # from field 3 (state) on: comm may hold spaces
    return (status_line(int(fields[49])) or "") if fields[0] == "Z" and len(fields) >= 50 else ""


def killed_ranks(pids: Dict[int, int]) -> Dict[int, str]:
    """The forked ranks that a signal has already ended (reaped now): ``{rank: "exit by signal 9, SIGKILL"}``.
    Rank 0 calls it when a collective failed, to name the peer whose death broke it."""
    killed: Dict[int, str] = {}
    for rank, pid in sorted(pids.items()):
        try:
            got, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        if got and status_line(status):
            killed[rank] = status_line(status)
    return killed


def reap(pids: Dict[int, int], timeout_s: float = 60.0) -> Dict[int, int]:
    """Wait (at most ``timeout_s``) for the forked ranks to exit; returns ``{rank: exit status}`` of
    those that did (a signal ``s`` as ``-s``)."""
    import time

    done: Dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    while len(done) < len(pids) and time.monotonic() < deadline:
        for rank, pid in pids.items():
            if rank in done:
                continue
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done[rank] = 0
                continue
            if got:
                done[rank] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return done
