"""The entry's command-line flags (Hydra's own and ours) read once, before anything is composed.

Hydra's parser (argparse) takes flags only before the overrides: ``-m`` or ``--cfg job`` after an override,
``--info`` followed by an override (read as ``--info``'s value) or ``--cfg jobx`` each ended in argparse's
usage block and ``__main__.py: error: ...``. :func:`read_flags` accepts the flags anywhere, checks each one's
value, and returns the command line in the order Hydra reads (flags with their values first, then the
overrides); anything else is a :class:`~orchestrator.errors.ConfigError` of one line (the entry's ``error:``
line, exit 2). No Hydra import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from orchestrator.errors import ConfigError

HYDRA_FLAGS = {"--cfg", "-c", "--info", "-i", "--shell-completion", "-sc", "--hydra-help"}
"""Hydra's own inspection flags, handed to Hydra (they print and run nothing)."""
WITH_CFG = {"--resolve", "--package", "-p"}
"""Hydra flags that only modify ``--cfg``."""
RUN_FLAGS = {"-m", "--multirun", "-r", "--run"}
"""Flags that choose how the overrides run: a sweep (``-m``) or one run (``-r``, the default)."""
MODES = {"-m", "--multirun", "-r", "--run", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc"}
"""Hydra's modes, of which a command line gives one (hydra/_internal/utils.py ``_run_hydra``)."""
VALUES: Dict[str, Tuple[bool, Optional[Tuple[str, ...]]]] = {
    "--cfg": (True, ("job", "hydra", "all")),
    "-c": (True, ("job", "hydra", "all")),
    "--package": (True, None),
    "-p": (True, None),
    "--info": (False, ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")),
    "-i": (False, ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")),
}
"""Flags that take a value (hydra/_internal/utils.py ``get_args_parser``): (required, the choices or None).
``--info``'s value is optional: a word after it that is not one of its choices is an override; a word with
``=`` is always an override."""
FIX = "fix: python -m orchestrator --help (overrides are KEY=VALUE; -m sweeps)"


@dataclass
class Flags:
    """A command line split into its flags (each with its value, if it takes one) and its overrides."""

    flags: List[str] = field(default_factory=list)
    """Flag names in the order given (``--cfg``, ``-m``, ...), without their values."""
    values: Dict[str, str] = field(default_factory=dict)
    """The value given to a flag that takes one (``--cfg``: ``job``)."""
    overrides: List[str] = field(default_factory=list)

    def hydra_argv(self) -> List[str]:
        """The flags with their values, then the overrides: the order Hydra's parser accepts."""
        out: List[str] = []
        for flag in self.flags:
            out += [flag, self.values[flag]] if flag in self.values else [flag]
        return out + self.overrides


def read_flags(argv: List[str]) -> Flags:
    """Split ``argv`` (no ``--config-dir``, no ``--help``) into :class:`Flags`.

    Raises :class:`ConfigError` (one line naming the flag, what was given and the fix) for an unknown flag, a
    flag given twice, a missing or unknown value, two of Hydra's modes (``-m``, ``--cfg``, ``--info`` ...), or ``--resolve`` / ``--package`` without ``--cfg``.
    """
    out, i = Flags(), 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("-"):
            out.overrides.append(arg)
            continue
        if arg not in HYDRA_FLAGS | WITH_CFG | RUN_FLAGS:
            raise ConfigError(f"{arg}: unknown option; {FIX}")
        if arg in out.flags:
            raise ConfigError(f"{arg}: given more than once; fix: give it once")
        out.flags.append(arg)
        if arg in VALUES:
            i = _value(arg, argv, i, out)
    modes = [f for f in out.flags if f in MODES]
    if len(modes) > 1:
        raise ConfigError(f"{' and '.join(modes)}: one at a time (Hydra runs one mode); fix: leave {modes[-1]} out")
    if any(f in WITH_CFG for f in out.flags) and not {"--cfg", "-c"} & set(out.flags):
        given = next(f for f in out.flags if f in WITH_CFG)
        raise ConfigError(f"{given}: only with --cfg; fix: add --cfg job (or hydra, all), or leave {given} out")
    return out


def _value(flag: str, argv: List[str], i: int, out: Flags) -> int:
    """Read ``flag``'s value at ``argv[i]`` into ``out``; the index after it."""
    required, choices = VALUES[flag]
    word = argv[i] if i < len(argv) else None
    if word is not None and not word.startswith("-") and "=" not in word and (required or word in (choices or ())):
        if choices and word not in choices:
            raise ConfigError(f"{flag} {word}: not one of {', '.join(choices)}; fix: {flag} {choices[0]}")
        out.values[flag] = word
        return i + 1
    if required:
        example = choices[0] if choices else "model"
        raise ConfigError(f"{flag}: needs a value; fix: {flag} {example} (before or after the overrides)")
    return i
