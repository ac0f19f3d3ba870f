"""The catalogue of a run's checkpoints: which ``iter_*`` directories are complete (a verified manifest), torn
or corrupt, the newest complete one to resume from, and setting a damaged one aside. Pure Python."""

from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

from orchestrator.ckpt.manifest import MANIFEST_NAME, read_manifest
from orchestrator.errors import ManifestError

ITER_RE = re.compile(r"^iter_(\d+)$")
"""A checkpoint directory's name: ``iter_`` and the iteration, zero-padded to 7 digits."""


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
    match = ITER_RE.match(path.name)
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


def iter_dirs(save_dir: "str | os.PathLike") -> List[Path]:
    root = Path(save_dir)
    if not root.is_dir():
        return []
    return sorted(
        (p for p in root.iterdir() if p.is_dir() and ITER_RE.match(p.name)),
        key=lambda p: int(ITER_RE.match(p.name).group(1)),
    )


def list_checkpoints(save_dir: "str | os.PathLike", verify: bool = True, deep: bool = False) -> List[CheckpointInfo]:
    """Every ``iter_*`` directory of ``save_dir``, oldest first, with its status."""
    return [inspect_checkpoint(p, verify, deep) for p in iter_dirs(save_dir)]


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
    warn = warn or default_warn
    for path in reversed(iter_dirs(save_dir)):
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


def default_warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)
