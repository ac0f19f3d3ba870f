"""Checkpoints with megatron ``dist_checkpointing`` (torch_dist), manifest written last.

Layout on disk::

    <run.dir>/checkpoints/iter_0000050/   megatron torch_dist shards + common.pt
                                          manifest.json   ← written last, atomically, by rank 0

A directory without a verified manifest is not a checkpoint (a torn save). The manifest's digest
(``checkpoint.digest``) is sizes + dist_checkpointing's metadata by default; with ``sha256`` every
rank hashes its share of the files (file ``i`` on rank ``i mod world``) in parallel after the save and
rank 0 gathers the digests, so no rank hashes the whole checkpoint alone.
Model weights are saved through each chunk's ``sharded_state_dict()``, whose keys
are global (layer offsets included), so torch_dist can reload them into another
TP/PP/VPP split; the optimizer through ``optimizer.sharded_state_dict``.
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Dict, List

import torch

from orchestrator.config.schema import JobConfig
from orchestrator.errors import PEER_LOST, CheckpointLoadError, ManifestError, OrchestratorError

CHECKPOINTS = "checkpoints"


def save_dir(cfg: JobConfig) -> Path:
    return Path(cfg.run.dir) / CHECKPOINTS


def iter_dir(cfg: JobConfig, iteration: int) -> Path:
    return save_dir(cfg) / f"iter_{iteration:07d}"


def _model_sharded_state_dict(model: List[torch.nn.Module]) -> Dict[str, object]:
    from orchestrator.runtime.rank.model import unwrap

    if len(model) == 1:
        return {"model": unwrap(model[0]).sharded_state_dict()}
    return {f"model{i}": unwrap(chunk).sharded_state_dict() for i, chunk in enumerate(model)}


def _model_dict_for_optimizer(state: Dict[str, object]) -> Dict[str, object]:
    """The model part of ``state`` for ``optimizer.sharded_state_dict``: megatron walks its nested
    values to map parameters, so with several chunks (VPP) each chunk stays under its own key
    (merging them would let chunk 1's local layer names overwrite chunk 0's)."""
    if "model" in state:
        return state["model"]  # type: ignore[return-value]
    return {key: state[key] for key in sorted(state) if key.startswith("model")}


SHARDING_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
"""The ``metadata`` of ``optimizer.sharded_state_dict``: Megatron-LM's default for the distributed optimizer
(``_build_sharded_state_dict_metadata`` in megatron/training/checkpointing.py without
``--dist-ckpt-optim-fully-reshardable``): each rank writes its own buffer shards, no gather on DP rank 0;
resharding only over DP (the resume check refuses any layout change anyway). megatron-core's own default,
``fully_sharded_model_space``, fails on its own ``flattened_range`` check in 0.16.1. The regular optimizer
ignores it."""


class _Watchdog:
    """Kill the process if a block takes longer than ``timeout_s`` (a hung save must not hang the job)."""

    def __init__(self, timeout_s: float, what: str):
        self.timeout_s, self.what = timeout_s, what
        self._done = threading.Event()

    def __enter__(self):
        def watch():
            if not self._done.wait(self.timeout_s):
                sys.stderr.write(
                    f"[orchestrator] {self.what} did not finish within {self.timeout_s:.0f}s "
                    f"(checkpoint.save_timeout_s); aborting this rank\n"
                )
                sys.stderr.flush()
                os._exit(3)

        threading.Thread(target=watch, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        return False


def _prepare(cfg: JobConfig, model, optimizer, scheduler, iteration: int, consumed_samples: int):
    """The checkpoint directory (a torn or older one there moved aside, never deleted) and this rank's
    sharded state; collective."""
    path = iter_dir(cfg, iteration)
    if torch.distributed.get_rank() == 0:
        if path.exists():
            # A directory already here is either a torn save (no manifest) or an older save of the
            # same iteration: move it aside (never delete), so the new digest covers only new files.
            from orchestrator.ckpt.catalogue import set_aside

            set_aside(path, tag="replaced" if (path / "manifest.json").exists() else "torn")
        path.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    state = _model_sharded_state_dict(model)
    state["optimizer"] = optimizer.sharded_state_dict(_model_dict_for_optimizer(state), metadata=SHARDING_METADATA)
    state["scheduler"] = scheduler.state_dict()
    state["progress"] = {"iteration": iteration, "consumed_samples": consumed_samples}
    start_writer_queue()
    return path, state


def save(cfg: JobConfig, model, optimizer, scheduler, *, iteration: int, consumed_samples: int, manifest_fn) -> Path:
    """Save model + optimizer + scheduler state at ``iteration``; rank 0 writes the manifest last.

    ``manifest_fn(checkpoint_dir) -> None`` is called on rank 0 after every rank finished writing.
    Raises nothing on timeout: the watchdog ends the rank with exit code 3 instead of hanging.
    """
    from megatron.core import dist_checkpointing

    path, state = _prepare(cfg, model, optimizer, scheduler, iteration, consumed_samples)
    with _Watchdog(cfg.checkpoint.save_timeout_s, f"checkpoint save to {path}"):
        dist_checkpointing.save(state, str(path))
        torch.distributed.barrier()
        if getattr(cfg.checkpoint, "digest", "size") == "sha256":
            _hash_in_parallel(path)
    if torch.distributed.get_rank() == 0:
        manifest_fn(path)
    torch.distributed.barrier()
    return path


def save_async(cfg: JobConfig, model, optimizer, scheduler, *, iteration: int, consumed_samples: int):
    """Stage this rank's state for an asynchronous write at ``iteration`` and return megatron's
    ``AsyncRequest`` (:mod:`orchestrator.runtime.training.async_save` schedules it). Nothing is complete
    until the request's finalize functions ran: megatron's write ``.metadata`` and ``metadata.json``; the
    caller's, appended after them, the manifest (so a kill before leaves a torn, skipped directory)."""
    from megatron.core import dist_checkpointing

    path, state = _prepare(cfg, model, optimizer, scheduler, iteration, consumed_samples)
    return path, dist_checkpointing.save(state, str(path), async_sharded_save=True)


def start_writer_queue() -> None:
    """Start megatron's checkpoint-writer results queue (a multiprocessing Manager: a process started
    at the first save and kept for the next ones) shielded from the stop signals, see
    :func:`orchestrator.runtime.faults.preempt.with_stop_signals_shielded`. Idempotent.

    megatron-core spawns that process (a fresh interpreter), which then imports torch to unpickle the
    first write results it receives: 2.6 s of the first save of every rank process (cProfile of a
    1-rank gpt_tiny save: 2.63 of 3.01 s in the queue's first ``put``). A CPU job (the CPU layer is on)
    forks it instead, with torch already imported; GPU jobs keep megatron's
    spawned process, which holds no copy of a CUDA process."""
    from orchestrator.runtime.faults.preempt import with_stop_signals_shielded
    from orchestrator.runtime.rank import cpu, mcore

    start = mcore.write_results_queue_starter()
    if start is None or mcore.write_results_queue_started():
        return
    if cpu.is_active():
        mcore.set_write_results_queue(with_stop_signals_shielded(_forked_results_queue))
    else:
        with_stop_signals_shielded(start)


def _forked_results_queue():
    """A queue served by a forked multiprocessing Manager that dies with this rank (a SIGKILLed rank
    would otherwise leave it running, holding ~370 MiB and the rank's log files)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from orchestrator.runtime.rank.process import die_with_parent

    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(initializer=die_with_parent)
    return manager.Queue()  # the proxy keeps the manager (and so its process) alive


def _hash_in_parallel(path: Path) -> None:
    """Every rank sha256-hashes its share of the checkpoint's files; rank 0 keeps them all for the
    manifest (:func:`orchestrator.ckpt.digest.remember_hashes`). Collective."""
    from orchestrator.ckpt.digest import checkpoint_files, hash_files, remember_hashes

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mine = hash_files(path, checkpoint_files(path)[rank::world], use_known=False)
    gathered: List[object] = [None] * world
    torch.distributed.all_gather_object(gathered, mine)
    if rank == 0:
        remember_hashes(path, {rel: digest for part in gathered for rel, digest in part.items()})  # type: ignore[union-attr]


def load(path: Path, model, optimizer=None, scheduler=None) -> Dict[str, int]:
    """Load a checkpoint into ``model`` (and optimizer/scheduler when given).

    With ``optimizer=None`` only model weights are loaded (``checkpoint.init_from``).
    Returns ``{"iteration", "consumed_samples"}`` from the checkpoint. Whatever the load raises (torch's
    ``CheckpointException`` is no ``Exception``: it escaped submitit, which then wrote no result) becomes one
    :class:`CheckpointLoadError` naming the checkpoint, the failing rank(s) and their error.
    """
    if not (path / "metadata.json").exists():
        raise ManifestError(f"{path} is not a megatron dist_checkpointing directory (no metadata.json)")
    try:
        return _load(path, model, optimizer, scheduler)
    except (SystemExit, KeyboardInterrupt, OrchestratorError):
        raise
    except BaseException as exc:  # noqa: BLE001 - reworded in one line, the traceback kept as its cause
        if _peer_lost(exc):  # a peer died during the load: a crash like any other (restarted, requeued), not the file
            raise RuntimeError(f"checkpoint {path}: a peer was lost during the load ({load_failure(exc)})") from exc
        raise CheckpointLoadError(
            f"checkpoint {path} could not be loaded ({load_failure(exc)}); it is damaged or "
            f"does not fit this model: restore it, or move it aside (mv {path} {path}.bad) "
            f"and rerun to resume from the checkpoint before it"
        ) from exc


def _peer_lost(exc: BaseException) -> bool:
    """Whether a failed load (or any rank's failure inside torch's ``CheckpointException``) was a broken
    collective -- another rank gone -- rather than this checkpoint's bytes."""
    failures = getattr(exc, "failures", None)
    errors = [e for e, _ in failures.values()] if isinstance(failures, dict) and failures else [exc]
    for error in errors:
        while error is not None:
            if isinstance(error, getattr(torch.distributed, "DistError", ())) or any(
                m in str(error) for m in PEER_LOST
            ):
                return True
            error = error.__cause__ or error.__context__
    return False


def load_failure(exc: BaseException) -> str:
    """``rank(s) R: Type: first line`` of a failed load: the ranks and error inside torch's
    ``CheckpointException`` (each rank's own), else this rank's exception."""
    failures, error = getattr(exc, "failures", None), exc
    if isinstance(failures, dict) and failures:
        ranks, (error, _) = sorted(failures), next(iter(failures.values()))
    else:
        ranks = [torch.distributed.get_rank() if torch.distributed.is_initialized() else 0]
    first = (str(error).strip().splitlines() or [""])[0][:300]
    return f"rank(s) {ranks}: {type(error).__name__}: {first}"


def _load(path: Path, model, optimizer, scheduler) -> Dict[str, int]:
    from megatron.core import dist_checkpointing

    from orchestrator.runtime.rank.model import unwrap

    state = _model_sharded_state_dict(model)
    if optimizer is not None:
        from orchestrator.runtime.rank.mcore import fill_distributed_optimizer_states

        fill_distributed_optimizer_states(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(
            _model_dict_for_optimizer(state), is_loading=True, metadata=SHARDING_METADATA
        )
    loaded = dist_checkpointing.load(state, str(path))
    if len(model) == 1:
        unwrap(model[0]).load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(model):
            unwrap(chunk).load_state_dict(loaded[f"model{i}"])
    if optimizer is not None:
        from orchestrator.runtime.rank.mcore import load_optimizer_state

        # no autograd: with fp32 weights the distributed optimizer's main shards are views of the model's
        # parameters, which megatron-core copies the loaded values into (an in-place op on a leaf's view)
        with torch.no_grad():
            load_optimizer_state(optimizer, loaded["optimizer"])
    if scheduler is not None and "scheduler" in loaded:
        scheduler.load_state_dict(loaded["scheduler"])
    progress = loaded.get("progress", {"iteration": 0, "consumed_samples": 0})
    return {"iteration": int(progress["iteration"]), "consumed_samples": int(progress["consumed_samples"])}
