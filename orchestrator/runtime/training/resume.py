"""In-job resume or initialisation (the checkpoint saver is :mod:`orchestrator.runtime.training.saving`).

:func:`restore` runs the launcher's resume check again inside the job (the config or the directory
may have changed since submission): rank 0 verifies the latest checkpoint once (hashing every file
once, not once per rank) and broadcasts the decision — the checkpoint to load, or the error that
stops every rank. Then every rank loads it (model, optimizer, scheduler, progress), or only the
model weights of ``checkpoint.init_from``.

The learning-rate schedule after a resume is the config's (:mod:`orchestrator.config.schedule`):
megatron's scheduler is built with ``override_opt_param_scheduler=True``, and the optimizer's
param groups, which the checkpoint restores with the *old* ``max_lr``/``min_lr``, get the config's
values back before the schedule is re-evaluated at the checkpoint's step count.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

from orchestrator.config.hf_config import hf_path
from orchestrator.config.schedule import lr_schedule
from orchestrator.errors import OrchestratorError
from orchestrator.runtime.rank.build import Rank
from orchestrator.runtime.training import checkpoint as ckpt
from orchestrator.runtime.training.saving import Saver, slowest  # noqa: F401  (Saver: the loop's save call)


@dataclass
class Start:
    """Where this job starts."""

    iteration: int
    consumed_samples: int
    origin: Optional[Dict[str, object]]
    """The manifest's ``origin``: the checkpoint resumed from (with resharded keys) or ``init_from``."""
    resumed_from: Optional[str]
    """The checkpoint directory loaded with its optimizer state; None for a fresh start or init_from."""
    load_s: Optional[float] = None
    """How long loading it took on the slowest rank (s); None without a checkpoint to load."""


def _warn_in_job(message: str) -> None:
    """The in-job preflight's warnings (a resume's change table, a torn save skipped) go to rank 0's
    stderr log: the launcher printed the same before submission, and echoes only rank 0's stdout."""
    print(f"[orchestrator] warning: {message}", file=sys.stderr, flush=True)


def _verdict(rank: Rank, prepared):
    """Rank 0's preflight, broadcast: the CheckpointInfo to load (or None); raises its error everywhere."""
    from orchestrator.ckpt import resume as preflight
    from orchestrator.ckpt.megatron_resume import check_megatron_config
    from orchestrator.data.tokenizer import tokenizer_identity

    verdict: List[object] = [None]
    if rank.rank0:
        try:
            info = preflight.preflight(
                rank.cfg,
                rank.layout,
                data_fingerprint=prepared.fingerprint,
                tokenizer=tokenizer_identity(rank.cfg.data),
                warn=_warn_in_job,
            )
            if info is not None and rank.built.megatron is not None:
                check_megatron_config(info.manifest, rank.built.megatron.as_json(), str(info.path), rank.say)
            verdict[0] = ("ok", info)
        except OrchestratorError as exc:
            verdict[0] = ("error", exc)
    torch.distributed.broadcast_object_list(verdict, src=0)
    outcome, value = verdict[0]  # type: ignore[misc]
    if outcome == "error":
        raise value  # type: ignore[misc]
    return value


def apply_config_schedule(rank: Rank) -> None:
    """Give the optimizer's param groups the config's max/min lr and re-evaluate the schedule at the
    scheduler's step count (the checkpoint restored the old ones into the param groups)."""
    sched = lr_schedule(rank.cfg)
    for group in rank.built.optimizer.param_groups:
        group["max_lr"], group["min_lr"] = sched.max_lr, sched.min_lr
    rank.built.scheduler.step(increment=0)


def restore(rank: Rank, prepared) -> Start:
    """Resume from the run's latest checkpoint, or initialise from ``checkpoint.init_from``, or start fresh.

    Raises ResumeMismatchError / ManifestError (same on every rank) when the checkpoint may not be used.
    """
    from orchestrator.ckpt.resume import origin_of

    cfg, built = rank.cfg, rank.built
    latest = _verdict(rank, prepared)
    if latest is not None:
        rank.say(f"loading checkpoint {latest.path}")
        t0 = time.perf_counter()
        if latest.iteration == 0:  # saved before any step (training.train_iters=0): weights, no optimizer state yet
            progress = ckpt.load(Path(latest.path), built.model)
        else:
            progress = ckpt.load(Path(latest.path), built.model, built.optimizer, built.scheduler)
        load_s = slowest(rank, time.perf_counter() - t0)
        apply_config_schedule(rank)
        iteration = progress["iteration"]
        rank.say(
            f"resumed from {latest.path} at iteration {iteration} (loaded in {load_s:.2f} s, slowest rank); "
            f"{lr_schedule(cfg).describe(iteration + 1)}"
        )
        return Start(iteration, progress["consumed_samples"], origin_of(latest), str(latest.path), load_s)
    hf = hf_path(cfg.checkpoint.init_from)
    if hf is not None:
        from orchestrator.runtime.training import hf_start

        return Start(0, 0, hf_start.start(rank, hf), None)
    if cfg.checkpoint.init_from:
        ckpt.load(Path(cfg.checkpoint.init_from), built.model)
        # Megatron-LM's load_checkpoint does this when it loads no optimizer state: the fp32 main params follow
        built.optimizer.reload_model_params()
        rank.say(f"model weights initialised from {cfg.checkpoint.init_from}")
        return Start(0, 0, {"init_from": cfg.checkpoint.init_from}, None)
    return Start(0, 0, None, None)
