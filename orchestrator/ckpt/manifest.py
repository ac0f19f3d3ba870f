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
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Callable, Dict, List, Optional

from orchestrator.ckpt.rundir import CHECKPOINTS_DIR
from orchestrator.config.layout import ParallelLayout
from orchestrator.config.megatron_fields import config_hash
from orchestrator.config.schema import JobConfig, to_dict
from orchestrator.errors import ManifestError
from orchestrator.io import write_atomic

SCHEMA = "orchestrator.manifest/1"
MANIFEST_NAME = "manifest.json"
CHECKPOINT_FORMAT = "torch_dist"
DIGEST_MODES = ("size", "sha256")
METADATA_FILES = frozenset({".metadata", "metadata.json", "common.pt"})
"""dist_checkpointing's description of a checkpoint (torch DCP's ``.metadata``: every tensor's
shards, files and byte ranges; megatron's ``metadata.json`` and ``common.pt``): always hashed."""
SMALL_FILE_BYTES = 1 << 20
"""Files up to this size whose hash is recorded are re-hashed by every (cheap) verification."""
_ITER_RE = re.compile(r"^iter_(\d+)$")
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


def _hash_file(path: Path) -> str:
    """sha256 of a file, read in 8 MiB blocks (``hashlib.file_digest`` needs Python 3.11; 3.10 is admitted)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


_KNOWN_HASHES: Dict[str, tuple] = {}
"""Absolute path -> (size, mtime_ns, sha256) of files hashed elsewhere (:func:`remember_hashes`)."""


def remember_hashes(checkpoint_dir: "str | os.PathLike", hashes: Dict[str, str]) -> None:
    """Record sha256 digests computed elsewhere (every rank hashed its share of a checkpoint's files,
    in parallel); :func:`file_digest` uses them while a file keeps its size and mtime."""
    root = Path(checkpoint_dir)
    for rel, digest in hashes.items():
        st = os.stat(root / rel)
        _KNOWN_HASHES[str((root / rel).resolve())] = (st.st_size, st.st_mtime_ns, digest)


def checkpoint_files(checkpoint_dir: "str | os.PathLike") -> List[str]:
    """Every file under ``checkpoint_dir`` except the manifest (and its temporary files), relative, sorted."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        raise ManifestError(f"{root}: checkpoint directory does not exist; nothing to digest")
    files: List[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if rel == MANIFEST_NAME or rel.startswith(f".{MANIFEST_NAME}."):
                continue
            files.append(rel)
    return sorted(files)


def hash_files(checkpoint_dir: "str | os.PathLike", rels: List[str], use_known: bool = True) -> Dict[str, str]:
    """sha256 of each of ``rels`` (threads; hashlib releases the GIL), from :func:`remember_hashes`
    where the file is unchanged and ``use_known``."""
    root = Path(checkpoint_dir)
    out: Dict[str, str] = {}
    todo: List[str] = []
    for rel in rels:
        known = _KNOWN_HASHES.get(str((root / rel).resolve())) if use_known else None
        st = os.stat(root / rel)
        if known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
            out[rel] = known[2]
        else:
            todo.append(rel)
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(todo)))) as pool:
            out.update(zip(todo, pool.map(lambda rel: _hash_file(root / rel), todo)))
    return out


def file_digest(checkpoint_dir: "str | os.PathLike", mode: str = "size") -> dict:
    """Sizes of every file under ``checkpoint_dir`` (the manifest excluded) and sha256 digests.

    ``mode="size"`` (the default, ``checkpoint.digest=size``) hashes only dist_checkpointing's
    metadata (:data:`METADATA_FILES`, kilobytes to megabytes): cheap at any checkpoint size, and
    still catches a missing, extra, truncated or re-written-with-another-layout checkpoint.
    ``mode="sha256"`` hashes every file (opt-in; the runtime has every rank hash its share in
    parallel first, see :func:`remember_hashes`), for ``manifest check --deep``.
    The ``sha256`` field is over ``relpath<TAB>size<TAB>hash`` lines in sorted path order.
    """
    if mode not in DIGEST_MODES:
        raise ManifestError(f"digest mode {mode!r} is not one of {DIGEST_MODES}")
    root = Path(checkpoint_dir)
    files = checkpoint_files(root)
    sizes = [os.stat(root / rel).st_size for rel in files]
    hashed = hash_files(root, [rel for rel in files if mode == "sha256" or rel in METADATA_FILES])
    hashes = [hashed.get(rel) for rel in files]
    lines = "".join(f"{rel}\t{size}\t{h or '-'}\n" for rel, size, h in zip(files, sizes, hashes))
    return {
        "mode": mode,
        "count": len(files),
        "bytes": sum(sizes),
        "sha256": hashlib.sha256(lines.encode()).hexdigest(),
        "entries": [
            {"path": rel, "size": size, **({"sha256": h} if h else {})} for rel, size, h in zip(files, sizes, hashes)
        ],
    }


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


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
    :func:`orchestrator.ckpt.history.history_for_manifest`); ``save``: how the save went (``async``,
    ``started``, ``completed``, the slowest rank's ``write_s`` and ``blocking_s``; bytes are ``files.bytes``);
    ``megatron``: the megatron config the job built (``megatron_config.json``), recorded whole with its sha256;
    ``link_check``: a multi-node job's measured cross-node links (runtime.faults.links), recorded when given.
    """
    if history is None:
        from orchestrator.ckpt.history import history_for_manifest

        history = history_for_manifest(cfg.run.dir, iteration, cfg.training.train_iters)
    m, d, t, o = cfg.model, cfg.data, cfg.training, cfg.optimizer
    manifest = {
        "schema": SCHEMA,
        "iteration": int(iteration),
        "consumed_samples": int(consumed_samples),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "hosts": list(hosts) if hosts is not None else None,
        "layout": layout.as_dict(),
        "model": {
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
        },
        "tokenizer": {"spec": d.tokenizer, **tokenizer},
        "data": {
            "kind": d.kind,
            "paths": list(d.paths),
            "weights": d.weights,
            "split": d.split,
            "fingerprint": None,
            **data,
        },
        "batch": {
            "micro_batch_size": t.micro_batch_size,
            "global_batch_size": t.global_batch_size,
            "num_microbatches": layout.num_microbatches,
        },
        "checkpoint": {
            "format": CHECKPOINT_FORMAT,
            "optimizer": o.name,
            "distributed_optimizer": o.use_distributed_optimizer,
            "precision": t.precision,
        },
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

    Raises :class:`ManifestError` naming the file for a missing, truncated, invalid, foreign or
    hand-edited manifest, and naming the changed files when the checkpoint no longer matches.
    """
    directory = Path(checkpoint_dir)
    path = directory / MANIFEST_NAME
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
@dataclass
class CheckpointInfo:
    """One ``iter_*`` directory: ``status`` is ``complete``, ``torn`` (no manifest) or ``corrupt``."""

    iteration: int
    path: Path
    status: str
    reason: Optional[str] = None
    manifest: Optional[dict] = field(default=None, repr=False)
    mismatches: list = field(default_factory=list, repr=False)
    """Filled by :func:`orchestrator.resume.preflight`: differences accepted for this resume."""


def inspect_checkpoint(path: "str | os.PathLike", verify: bool = True, deep: bool = False) -> CheckpointInfo:
    """Status of one checkpoint directory (never raises for a bad manifest)."""
    path = Path(path)
    match = _ITER_RE.match(path.name)
    iteration = int(match.group(1)) if match else -1
    if not (path / MANIFEST_NAME).exists():
        return CheckpointInfo(iteration, path, "torn", f"{path}: no {MANIFEST_NAME} (save did not finish)")
    try:
        manifest = read_manifest(path, verify=verify, deep=deep)
    except ManifestError as exc:
        return CheckpointInfo(iteration, path, "corrupt", str(exc))
    if match and manifest.get("iteration") != iteration:
        return CheckpointInfo(
            iteration,
            path,
            "corrupt",
            f"{path / MANIFEST_NAME}: records iteration {manifest.get('iteration')}, directory says {iteration}",
        )
    return CheckpointInfo(iteration, path, "complete", None, manifest)


def set_aside(path: "str | os.PathLike", tag: str = "torn") -> Path:
    """Rename a checkpoint directory to ``<name>.<tag>.<timestamp>`` (no longer listed; not deleted)."""
    path = Path(path)
    target = path.with_name(f"{path.name}.{tag}.{time.strftime('%Y%m%d_%H%M%S')}")
    os.rename(path, target)
    return target


def _iter_dirs(save_dir: "str | os.PathLike") -> List[Path]:
    root = Path(save_dir)
    if not root.is_dir():
        return []
    return sorted(
        (p for p in root.iterdir() if p.is_dir() and _ITER_RE.match(p.name)),
        key=lambda p: int(_ITER_RE.match(p.name).group(1)),
    )


def list_checkpoints(save_dir: "str | os.PathLike", verify: bool = True, deep: bool = False) -> List[CheckpointInfo]:
    """Every ``iter_*`` directory of ``save_dir``, oldest first, with its status."""
    return [inspect_checkpoint(p, verify, deep) for p in _iter_dirs(save_dir)]


def latest_complete(
    save_dir: "str | os.PathLike",
    warn: Optional[Callable[[str], None]] = None,
    *,
    verify: bool = True,
    skip_corrupt: bool = True,
) -> Optional[CheckpointInfo]:
    """The newest checkpoint whose manifest exists and verifies; ``None`` when there is none.

    Newer torn saves are skipped with a warning naming them (nothing is deleted). A newer
    *corrupt* checkpoint (manifest present but failing) is skipped with a warning too, or
    raises :class:`ManifestError` with ``skip_corrupt=False``.
    """
    warn = warn or _default_warn
    for path in reversed(_iter_dirs(save_dir)):
        info = inspect_checkpoint(path, verify)
        if info.status == "complete":
            return info
        if info.status == "corrupt" and not skip_corrupt:
            raise ManifestError(
                f"{info.reason}\nfix: restore {path}, or move it aside "
                f"(mv {path} {path}.bad) to resume from the previous complete checkpoint"
            )
        warn(f"skipping {info.status} checkpoint {path}: {info.reason}")
    return None


def _default_warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)
