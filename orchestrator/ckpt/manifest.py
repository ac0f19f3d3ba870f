"""Checkpoint manifests: what a checkpoint is, written last, verified before trust.

One ``manifest.json`` per checkpoint directory (``<run.dir>/checkpoints/iter_0000050/``),
written by :func:`write_manifest` after megatron's ``dist_checkpointing.save`` returned
(temporary file in the same directory, fsync, ``os.replace``, fsync of the directory).
A directory without a manifest is a *torn* save and is never resumed from.

The manifest records the full parallel layout, the model shape (with the padded vocab),
tokenizer and data identity, batch settings, iteration and consumed samples, checkpoint
format and optimizer sharding, software versions, the resolved config, the effective
environment, where the run came from (``origin``), a digest of every file of the
checkpoint and a checksum of its own content (``manifest_sha256``), so a truncated,
hand-edited or foreign manifest and changed checkpoint files are all refused by name.

Pure Python: no torch or megatron import (versions come from ``importlib.metadata``).
The resume comparison and preflight live in :mod:`orchestrator.ckpt.resume`, the run lock in
:mod:`orchestrator.ckpt.lock`, the ``manifest`` CLI in :mod:`orchestrator.ckpt.cli`.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
import time
from importlib import metadata
from pathlib import Path
from typing import Dict, List, Optional

from orchestrator.ckpt.digest import (
    MANIFEST_NAME,
    METADATA_FILES,
    SMALL_FILE_BYTES,
    checkpoint_files,
    file_digest,
    hash_files,
)
from orchestrator.ckpt.rundir import CHECKPOINTS_DIR
from orchestrator.config.layout import ParallelLayout
from orchestrator.config.megatron_fields import config_hash
from orchestrator.config.schema import JobConfig, to_dict
from orchestrator.errors import ManifestError
from orchestrator.io import write_atomic

SCHEMA = "orchestrator.manifest/1"
CHECKPOINT_FORMAT = "torch_dist"
_ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "NVTE_", "GLOO_", "UCX_", "FI_", "ORCHESTRATOR_")
_ENV_NAMES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "OMP_NUM_THREADS",
    "TP_SOCKET_IFNAME",
    "SLURM_JOB_ID",
    "SLURM_JOB_NAME",
    "SLURM_JOB_NODELIST",
    "SLURM_NNODES",
    "SLURM_NTASKS",
    "SLURM_RESTART_COUNT",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
)
_SECRET_RE = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|_KEY$", re.I)


# ---- naming -------------------------------------------------------------------
def save_dir_of(cfg: JobConfig) -> Path:
    """``<run.dir>/checkpoints``: where a run's checkpoints live."""
    return Path(cfg.run.dir) / CHECKPOINTS_DIR


def iteration_dir(save_dir: "str | os.PathLike", iteration: int) -> Path:
    """``<save_dir>/iter_0000050``: Megatron's 7-digit zero-padded directory name."""
    return Path(save_dir) / f"iter_{iteration:07d}"


# ---- collection -----------------------------------------------------------------
def collect_versions() -> Dict[str, Optional[str]]:
    """orchestrator, megatron-core, torch, hydra-core and python versions (no imports of them)."""
    out: Dict[str, Optional[str]] = {}
    for dist in ("orchestrator", "megatron-core", "torch", "hydra-core"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    out["python"] = platform.python_version()
    return out


def collect_env(environ: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment that shapes a run: NCCL_*, CUDA_*, MASTER_*, OMP, SLURM job identity.

    Variables whose names look like secrets (TOKEN, SECRET, PASSWORD, *_KEY) are never recorded.
    """
    env = os.environ if environ is None else environ
    return {
        k: env[k] for k in sorted(env) if (k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES) and not _SECRET_RE.search(k)
    }


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def model_record(m, vocab_size: int, padded_vocab_size: int) -> dict:
    """The model's shape as a manifest records it (``m``: the config's ``model`` section)."""
    return {
        "num_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_query_groups": m.num_query_groups or m.num_attention_heads,
        "ffn_hidden_size": m.ffn_hidden_size or 4 * m.hidden_size,
        "seq_length": m.seq_length,
        "max_position_embeddings": m.max_position_embeddings,
        "vocab_size": int(vocab_size),
        "padded_vocab_size": int(padded_vocab_size),
        "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
        "position_embedding_type": m.position_embedding_type,
        "normalization": m.normalization,
        "activation": m.activation,
        "add_bias_linear": m.add_bias_linear,
        "untie_embeddings_and_output_weights": m.untie_embeddings_and_output_weights,
        "num_moe_experts": m.num_moe_experts,
        # the layer spec that ran: the job resolves "auto" before it saves (runtime.model.layer_spec)
        "transformer_impl": None if m.transformer_impl == "auto" else m.transformer_impl,
    }


def batch_and_format(cfg: JobConfig, layout: ParallelLayout) -> dict:
    """The manifest's ``batch`` (MBS, GBS, num_microbatches, the batch ramp) and ``checkpoint`` (format, optimizer and its
    sharding, precision) sections."""
    t, o = cfg.training, cfg.optimizer
    return {
        "batch": {
            "micro_batch_size": t.micro_batch_size,
            "global_batch_size": t.global_batch_size,
            "num_microbatches": layout.num_microbatches,  # the full batch's; a ramp's first ones are fewer
            "rampup_batch_size": list(t.rampup_batch_size) if t.rampup_batch_size is not None else None,
        },
        "checkpoint": {
            "format": CHECKPOINT_FORMAT,
            "optimizer": o.name,
            "distributed_optimizer": o.use_distributed_optimizer,
            "precision": t.precision,
        },
    }


# ---- build / write / read ---------------------------------------------------------
def build_manifest(
    cfg: JobConfig,
    layout: ParallelLayout,
    *,
    iteration: int,
    consumed_samples: int,
    checkpoint_dir: str,
    vocab_size: int,
    padded_vocab_size: int,
    tokenizer: dict,
    data: dict,
    versions: Optional[dict] = None,
    env: Optional[dict] = None,
    origin: Optional[dict] = None,
    rng_and_data_state: Optional[dict] = None,
    digest: Optional[str] = None,
    hosts: Optional[List[str]] = None,
    history: Optional[list] = None,
    save: Optional[dict] = None,
    megatron: Optional[dict] = None,
    link_check: Optional[dict] = None,
) -> dict:
    """The manifest of the checkpoint already saved in ``checkpoint_dir`` (files are digested now).

    ``tokenizer``: identity of the tokenizer (e.g. ``{"type": "byte", "vocab_size": 257}`` or a
    path and its sha256); ``data``: identity of the data (``fingerprint`` and whatever else the
    runtime knows); ``versions``/``env`` extend what is collected here; ``origin`` says where the
    run came from (see :func:`orchestrator.resume.origin_of`); ``digest``: ``size`` or ``sha256``
    (default ``checkpoint.digest``, see :func:`file_digest`); ``hosts``: every rank's host, by rank;
    ``history``: the run's attempts (default: read from ``<run.dir>/jobs.jsonl``,
    :func:`orchestrator.ckpt.attempts.history_for_manifest`); ``save``: how the save went (``async``,
    ``started``, ``completed``, the slowest rank's ``write_s`` and ``blocking_s``; bytes are ``files.bytes``);
    ``megatron``: the megatron config the job built (``megatron_config.json``), recorded whole with its sha256;
    ``link_check``: a multi-node job's measured cross-node links (runtime.faults.links), recorded when given.
    """
    if history is None:
        from orchestrator.ckpt.attempts import history_for_manifest

        history = history_for_manifest(cfg.run.dir, iteration, cfg.training.train_iters)
    m, d = cfg.model, cfg.data
    manifest = {
        "schema": SCHEMA,
        "iteration": int(iteration),
        "consumed_samples": int(consumed_samples),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "hosts": list(hosts) if hosts is not None else None,
        "layout": layout.as_dict(),
        "model": model_record(m, vocab_size, padded_vocab_size),
        "tokenizer": {"spec": d.tokenizer, **tokenizer},
        "data": {
            "kind": d.kind,
            "paths": list(d.paths),
            "weights": d.weights,
            "split": d.split,
            "fingerprint": None,
            **data,
        },
        **batch_and_format(cfg, layout),
        "versions": {**collect_versions(), **(versions or {})},
        "env": {**collect_env(), **(env or {})},
        "origin": origin,
        "history": history,
        "state": rng_and_data_state,
        "save": save,
        "config": to_dict(cfg),
        "megatron_config": megatron,
        "megatron_config_sha256": config_hash(megatron) if megatron is not None else None,
        "files": file_digest(checkpoint_dir, digest or getattr(cfg.checkpoint, "digest", "size")),
    }
    if link_check is not None:
        manifest["link_check"] = link_check
    manifest = json.loads(json.dumps(manifest, default=str))  # exactly what a reader will see
    manifest["manifest_sha256"] = hashlib.sha256(_canonical(manifest)).hexdigest()
    return manifest


def write_manifest(checkpoint_dir: "str | os.PathLike", manifest: dict) -> Path:
    """Write ``manifest.json`` atomically (:func:`orchestrator.io.write_atomic`), with its checksum."""
    if "manifest_sha256" not in manifest:
        manifest = {**manifest, "manifest_sha256": hashlib.sha256(_canonical(manifest)).hexdigest()}
    return write_atomic(Path(checkpoint_dir) / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True) + "\n")


def read_manifest(checkpoint_dir: "str | os.PathLike", verify: bool = True, deep: bool = False) -> dict:
    """Load and check a manifest; ``verify`` also checks the checkpoint's files against it.

    ``verify``: every file present with its recorded size, and the recorded hashes of the
    dist_checkpointing metadata and of small files re-checked (milliseconds at any size);
    ``deep``: every recorded hash re-checked (reads the whole checkpoint; ``manifest check --deep``).

    Raises :class:`ManifestError` naming the directory when it does not exist, and naming the file for a
    missing, truncated, invalid, foreign or hand-edited manifest, and naming the changed files when the checkpoint no longer matches.
    """
    directory = Path(checkpoint_dir)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():  # a path typed wrong is no torn save
        raise ManifestError(
            f"{directory}: {'not a directory' if directory.exists() else 'does not exist'}; fix: a checkpoint "
            "directory, <run dir>/checkpoints/iter_XXXXXXX (manifest list <run dir> lists them)"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(
            f"{path}: no manifest — the save into {directory} never finished (torn checkpoint); "
            f"fix: resume from an earlier checkpoint (they are found automatically)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: cannot read the manifest ({exc})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        what = "empty" if not text.strip() else "truncated or not valid JSON"
        raise ManifestError(f"{path}: manifest is {what} ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        found = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise ManifestError(
            f"{path}: foreign manifest (schema {found!r}, expected {SCHEMA!r}); "
            f"it was not written by this version of orchestrator"
        )
    recorded = manifest.get("manifest_sha256")
    if recorded != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise ManifestError(
            f"{path}: manifest content does not match its manifest_sha256 "
            f"(hand-edited or damaged); fix: restore it, or move {directory} aside"
        )
    if verify or deep:
        _verify_files(directory, manifest, deep)
    return manifest


def _verify_files(directory: Path, manifest: dict, deep: bool = False) -> None:
    old = {e["path"]: e for e in (manifest.get("files") or {}).get("entries", [])}
    now = checkpoint_files(directory)
    sizes = {rel: os.stat(directory / rel).st_size for rel in now}
    problems = [f"missing {p}" for p in sorted(old.keys() - sizes.keys())]
    problems += [f"unexpected {p}" for p in sorted(sizes.keys() - old.keys())]
    same_size = sorted(p for p in old.keys() & sizes.keys() if old[p]["size"] == sizes[p])
    problems += [
        f"changed {p} (size {old[p]['size']} -> {sizes[p]})"
        for p in sorted(old.keys() & sizes.keys())
        if old[p]["size"] != sizes[p]
    ]
    check = [
        p
        for p in same_size
        if "sha256" in old[p] and (deep or p in METADATA_FILES or old[p]["size"] <= SMALL_FILE_BYTES)
    ]
    hashes = hash_files(directory, check, use_known=False)
    problems += [f"changed {p} (content)" for p in check if hashes[p] != old[p]["sha256"]]
    if not problems:
        return
    shown = "; ".join(problems[:10]) + (f"; ... {len(problems) - 10} more" if len(problems) > 10 else "")
    raise ManifestError(
        f"{directory}: checkpoint files do not match the manifest digest "
        f"({shown or 'digest differs'}); refusing to resume from it"
    )


# ---- discovery ----------------------------------------------------------------------
