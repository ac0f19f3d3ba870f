"""Resume safety: compare a checkpoint's manifest with the requested run, refuse or allow.

:func:`preflight` runs on the launching machine before submission and again inside the
job before loading. It finds the latest complete checkpoint of ``<run.dir>/checkpoints``,
:func:`compare` s its manifest with the config and layout, and raises
:class:`~orchestrator.errors.ResumeMismatchError` with a table (key, checkpoint value,
requested value) and the Hydra overrides that would match the checkpoint.

Every difference is one of three kinds:

``refuse``  the checkpoint cannot carry it, opt-in or not: model shape, vocab size and
            padded vocab, tokenizer, data identity (kind, paths, weights, split, content
            fingerprint), sequence length, optimizer type and sharding
            (``use_distributed_optimizer``), precision, checkpoint format, and context /
            expert parallel sizes (CP replicates weights and torch_dist keys experts
            globally, but neither resume path is verified here, so they stay refused), and the
            layer spec that ran (``local`` vs ``transformer_engine``, recorded resolved in the
            manifest's ``model.transformer_impl``): the two specs name their state differently
            (TE's fused layer-norm weights, ``_extra_state``) and no test here proves a torch_dist
            load across them. A request of ``auto`` is judged where it resolves: on the launcher
            only when the job will run on CPU (local spec), otherwise by the job itself.
``reshard`` carried by megatron's torch_dist format, only with ``checkpoint.allow_reshard=true``:
            TP, PP, VPP, DP (and the world size), sequence_parallel. Model weights are
            ShardedTensors with global offsets (layers keyed by global layer number), so any
            TP/PP/VPP split maps onto them. Optimizer state: with the non-distributed optimizer
            it is sharded exactly like the weights and reshards the same way; the distributed
            optimizer's default ``fully_sharded_model_space`` format also reshards over
            TP/PP/DP in megatron-core 0.16.1 (``dp_reshardable`` would carry DP only). Also
            here: ``training.global_batch_size`` (consumed-sample accounting and the LR schedule
            meaning change).
``warn``    legitimately changed on resume, reported but never refused: micro_batch_size
            (same GBS gives the same update), train_iters, learning-rate schedule and other
            optimizer hyper-parameters, seed (note: changes GPTDataset shuffling), dropout,
            recomputation, device, software versions (but megatron-core going back to an
            older release line, e.g. a 0.19.x checkpoint under 0.16.x, is refused: its
            dist_checkpointing cannot read what newer lines write).

Run-local settings (``run.*``, ``cluster.*`` except the world size, ``checkpoint.*``,
logging, ``data.cache_dir``, group names), what only plans or sweeps read (``plan``, ``dry_run``,
``gpu``, ``plan_picture``, ``plan_headroom``, ``sweep.*``) are not compared; an empty mapping
(``model.megatron: {}``) is the same as none.

The run lock is :class:`orchestrator.ckpt.lock.RunLock`.
"""

from __future__ import annotations

from typing import Callable, Optional

from orchestrator.ckpt.catalogue import CheckpointInfo, default_warn, iter_dirs, latest_complete
from orchestrator.ckpt.compare import compare
from orchestrator.ckpt.manifest import save_dir_of
from orchestrator.ckpt.mismatch import REFUSE_KEYS, RESHARD, VERSIONS, WARN, blocking, format_mismatch_table
from orchestrator.config.layout import ParallelLayout
from orchestrator.config.schema import JobConfig
from orchestrator.errors import ResumeMismatchError


def preflight(
    cfg: JobConfig,
    layout: ParallelLayout,
    *,
    data_fingerprint: Optional[str] = None,
    tokenizer: Optional[dict] = None,
    warn: Optional[Callable[[str], None]] = None,
    verify: bool = True,
) -> Optional[CheckpointInfo]:
    """The checkpoint this run will resume from (None: start fresh), or raise ResumeMismatchError.

    Looks in ``<run.dir>/checkpoints``. Torn saves are skipped with a warning; a corrupt newest
    checkpoint raises ManifestError (restore or move it aside). With ``checkpoint.auto_resume=false``
    a save directory that already holds checkpoints is refused instead of overwritten.
    """
    warn = warn or default_warn
    save_dir = save_dir_of(cfg)
    if not cfg.checkpoint.auto_resume:
        existing = iter_dirs(save_dir)
        if existing:
            raise ResumeMismatchError(
                f"{save_dir} already holds checkpoints ({existing[0].name} .. {existing[-1].name}) and "
                f"checkpoint.auto_resume=false would train from scratch over them; fix: checkpoint.auto_resume=true "
                f"to resume, or another run.name / run.dir (checkpoint.init_from=<dir> loads weights only)"
            )
        return None
    info = latest_complete(save_dir, warn, verify=verify, skip_corrupt=False)
    if info is None:
        return None
    mismatches = compare(info.manifest, cfg, layout, data_fingerprint=data_fingerprint, tokenizer=tokenizer)
    refused = blocking(mismatches, cfg.checkpoint.allow_reshard)
    if refused:
        only_reshard = all(m.kind == RESHARD for m in refused)
        why = (
            "differs in ways torch_dist can reshard; opt in with checkpoint.allow_reshard=true, or match it"
            if only_reshard
            else "differs in ways a resume cannot carry"
        )
        raise ResumeMismatchError(
            f"cannot resume from {info.path} (iteration {info.iteration}): the requested "
            f"run {why}\n{format_mismatch_table(mismatches)}"
        )
    versions = [m for m in mismatches if m.key.startswith(VERSIONS) and m.kind == WARN]
    if versions:  # one line: an upgrade mid-run is expected; the next manifest's origin keeps the old ones
        warn(
            f"versions changed since {info.path.name}: "
            + ", ".join(f"{m.key[len(VERSIONS) :]} {m.checkpoint} -> {m.requested}" for m in versions)
        )
    others = [m for m in mismatches if m not in versions]
    if others:
        warn(f"resuming from {info.path} with changes:\n{format_mismatch_table(others)}")
    info.mismatches = mismatches
    return info


INIT_SHAPE_KEYS = {k for k in REFUSE_KEYS if k.startswith("model.") and k != "model.seq_length"} | {
    "model.padded_vocab_size"
}
"""What ``checkpoint.init_from``'s weights must match to load (their shapes); the layout may differ."""


def init_from_refusal(manifest: dict, cfg: JobConfig, layout: ParallelLayout) -> Optional[str]:
    """Why ``checkpoint.init_from``'s weights cannot load into the requested model (its diff table), or None."""
    bad = [m for m in compare(manifest, cfg, layout, data_fingerprint=None, tokenizer=None) if m.key in INIT_SHAPE_KEYS]
    if not bad:
        return None
    return (
        f"checkpoint.init_from={cfg.checkpoint.init_from}: its weights do not fit the requested model "
        f"({', '.join(m.key for m in bad)} differ); fix: the matching model overrides below, or a checkpoint "
        f"of this model\n{format_mismatch_table(bad)}"
    )


def origin_of(info: CheckpointInfo) -> dict:
    """The ``origin`` entry for manifests written by a run resumed from ``info``."""
    resharded = {m.key: [m.checkpoint, m.requested] for m in info.mismatches if m.kind == RESHARD}
    changed = any(m.key.startswith(VERSIONS) for m in info.mismatches)
    return {
        "resumed_from": str(info.path),
        "iteration": info.iteration,
        "resharded": resharded,
        "from_layout": (info.manifest or {}).get("layout") if resharded else None,
        "from_versions": (info.manifest or {}).get("versions") if changed else None,
    }


# ---- run lock -------------------------------------------------------------------------
