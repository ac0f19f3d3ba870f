"""Every exception a user can see, in one place.

Each message names the config key(s), the values involved and the fix, so the
entry point can print it without a traceback (``OrchestratorError`` subclasses
are caught in ``__main__`` and printed as ``error: <message>``, exit code 2).
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import Iterable


class OrchestratorError(Exception):
    """Base class: a problem the user can fix by changing the config or the command."""

    exit_code = 2


class ConfigError(OrchestratorError):
    """A config value is malformed or unknown (wrong type, unknown option)."""


class LayoutError(ConfigError):
    """The parallel layout does not satisfy a Megatron rule (divisibility, schedule, ...)."""


class ManifestError(OrchestratorError):
    """A checkpoint manifest is missing, truncated, edited, foreign or does not verify."""


class ResumeMismatchError(OrchestratorError):
    """The requested run differs from the checkpoint it would resume from."""


class RunLockedError(OrchestratorError):
    """Another live run holds the save directory."""


class DataError(OrchestratorError):
    """Input data cannot be found, read or tokenized."""


class SubmissionError(OrchestratorError):
    """Submitting or waiting for a job failed (local processes or SLURM)."""


class JobFailedError(SubmissionError):
    """A submitted job ended in failure; the message carries the failing rank's last lines."""

    exit_code = 1


def ranks_died(ranks: Iterable[int], how: str = "") -> str:
    """The line naming ranks that died without a result (``how``: e.g. ``exit by signal 9, SIGKILL``): the cause
    of a crash, which their peers' broken collectives ("Connection closed by peer") only follow."""
    return f"rank(s) {sorted(ranks)} died without a result ({f'{how}: ' if how else ''}killed? out of memory?)"


PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "Socket Timeout",
    "timed out",
)
"""What gloo / NCCL / the store say when another rank is gone (torch 2.13's own messages): such an error is a peer's
death seen from a survivor, not a cause of its own."""


RANKS_DIED = re.compile(r"rank\(s\) \[[\d, ]+\] died without a result( \([^)]*\))?")
"""A :func:`ranks_died` line (at the start of a recorded end: ``status`` names those ranks)."""


class RanksDiedError(OrchestratorError):
    """Raised by rank 0 of a job whose ranks it forked (:mod:`orchestrator.runtime.start.forked`) when a
    collective failed because some of those ranks had been killed (SIGKILL, the OOM killer); the
    message names them."""

    exit_code = 1


class NonFiniteLossError(OrchestratorError):
    """Training produced a non-finite (NaN/inf) gradient norm or loss: the job stops at that iteration
    before anything of it is saved (``training.nan_policy``); raised on every rank alike."""

    exit_code = 1


class LossSpikeError(NonFiniteLossError):
    """The lm loss or gradient norm rose above ``training.spike.factor`` x its recent median: the job stops
    at that iteration before anything of it is saved, as for a NaN (never requeued)."""


class DiskFullError(OrchestratorError):
    """A checkpoint save ran out of disk space (ENOSPC); the message names the path and the free space."""

    exit_code = 1


class CheckpointLoadError(OrchestratorError):
    """A rank could not load a checkpoint (a damaged file, tensors that do not fit the model); the message
    names the checkpoint, the rank(s) that failed and their error in one line, and how to go on."""

    exit_code = 1


class SlowLinkError(OrchestratorError):
    """``cluster.link_check.action=refuse`` and a cross-node link measured slow: the job stops before
    training, not requeued; the launcher exits 2 with the job's line (a user's fix: the interface, a host)."""


class BackendError(OrchestratorError):
    """The installed megatron-core / torch cannot run the requested device path."""


_ROLE = re.compile(r":[\w:]+:`(~?)([^`]+)`")


def plain(doc: str) -> str:
    """A docstring as a terminal shows it: reST's ``literal`` marks dropped (the text kept) and a role such as
    :mod:`~a.b.c` reduced to its target (``c`` with ``~``, as Sphinx shows it; ``a.b.c`` without)."""
    doc = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), doc)
    return doc.replace("``", "")


class OneLineArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one ``error:`` line and exit 2, like every other user
    error (argparse prints its usage block first), and whose ``--help`` is :func:`plain` text (descriptions are
    often a docstring's first line); the sub-tools' parsers (``status``, ``stop``, ...)."""

    def format_help(self) -> str:
        return plain(super().format_help())

    def error(self, message: str):  # type: ignore[override]
        sys.stderr.write(f"error: {self.prog}: {message}; fix: {self.prog} --help\n")
        sys.exit(2)
