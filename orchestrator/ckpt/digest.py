"""Digests of a checkpoint's files for its manifest: sizes, or sha256 (of every file, or of dist_checkpointing's
metadata and the small files), hashed in parallel, with hashes the ranks already computed remembered. Pure Python."""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List

from orchestrator.errors import ManifestError

MANIFEST_NAME = "manifest.json"
"""The manifest's file name in a checkpoint directory (never part of its own digest)."""


DIGEST_MODES = ("size", "sha256")


METADATA_FILES = frozenset({".metadata", "metadata.json", "common.pt"})
"""dist_checkpointing's description of a checkpoint (torch DCP's ``.metadata``: every tensor's
shards, files and byte ranges; megatron's ``metadata.json`` and ``common.pt``): always hashed."""


SMALL_FILE_BYTES = 1 << 20
"""Files up to this size whose hash is recorded are re-hashed by every (cheap) verification."""


def hash_file(path: Path) -> str:
    """sha256 of a file, read in 8 MiB blocks (``hashlib.file_digest`` needs Python 3.11; 3.10 is admitted)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


KNOWN_HASHES: Dict[str, tuple] = {}
"""Absolute path -> (size, mtime_ns, sha256) of files hashed elsewhere (:func:`remember_hashes`)."""


def remember_hashes(checkpoint_dir: "str | os.PathLike", hashes: Dict[str, str]) -> None:
    """Record sha256 digests computed elsewhere (every rank hashed its share of a checkpoint's files,
    in parallel); :func:`file_digest` uses them while a file keeps its size and mtime."""
    root = Path(checkpoint_dir)
    for rel, digest in hashes.items():
        st = os.stat(root / rel)
        KNOWN_HASHES[str((root / rel).resolve())] = (st.st_size, st.st_mtime_ns, digest)


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
        known = KNOWN_HASHES.get(str((root / rel).resolve())) if use_known else None
        st = os.stat(root / rel)
        if known is not None and known[:2] == (st.st_size, st.st_mtime_ns):
            out[rel] = known[2]
        else:
            todo.append(rel)
    if todo:
        with ThreadPoolExecutor(max_workers=max(1, min(8, len(todo)))) as pool:
            out.update(zip(todo, pool.map(lambda rel: hash_file(root / rel), todo)))
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
