"""One save, from the room check to its record: the :class:`Saver` every rank calls at a save iteration.

    saver(iteration, consumed)        collective, in this order:
      1. a pending asynchronous write is finished first (at most one in flight)
      2. room: rank 0 compares the free space with the last checkpoint's bytes (the planner's
         prediction before the first) and every rank stops before a save that cannot fit
         (DiskFullError, naming the numbers; checkpoint.space_check=false skips it)
      3. the write: synchronous (runtime.checkpoint.save) or handed to megatron's asynchronous path
         (runtime.async_save) — training continues and poll() finalizes it once every rank is done
      4. completion, on every rank once every rank's shards are on disk: rank 0 writes the manifest
         (with its ``save`` block), applies retention (ckpt.retention: only now, so the newest complete
         checkpoint is this one; it verifies this checkpoint only and renames what goes, its thread
         deletes the files) and broadcasts the record; the logging rank appends it to metrics.jsonl
         as a ``saved`` event, which the launcher prints in one line.

Times are the slowest rank's: ``blocking_s`` how long training was held (sync: the whole write and
its digest; async: building the state, staging the tensors and forking the writer), ``write_s`` from
the start until every rank's shards were written (async: seen at the first iteration boundary after).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional

import torch

from orchestrator.config.tokenizer import model_vocab_size
from orchestrator.errors import DiskFullError
from orchestrator.runtime.rank import param_sync
from orchestrator.runtime.rank.build import Rank, versions
from orchestrator.runtime.training import checkpoint as ckpt
from orchestrator.runtime.training.async_save import AsyncSaves


def slowest(rank: Rank, seconds: float) -> float:
    """The largest of every rank's ``seconds`` (collective)."""
    value = torch.tensor([seconds], dtype=torch.float64, device=rank.tensor_device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
    return float(value[0])


def room_problem(run_dir: str, path: Path, expected: int) -> Optional[str]:
    """Why a save of ``expected`` bytes into ``path`` cannot fit now (one line), or None."""
    from orchestrator.ckpt.space import disk_space, size_text
    from orchestrator.runtime.faults.diskspace import latest_checkpoint

    free, total, mount = disk_space(path.parent)
    if free is None or free >= expected:
        return None
    latest = latest_checkpoint(run_dir)
    resume = f"the latest complete checkpoint is {latest}" if latest else "no complete checkpoint yet"
    return (
        f"checkpoint {path.name} not started: it needs ~{size_text(expected)} and {mount} has "
        f"{size_text(free)} free of {size_text(total)}; {resume}; fix: free space there (or set run.root to a "
        f"larger filesystem, or lower checkpoint.keep_last) and rerun to resume"
    )


def _dying_with_parent(write, *args, **kwargs):
    """megatron's forked writer process, killed with its rank (a SIGKILLed rank's writer would finish
    the shards of a save nobody completes, holding the rank's memory and files for as long)."""
    from orchestrator.runtime.rank.process import die_with_parent

    die_with_parent()
    return write(*args, **kwargs)


@dataclass
class _Save:
    iteration: int
    consumed: int
    path: Path
    t0: float
    started: float
    is_async: bool
    blocking_s: float = 0.0


class Saver:
    """Saves a checkpoint of this rank's state (module docstring); rank 0 writes the manifest last.

    The manifest records the config (``optimizer.lr``, ``training.train_iters`` as run), under
    ``state.scheduler`` megatron's scheduler state as used (max/min lr, warm-up and decay steps,
    step count), the run's attempts (``history``, from the guard) and how the save went (``save``).
    """

    def __init__(self, rank: Rank, prepared, origin: Optional[Dict[str, object]], guard=None, trackers=None):
        from orchestrator.data.tokenizer import tokenizer_identity
        from orchestrator.plan.ckpt_size import checkpoint_bytes

        self.rank, self.origin, self.guard, self.trackers = rank, origin, guard, trackers
        self.data_identity = prepared.identity(rank.cfg.data)
        self.tokenizer = tokenizer_identity(rank.cfg.data)
        self.versions = versions()
        self.expected_bytes = checkpoint_bytes(rank.cfg, rank.layout)
        self.async_saves = AsyncSaves() if rank.cfg.checkpoint.async_save else None
        self.records: List[Dict[str, object]] = []
        self.last_blocking_s = 0.0
        """How long the latest save held training, the slowest rank's seconds (the same on every rank)."""
        self._pending: Optional[_Save] = None
        self.pruner = None
        if rank.rank0:  # retention (ckpt.retention): verifies what is on disk now, in its own thread
            from orchestrator.ckpt.retention import Pruner

            c = rank.cfg.checkpoint
            self.pruner = Pruner(ckpt.save_dir(rank.cfg), c.keep_last, c.keep_every, settle_s=c.save_timeout_s)

    def _guarded(self, iteration: int):
        return self.guard.saving(iteration) if self.guard is not None else contextlib.nullcontext()

    def __call__(self, iteration: int, consumed: int) -> Path:
        """Save at ``iteration``; returns the checkpoint directory (collective: every rank calls it)."""
        r, b = self.rank, self.rank.built
        self._finish_write()
        path = ckpt.iter_dir(r.cfg, iteration)
        self._check_room(path)
        if r.rank0:
            print(f"saving checkpoint {path.name}", flush=True)  # the rank's log; the launcher prints the record
        save = _Save(iteration, consumed, path, time.perf_counter(), time.time(), self.async_saves is not None)
        with self._guarded(iteration), param_sync.gathered(b.model):  # current params on every rank
            if self.async_saves is None:
                ckpt.save(
                    r.cfg,
                    b.model,
                    b.optimizer,
                    b.scheduler,
                    iteration=iteration,
                    consumed_samples=consumed,
                    manifest_fn=lambda p: self._write_manifest(save, time.perf_counter() - save.t0),
                )
                self._complete(save)
            else:
                _, request = ckpt.save_async(
                    r.cfg, b.model, b.optimizer, b.scheduler, iteration=iteration, consumed_samples=consumed
                )
                request.add_finalize_fn(lambda: self._finalize_async(save))
                if request.async_fn is not None:  # None: nothing for this rank to write
                    request = request._replace(async_fn=partial(_dying_with_parent, request.async_fn))
                self.async_saves.schedule(request)
                self._pending = save
                save.blocking_s = slowest(r, time.perf_counter() - save.t0)
        # sync: the record every rank got from rank 0 (which timed the write); async: the staging, slowest rank
        self.last_blocking_s = save.blocking_s if save.is_async else float(self.records[-1]["blocking_s"])  # type: ignore[arg-type]
        return path

    def poll(self) -> None:
        """Finalize a pending asynchronous write once every rank finished it (every iteration; collective
        while one is pending, nothing otherwise)."""
        if self.async_saves is not None and self.async_saves.pending:
            with self._guarded(self._pending.iteration if self._pending is not None else 0):
                self.async_saves.poll(blocking=False)

    def finish(self) -> None:
        """Wait for a pending asynchronous write and complete it, then for retention's deletions (before a
        requeue, at the end)."""
        self._finish_write()
        if self.pruner is not None:
            self.pruner.close()
            self.pruner = None

    def _finish_write(self) -> None:
        """Wait for a pending asynchronous write and complete it (before a save, a requeue, the end)."""
        if self.async_saves is not None and self.async_saves.pending:
            with self._guarded(self._pending.iteration if self._pending is not None else 0):
                self.async_saves.poll(blocking=True)

    def _check_room(self, path: Path) -> None:
        if not self.rank.cfg.checkpoint.space_check:
            return
        verdict: List[object] = [None]
        if self.rank.rank0:
            expected = int(self.records[-1]["bytes"]) if self.records else self.expected_bytes  # type: ignore[call-overload]
            verdict[0] = room_problem(self.rank.cfg.run.dir, path, expected)
        torch.distributed.broadcast_object_list(verdict, src=0)
        if verdict[0]:
            raise DiskFullError(str(verdict[0]))

    def _finalize_async(self, save: _Save) -> None:
        """Every rank, after every rank's write finished and megatron's own finalize ran."""
        if getattr(self.rank.cfg.checkpoint, "digest", "size") == "sha256":
            ckpt._hash_in_parallel(save.path)
        write_s = slowest(self.rank, time.perf_counter() - save.t0)
        if self.rank.rank0:
            self._write_manifest(save, write_s)
        torch.distributed.barrier()
        self._complete(save)

    def _write_manifest(self, save: _Save, write_s: float) -> None:
        from orchestrator.ckpt import manifest as mf

        r = self.rank
        if not save.is_async:
            save.blocking_s = write_s  # training waited for all of it
        manifest = mf.build_manifest(
            r.cfg,
            r.layout,
            iteration=save.iteration,
            consumed_samples=save.consumed,
            checkpoint_dir=str(save.path),
            vocab_size=model_vocab_size(r.cfg, r.tokenizer.vocab_size)[0],
            padded_vocab_size=r.built.padded_vocab_size,  # type: ignore[attr-defined]
            tokenizer=self.tokenizer,
            data=self.data_identity,
            versions=self.versions,
            origin=self.origin,
            rng_and_data_state={"scheduler": r.built.scheduler.state_dict()},
            history=self.guard.history(save.iteration) if self.guard is not None else None,
            hosts=list(getattr(r.info, "hosts", ()) or []) or None,
            save={
                "async": save.is_async,
                "started": save.started,
                "completed": time.time(),
                "write_s": round(write_s, 4),
                "blocking_s": round(save.blocking_s, 4),
            },
            megatron=r.built.megatron.as_json() if r.built.megatron is not None else None,
            link_check=r.link_check,
        )
        mf.write_manifest(str(save.path), manifest)

    def _complete(self, save: _Save) -> None:
        """Retention on rank 0 (the manifest is written), then the record on every rank (collective)."""
        record: List[object] = [None]
        if self.rank.rank0:
            record[0] = self._retain_and_record(save)
        torch.distributed.broadcast_object_list(record, src=0)
        rec: Dict[str, object] = record[0]  # type: ignore[assignment]
        self.records.append(rec)
        if self.trackers is not None:
            self.trackers.event(rec)

    def _retain_and_record(self, save: _Save) -> Dict[str, object]:
        from orchestrator.ckpt.manifest import read_manifest

        manifest = read_manifest(save.path, verify=False)
        t0 = time.perf_counter()
        removed = self.pruner.after_save(save.iteration) if self.pruner is not None else []
        return {
            "event": "saved",
            "iteration": save.iteration,
            "path": str(save.path),
            "bytes": manifest["files"]["bytes"],
            **manifest["save"],
            "prune_s": round(time.perf_counter() - t0, 4),
            "removed": [p.name for p in removed],
            "time": time.time(),
        }
