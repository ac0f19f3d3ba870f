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
    there; at least one new one); None when it can, when it cannot be read, or with space_check off.
    The key named is what binds: ``run.root`` when one checkpoint does not fit, else ``checkpoint.keep_last``
    (it keeps that many) or ``checkpoint.save_interval`` (the run saves fewer than keep_last); the fix names
    only settings that can make it fit (a keep_last of at least 2 that fits, fewer saves)."""
    c = cfg.checkpoint
    if not c.space_check:
        return None
    free, _, mount = disk_space(cfg.run.dir)
    already = held_bytes(cfg.run.dir)
    need = max(per_checkpoint, held * per_checkpoint - already)
    if free is None or free >= need:
        return None
    size = f"~{size_text(per_checkpoint)}"
    predicted = f"(predicted: {params:,} parameters x {per_checkpoint // max(1, params)} B)"
    room = f"{mount} has {size_text(free)} free"
    always = f"free space on {mount}, run.root=<a larger filesystem>"
    if need == per_checkpoint:  # not even one more checkpoint fits: nothing about how many are kept can help
        return (
            f"run.root={cfg.run.root}: one checkpoint of this run is {size} {predicted}, but {room}; fix: {always}, or "
            f"checkpoint.space_check=false"
        )
    fits = (free + already) // max(1, per_checkpoint)  # checkpoints the filesystem holds, counting the run's own
    every = f" and checkpoint.keep_every={c.keep_every} milestones" if c.keep_every else ""
    what = (
        f"this run keeps up to {held} checkpoints at once{every} (the newest being written while the older ones "
        f"stay), {size} each {predicted}, so {size_text(need)} more than the {size_text(already)} it holds there, but {room}"
    )
    fixes = [always]
    if c.keep_last is not None and held > c.keep_last:  # keep_last binds
        key = f"checkpoint.keep_last={c.keep_last}"
    else:  # the run saves fewer checkpoints than keep_last keeps: all of them are held
        key = f"checkpoint.save_interval={'null' if c.save_interval is None else c.save_interval}"
        fixes.append("a larger checkpoint.save_interval (fewer saves)")
    if 2 <= fits - 1 < (c.keep_last or held):
        fixes.append(f"checkpoint.keep_last={fits - 1}")
    if c.keep_every:
        fixes.append("a larger checkpoint.keep_every")
    return f"{key}: {what}; fix: {', '.join(fixes)}, or checkpoint.space_check=false"


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
