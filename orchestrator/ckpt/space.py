"""Free space for checkpoints: what a filesystem has, what a run already holds, a refusal in one line.

The launcher refuses a run (before anything is queued) whose run directory's filesystem cannot hold
the checkpoints it will keep at once (:func:`orchestrator.plan.ckpt_size.held_at_peak` x the predicted
size, less what the run already holds there); ``checkpoint.space_check=false`` opts out. The job
checks again before each save (:mod:`orchestrator.runtime.training.saving`). No torch import.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional, Tuple

from orchestrator.ckpt.rundir import CHECKPOINTS_DIR
from orchestrator.errors import ConfigError


def disk_space(path: "str | os.PathLike") -> Tuple[Optional[int], Optional[int], str]:
    """(free bytes, total bytes, mount point) of the filesystem holding ``path`` (or its nearest
    existing parent); (None, None, path) when it cannot be read."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        usage = shutil.disk_usage(p)
    except OSError:
        return None, None, str(p)
    mount = p.resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return usage.free, usage.total, str(mount)


def size_text(n: "Optional[float]") -> str:
    """Bytes as people read them: 512 B, 10.1 MiB, 1.2 TiB."""
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n}"


def held_bytes(run_dir: "str | os.PathLike") -> int:
    """Bytes of the complete (manifest-holding) ``iter_*`` checkpoints already in ``<run_dir>/checkpoints``."""
    total = 0
    base = Path(run_dir) / CHECKPOINTS_DIR
    for ckpt in base.iterdir() if base.is_dir() else ():
        if ckpt.name.startswith("iter_") and (ckpt / "manifest.json").is_file():
            total += sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    return total


def space_refusal(cfg, per_checkpoint: int, held: int, params: int) -> Optional[str]:
    """The one-line refusal (``<key>=<value>: <what>; fix: <how>``) when the run directory's filesystem
    cannot hold ``held`` checkpoints of ``per_checkpoint`` bytes (less what the run already holds
    there; at least one new one); None when it can, when it cannot be read, or with space_check off."""
    c = cfg.checkpoint
    if not c.space_check:
        return None
    free, _, mount = disk_space(cfg.run.dir)
    already = held_bytes(cfg.run.dir)
    need = max(per_checkpoint, held * per_checkpoint - already)
    if free is None or free >= need:
        return None
    key = f"checkpoint.keep_last={'null' if c.keep_last is None else c.keep_last}"
    every = f" and checkpoint.keep_every={c.keep_every}" if c.keep_every else ""
    return (
        f"{key}: this run keeps up to {held} checkpoints at once{every} (the newest being written while "
        f"the older ones stay), ~{size_text(per_checkpoint)} each (predicted: {params:,} parameters x "
        f"{per_checkpoint // max(1, params)} B), so {size_text(need)} more than the {size_text(already)} "
        f"it holds there, but {mount} has {size_text(free)} free; fix: free space on {mount}, run.root=<a larger "
        f"filesystem>, a lower checkpoint.keep_last{' or a larger checkpoint.keep_every' if c.keep_every else ''}, or "
        f"checkpoint.space_check=false"
    )


def check_writable(root: str, run_dir: str) -> None:
    """ConfigError (one line naming ``run.root=root``) when the run directory ``run_dir`` cannot be created or
    written, with the OS's reason for the path tried: the first directory the run would create, made and removed at
    once (``/proc``, a read-only mount or a directory of another user refuse it), or a file created unnamed in an
    existing run directory (root passes ``os.access`` everywhere). The launcher calls it before the plan lines,
    data or anything queued; nothing is left behind."""
    path = Path(run_dir).absolute()
    existing, first = path, None
    while not existing.exists() and existing != existing.parent:
        if existing.is_symlink():  # dangling: a scratch file system not mounted here, say
            raise ConfigError(
                f"run.root={root}: {existing} is a symbolic link to {os.readlink(existing)}, which does not "
                "exist here; fix: mount or create it, or set run.root to a directory you can write"
            )
        existing, first = existing.parent, existing
    try:
        if first is None:
            with tempfile.TemporaryFile(dir=path):
                pass
        else:
            os.mkdir(first)
            try:
                os.rmdir(first)
            except OSError:  # another run filled it meanwhile: it is theirs
                pass
    except FileExistsError:  # created meanwhile (another run): writable
        return
    except OSError as exc:
        tried = f"create the directory {first}" if first is not None else f"write in the run directory {path}"
        raise ConfigError(
            f"run.root={root}: cannot {tried} ({exc.strerror or exc}); "
            f"fix: set run.root to a directory you can write, e.g. run.root=runs"
        ) from None
