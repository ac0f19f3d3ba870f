"""Where configs are found: the shipped ``conf/``, and a user's own config directories ahead of it.

One convention for a user's experiments (``convert from-megatron`` writes them, ``tune`` writes its
winner there, ``+experiment=NAME`` finds them):

1. ``--config-dir DIR`` (any number; the entry point turns each into a ``hydra.searchpath``
   entry) and ``hydra.searchpath=[file://DIR,...]`` — searched first, in the order given;
2. ``./conf`` in the current directory (``USER_CONF``), when it is not the shipped tree itself
   (a source checkout's top level);
3. the shipped ``conf/`` (inside the wheel, or the checkout's ``conf/``).

A user directory holds group folders like the shipped one (``experiment/NAME.yaml``,
``model/NAME.yaml`` …); a file there wins over a shipped file of the same name. Hydra itself would
search ``hydra.searchpath`` *after* its primary directory, so composition reads one merged view
instead (:func:`conf_view`: a temporary directory of symlinks, rebuilt per composition and removed
when the process that made it exits), and the closed-schema name check reads the same view.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

from orchestrator.errors import ConfigError

_PACKAGE = Path(__file__).resolve().parent.parent
USER_CONF = "conf"
"""The user's config directory, relative to the current directory."""


def conf_dir() -> Path:
    """The shipped Hydra config tree: ``<site-packages>/orchestrator/conf`` (wheel) or ``<repo>/conf``."""
    for candidate in (_PACKAGE / "conf", _PACKAGE.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"orchestrator's conf/ not found next to {_PACKAGE} (a broken install?)")


def user_conf(cwd: Optional[str] = None) -> Optional[Path]:
    """``./conf`` when it is a directory and not the shipped tree, else None."""
    path = Path(cwd or os.getcwd()) / USER_CONF
    if not path.is_dir() or path.resolve() == conf_dir().resolve():
        return None
    return path.resolve()


def _searchpath_entries(overrides: Sequence[str]) -> List[str]:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out: List[str] = []
    for line in overrides:
        if line.lstrip("+").split("=", 1)[0] != "hydra.searchpath":
            continue
        value = OverridesParser.create().parse_override(line).value()
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(
                f"{line}: hydra.searchpath takes a list of directories; "
                "fix: hydra.searchpath=[file:///path/to/conf] or --config-dir /path/to/conf"
            )
        out += value
    return out


def user_conf_dirs(overrides: Sequence[str] = ()) -> List[Path]:
    """The user's config directories, first searched first (module docstring); ConfigError for one
    that does not exist."""
    dirs: List[Path] = []
    for entry in _searchpath_entries(overrides):
        if entry.startswith("pkg://"):
            continue  # a Python package's configs: Hydra searches it after the view
        path = Path(entry[len("file://") :] if entry.startswith("file://") else entry).expanduser()
        if not path.is_dir():
            raise ConfigError(
                f"hydra.searchpath={entry}: no such directory; fix: --config-dir <a directory "
                f"holding experiment/NAME.yaml>, e.g. ./{USER_CONF} (searched without a flag)"
            )
        dirs.append(path.resolve())
    here = user_conf()
    dirs += [here] if here is not None else []
    shipped = conf_dir().resolve()
    return [d for i, d in enumerate(dirs) if d != shipped and d not in dirs[:i]]


def searchpath_override(dirs: Sequence[Path]) -> List[str]:
    """The ``hydra.searchpath=[...]`` override naming ``dirs`` (none for no dirs)."""
    if not dirs:
        return []
    quoted = ["'file://" + str(Path(d).resolve()).replace("\\", "\\\\").replace("'", "\\'") + "'" for d in dirs]
    return [f"hydra.searchpath=[{','.join(quoted)}]"]


def with_config_dir_flags(argv: Sequence[str]) -> List[str]:
    """``argv`` with each ``--config-dir DIR`` / ``--config-dir=DIR`` / ``-cd DIR`` turned into (or merged
    with) one ``hydra.searchpath`` override, so every tool composes the same way."""
    out: List[str] = []
    flagged: List[str] = []
    it = iter(argv)
    for arg in it:
        if arg in ("--config-dir", "-cd"):
            value = next(it, None)
            if value is None or value.startswith("-"):
                raise ConfigError(f"{arg}: needs a directory; fix: {arg} ./{USER_CONF}")
            flagged.append(value)
        elif arg.startswith("--config-dir="):
            flagged.append(arg.split("=", 1)[1])
        else:
            out.append(arg)
    if not flagged:
        return out
    entries = [
        f if f.startswith(("file://", "pkg://")) else "file://" + str(Path(f).expanduser().absolute()) for f in flagged
    ] + _searchpath_entries(out)
    quoted = ["'" + e.replace("\\", "\\\\").replace("'", "\\'") + "'" for e in entries]
    rest = [a for a in out if a.lstrip("+").split("=", 1)[0] != "hydra.searchpath"]
    return rest + [f"hydra.searchpath=[{','.join(quoted)}]"]


_VIEW = {"path": None, "pid": None}


def _remove_view(path: str, pid: int) -> None:
    if os.getpid() == pid:  # a forked child's exit must not remove its parent's view
        shutil.rmtree(path, ignore_errors=True)


def conf_view(dirs: Sequence[Path]) -> Path:
    """One config tree to compose: the shipped ``conf/`` with the files of ``dirs`` over it (the
    first dir wins); the shipped tree itself when ``dirs`` is empty. Symlinks in one temporary
    directory per process, rebuilt on every call (a file written since — a converted experiment, a
    tune winner — is found)."""
    shipped = conf_dir()
    if not dirs:
        return shipped
    if _VIEW["pid"] != os.getpid() or not os.path.isdir(str(_VIEW["path"])):
        _VIEW.update(path=tempfile.mkdtemp(prefix="orchestrator-conf-"), pid=os.getpid())
        atexit.register(_remove_view, _VIEW["path"], os.getpid())
    view = Path(str(_VIEW["path"]))
    for entry in view.iterdir():
        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    (view / "config.yaml").symlink_to(shipped.resolve() / "config.yaml")
    groups = sorted(d.name for d in shipped.iterdir() if d.is_dir())
    for group in groups:
        (view / group).mkdir()
        for source in [shipped, *reversed(list(dirs))]:
            for path in sorted((Path(source) / group).glob("*.yaml")):
                link = view / group / path.name
                if link.is_symlink():
                    link.unlink()
                link.symlink_to(path.resolve())
    return view


def where(group: str, dirs: Sequence[Path]) -> str:
    """Where options of ``group`` were looked for, in words."""
    if not dirs:
        return f"conf/{group}/"
    return ", ".join(str(Path(d) / group) + "/" for d in dirs) + f" or the shipped conf/{group}/"
