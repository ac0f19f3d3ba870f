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
The resume comparison, preflight and run lock live in :mod:`orchestrator.resume`.

CLI::

    python -m orchestrator.manifest show  <ckpt_dir> [--json] [--no-verify]
    python -m orchestrator.manifest check <ckpt_dir> -- <hydra overrides...>   # exit 0 ok, 1 refused
    python -m orchestrator.manifest list  <run_dir | save_dir>
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

from orchestrator.config import JobConfig, to_dict
from orchestrator.errors import ManifestError
from orchestrator.layout import ParallelLayout

SCHEMA = "orchestrator.manifest/1"
MANIFEST_NAME = "manifest.json"
CHECKPOINT_FORMAT = "torch_dist"
DIGEST_MODES = ("sha256", "size")
_ITER_RE = re.compile(r"^iter_(\d+)$")
_ENV_PREFIXES = ("NCCL_", "CUDA_", "TORCH_", "PYTORCH_", "NVTE_", "GLOO_", "UCX_", "FI_", "ORCHESTRATOR_")
_ENV_NAMES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "OMP_NUM_THREADS", "TP_SOCKET_IFNAME",
              "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_JOB_NODELIST", "SLURM_NNODES", "SLURM_NTASKS",
              "SLURM_RESTART_COUNT", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID")
_SECRET_RE = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|_KEY$", re.I)


# ---- naming -------------------------------------------------------------------
def save_dir_of(cfg: JobConfig) -> Path:
    """``<run.dir>/checkpoints``: where a run's checkpoints live."""
    return Path(cfg.run.dir) / "checkpoints"


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
    return {k: env[k] for k in sorted(env)
            if (k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES) and not _SECRET_RE.search(k)}


def _hash_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_digest(checkpoint_dir: "str | os.PathLike", mode: str = "sha256") -> dict:
    """Digest of every file under ``checkpoint_dir`` except the manifest itself.

    ``mode="sha256"`` hashes contents (threads, one per file; hashlib releases the GIL);
    ``mode="size"`` records sizes only, for checkpoints too large to hash at every resume.
    The digest is sha256 over ``relpath<TAB>size<TAB>hash`` lines in sorted path order.
    """
    if mode not in DIGEST_MODES:
        raise ManifestError(f"digest mode {mode!r} is not one of {DIGEST_MODES}")
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
    files.sort()
    sizes = [os.stat(root / rel).st_size for rel in files]
    if mode == "sha256":
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(files)))) as pool:
            hashes: List[Optional[str]] = list(pool.map(lambda rel: _hash_file(root / rel), files))
    else:
        hashes = [None] * len(files)
    lines = "".join(f"{rel}\t{size}\t{h or '-'}\n" for rel, size, h in zip(files, sizes, hashes))
    return {
        "mode": mode,
        "count": len(files),
        "bytes": sum(sizes),
        "sha256": hashlib.sha256(lines.encode()).hexdigest(),
        "entries": [{"path": rel, "size": size, **({"sha256": h} if h else {})}
                    for rel, size, h in zip(files, sizes, hashes)],
    }


def _canonical(manifest: dict) -> bytes:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


# ---- build / write / read ---------------------------------------------------------
def build_manifest(cfg: JobConfig, layout: ParallelLayout, *, iteration: int, consumed_samples: int,
                   checkpoint_dir: str, vocab_size: int, padded_vocab_size: int, tokenizer: dict, data: dict,
                   versions: Optional[dict] = None, env: Optional[dict] = None, origin: Optional[dict] = None,
                   rng_and_data_state: Optional[dict] = None, digest: str = "sha256") -> dict:
    """The manifest of the checkpoint already saved in ``checkpoint_dir`` (files are digested now).

    ``tokenizer``: identity of the tokenizer (e.g. ``{"type": "byte", "vocab_size": 257}`` or a
    path and its sha256); ``data``: identity of the data (``fingerprint`` and whatever else the
    runtime knows); ``versions``/``env`` extend what is collected here; ``origin`` says where the
    run came from (see :func:`orchestrator.resume.origin_of`); ``digest``: ``sha256`` or ``size``.
    """
    m, d, t, o = cfg.model, cfg.data, cfg.training, cfg.optimizer
    manifest = {
        "schema": SCHEMA,
        "iteration": int(iteration),
        "consumed_samples": int(consumed_samples),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": socket.gethostname(),
        "layout": layout.as_dict(),
        "model": {
            "num_layers": m.num_layers, "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads,
            "num_query_groups": m.num_query_groups or m.num_attention_heads,
            "ffn_hidden_size": m.ffn_hidden_size or 4 * m.hidden_size,
            "seq_length": m.seq_length, "max_position_embeddings": m.max_position_embeddings,
            "vocab_size": int(vocab_size), "padded_vocab_size": int(padded_vocab_size),
            "make_vocab_size_divisible_by": m.make_vocab_size_divisible_by,
            "position_embedding_type": m.position_embedding_type, "normalization": m.normalization,
            "activation": m.activation, "add_bias_linear": m.add_bias_linear,
            "untie_embeddings_and_output_weights": m.untie_embeddings_and_output_weights,
            "num_moe_experts": m.num_moe_experts,
        },
        "tokenizer": {"spec": d.tokenizer, **tokenizer},
        "data": {"kind": d.kind, "paths": list(d.paths), "weights": d.weights, "split": d.split,
                 "fingerprint": None, **data},
        "batch": {"micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
                  "num_microbatches": layout.num_microbatches},
        "checkpoint": {"format": CHECKPOINT_FORMAT, "optimizer": o.name,
                       "distributed_optimizer": o.use_distributed_optimizer, "precision": t.precision},
        "versions": {**collect_versions(), **(versions or {})},
        "env": {**collect_env(), **(env or {})},
        "origin": origin,
        "state": rng_and_data_state,
        "config": to_dict(cfg),
        "files": file_digest(checkpoint_dir, digest),
    }
    manifest = json.loads(json.dumps(manifest, default=str))  # exactly what a reader will see
    manifest["manifest_sha256"] = hashlib.sha256(_canonical(manifest)).hexdigest()
    return manifest


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(checkpoint_dir: "str | os.PathLike", manifest: dict) -> Path:
    """Write ``manifest.json`` atomically: temp file in the same dir, fsync, replace, fsync dir."""
    directory = Path(checkpoint_dir)
    if "manifest_sha256" not in manifest:
        manifest = {**manifest, "manifest_sha256": hashlib.sha256(_canonical(manifest)).hexdigest()}
    final = directory / MANIFEST_NAME
    tmp = directory / f".{MANIFEST_NAME}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(directory)
    return final


def read_manifest(checkpoint_dir: "str | os.PathLike", verify: bool = True) -> dict:
    """Load and check a manifest; ``verify`` also re-digests the checkpoint's files.

    Raises :class:`ManifestError` naming the file for a missing, truncated, invalid, foreign or
    hand-edited manifest, and naming the changed files when the checkpoint no longer matches.
    """
    directory = Path(checkpoint_dir)
    path = directory / MANIFEST_NAME
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{path}: no manifest — the save into {directory} never finished (torn checkpoint); "
                            f"fix: resume from an earlier checkpoint (they are found automatically)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: cannot read the manifest ({exc})") from None
    try:
        manifest = json.loads(text)
    except json.JSONDecodeError as exc:
        what = "empty" if not text.strip() else "truncated or not valid JSON"
        raise ManifestError(f"{path}: manifest is {what} ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("schema") != SCHEMA:
        found = manifest.get("schema") if isinstance(manifest, dict) else type(manifest).__name__
        raise ManifestError(f"{path}: foreign manifest (schema {found!r}, expected {SCHEMA!r}); "
                            f"it was not written by this version of orchestrator")
    recorded = manifest.get("manifest_sha256")
    if recorded != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise ManifestError(f"{path}: manifest content does not match its manifest_sha256 "
                            f"(hand-edited or damaged); fix: restore it, or move {directory} aside")
    if verify:
        _verify_files(directory, manifest)
    return manifest


def _verify_files(directory: Path, manifest: dict) -> None:
    recorded = manifest.get("files") or {}
    now = file_digest(directory, recorded.get("mode", "sha256"))
    if now["sha256"] == recorded.get("sha256"):
        return
    old = {e["path"]: e for e in recorded.get("entries", [])}
    new = {e["path"]: e for e in now["entries"]}
    problems = [f"missing {p}" for p in sorted(old.keys() - new.keys())]
    problems += [f"unexpected {p}" for p in sorted(new.keys() - old.keys())]
    for p in sorted(old.keys() & new.keys()):
        if old[p] != new[p]:
            sizes = f"size {old[p]['size']} -> {new[p]['size']}" if old[p]["size"] != new[p]["size"] else "content"
            problems.append(f"changed {p} ({sizes})")
    shown = "; ".join(problems[:10]) + (f"; ... {len(problems) - 10} more" if len(problems) > 10 else "")
    raise ManifestError(f"{directory}: checkpoint files do not match the manifest digest "
                        f"({shown or 'digest differs'}); refusing to resume from it")


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


def inspect_checkpoint(path: "str | os.PathLike", verify: bool = True) -> CheckpointInfo:
    """Status of one checkpoint directory (never raises for a bad manifest)."""
    path = Path(path)
    match = _ITER_RE.match(path.name)
    iteration = int(match.group(1)) if match else -1
    if not (path / MANIFEST_NAME).exists():
        return CheckpointInfo(iteration, path, "torn", f"{path}: no {MANIFEST_NAME} (save did not finish)")
    try:
        manifest = read_manifest(path, verify=verify)
    except ManifestError as exc:
        return CheckpointInfo(iteration, path, "corrupt", str(exc))
    if match and manifest.get("iteration") != iteration:
        return CheckpointInfo(iteration, path, "corrupt",
                              f"{path / MANIFEST_NAME}: records iteration {manifest.get('iteration')}, "
                              f"directory says {iteration}")
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
    return sorted((p for p in root.iterdir() if p.is_dir() and _ITER_RE.match(p.name)),
                  key=lambda p: int(_ITER_RE.match(p.name).group(1)))


def list_checkpoints(save_dir: "str | os.PathLike", verify: bool = True) -> List[CheckpointInfo]:
    """Every ``iter_*`` directory of ``save_dir``, oldest first, with its status."""
    return [inspect_checkpoint(p, verify) for p in _iter_dirs(save_dir)]


def latest_complete(save_dir: "str | os.PathLike", warn: Optional[Callable[[str], None]] = None, *,
                    verify: bool = True, skip_corrupt: bool = True) -> Optional[CheckpointInfo]:
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
            raise ManifestError(f"{info.reason}\nfix: restore {path}, or move it aside "
                                f"(mv {path} {path}.bad) to resume from the previous complete checkpoint")
        warn(f"skipping {info.status} checkpoint {path}: {info.reason}")
    return None


def _default_warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


_RESUME_NAMES = ("preflight", "compare", "blocking", "format_mismatch_table", "origin_of", "Mismatch", "RunLock")


def __getattr__(name: str):
    """``manifest.preflight`` etc. are :mod:`orchestrator.resume`'s (imported lazily: no cycle)."""
    if name in _RESUME_NAMES:
        from orchestrator import resume

        return getattr(resume, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- CLI --------------------------------------------------------------------------------
def _summary(manifest: dict) -> str:
    lay, mod, files = manifest["layout"], manifest["model"], manifest["files"]
    vpp = lay.get("virtual_pipeline_model_parallel_size")
    return "\n".join([
        f"iteration {manifest['iteration']}  consumed_samples {manifest['consumed_samples']}  "
        f"created {manifest.get('created')} on {manifest.get('host')}",
        f"layout: world {lay['world_size']} = TP {lay['tensor_model_parallel_size']} x PP "
        f"{lay['pipeline_model_parallel_size']} x CP {lay['context_parallel_size']} x DP "
        f"{lay['data_parallel_size']}; VPP {vpp}; EP {lay['expert_model_parallel_size']}; "
        f"SP {lay['sequence_parallel']}; layers/stage {lay['layers_per_stage']}",
        f"batch: MBS {lay['micro_batch_size']} GBS {lay['global_batch_size']} "
        f"num_microbatches {lay['num_microbatches']}",
        f"model: {mod['num_layers']} layers, hidden {mod['hidden_size']}, heads {mod['num_attention_heads']}, "
        f"seq {mod['seq_length']}, vocab {mod['vocab_size']} (padded {mod['padded_vocab_size']})",
        f"tokenizer: {json.dumps(manifest['tokenizer'], sort_keys=True)}",
        f"data: {json.dumps({k: v for k, v in manifest['data'].items()}, sort_keys=True)}",
        f"checkpoint: {json.dumps(manifest['checkpoint'], sort_keys=True)}",
        f"versions: {json.dumps(manifest['versions'], sort_keys=True)}",
        f"origin: {json.dumps(manifest.get('origin'))}",
        f"files: {files['count']} files, {files['bytes']} bytes, {files['mode']} digest {files['sha256'][:16]}",
    ])


def compose_config(overrides: List[str], config_dir: Optional[str] = None) -> JobConfig:
    """Compose ``conf/`` with Hydra's compose API into a JobConfig (``run.dir`` must be overridden)."""
    from hydra import compose, initialize_config_dir
    from orchestrator.config import register_configs, to_job_config

    config_dir = config_dir or str(Path(__file__).resolve().parent.parent / "conf")
    register_configs()
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return to_job_config(compose("config", overrides=list(overrides)))


def main(argv: Optional[List[str]] = None) -> int:
    import argparse

    from orchestrator.errors import OrchestratorError
    from orchestrator.layout import layout_from_config
    from orchestrator.resume import blocking, compare, format_mismatch_table

    parser = argparse.ArgumentParser(prog="python -m orchestrator.manifest", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_show = sub.add_parser("show", help="print a checkpoint's manifest")
    p_show.add_argument("ckpt_dir")
    p_show.add_argument("--json", action="store_true", help="the whole manifest as JSON")
    p_show.add_argument("--no-verify", action="store_true", help="skip re-digesting the checkpoint files")
    p_check = sub.add_parser("check", help="compare a config (Hydra overrides) with a checkpoint; exit 1 if refused")
    p_check.add_argument("ckpt_dir")
    p_check.add_argument("overrides", nargs="*", help="Hydra overrides, after --")
    p_check.add_argument("--config-dir", default=None, help="Hydra config dir (default: the repo's conf/)")
    p_list = sub.add_parser("list", help="list a run's checkpoints with iteration, layout and status")
    p_list.add_argument("run_dir")
    p_list.add_argument("--no-verify", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "show":
            directory = Path(args.ckpt_dir)
            directory = directory.parent if directory.name == MANIFEST_NAME else directory
            manifest = read_manifest(directory, verify=not args.no_verify)
            print(json.dumps(manifest, indent=1, sort_keys=True) if args.json else
                  f"{directory / MANIFEST_NAME}\n{_summary(manifest)}")
            return 0
        if args.cmd == "check":
            directory = Path(args.ckpt_dir)
            manifest = read_manifest(directory)
            overrides = list(args.overrides)
            if not any(o.split("=", 1)[0].lstrip("+~") == "run.dir" for o in overrides):
                overrides.append(f"run.dir={directory.resolve().parent.parent}")
            cfg = compose_config(overrides, args.config_dir)
            layout = layout_from_config(cfg)
            mismatches = compare(manifest, cfg, layout, data_fingerprint=None, tokenizer=None)
            print(format_mismatch_table(mismatches) if mismatches else
                  f"{directory}: the config matches the checkpoint (iteration {manifest['iteration']})")
            refused = blocking(mismatches, cfg.checkpoint.allow_reshard)
            if refused:
                print(f"resume refused: {len(refused)} difference(s) need checkpoint.allow_reshard=true"
                      if all(x.reshardable for x in refused) else
                      f"resume refused: {len(refused)} difference(s) the checkpoint cannot carry")
            return 1 if refused else 0
        root = Path(args.run_dir)
        save_dir = root / "checkpoints" if (root / "checkpoints").is_dir() else root
        infos = list_checkpoints(save_dir, verify=not args.no_verify)
        if not infos:
            print(f"{save_dir}: no checkpoints")
        for info in infos:
            lay = (info.manifest or {}).get("layout") or {}
            shape = (f"TP{lay['tensor_model_parallel_size']} PP{lay['pipeline_model_parallel_size']} "
                     f"VPP{lay.get('virtual_pipeline_model_parallel_size') or '-'} CP{lay['context_parallel_size']} "
                     f"EP{lay['expert_model_parallel_size']} DP{lay['data_parallel_size']}") if lay else "-"
            extra = f"consumed {info.manifest['consumed_samples']}" if info.manifest else info.reason
            print(f"{info.iteration:>9}  {info.status:<8}  {shape:<28}  {info.path}  {extra}")
        return 0
    except OrchestratorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy, so classes are shared with resume.py.
    from orchestrator.manifest import main as _main

    sys.exit(_main())
