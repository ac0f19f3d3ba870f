"""What a signal to a launcher that waits on a job does: one rule, local and SLURM.

=========================  ==========================================  =============================================
signal to the launcher     local job (and a hosts job)                 SLURM job
=========================  ==========================================  =============================================
SIGINT (Ctrl-C), SIGTERM   the ranks run on to the next logged          detach: one line (job id, how to follow it
                           iteration (``training.log_interval``; they    with ``status``, how to stop it); the job
                           agree on it within about 10 s), save it       runs on, untouched (never scancel); exit 0
                           (unless it is saved already) and exit; one
                           line names the checkpoint and the command
                           that resumes; exit 130 / 143
SIGHUP (terminal gone)     as SIGTERM; exit 129                          detach, as above; exit 0
a second signal while      stop at once (SIGKILL), unsaved, said so;     (the first one detached already)
the ranks stop             exit 128 + its number
=========================  ==========================================  =============================================

A local job, and a ``cluster=hosts`` job (whose SSH sessions end with their launcher: :data:`HELD`), is asked
to stop through ``<run.dir>/stop.json`` (:mod:`orchestrator.ckpt.stop`), the same
request ``orchestrator stop`` writes: the job's rank 0 polls it and asks the ranks' one graceful stop
(:mod:`orchestrator.runtime.faults.preempt`, the path of the launcher watch and of SLURM's time limit).
The handlers are installed by :func:`orchestrator.submit.wait.wait` (and a hosts job's
:meth:`orchestrator.submit.sessions.Sessions.wait`) for the duration of the wait (main thread only); outside a wait, the entry turns these signals into ``KeyboardInterrupt`` (nothing is
running yet, or warm ranks that stop with their launcher); the launcher then exits 128 + the signal with one
``interrupted (SIGNAME): ...`` line (:func:`pending_signal`). No torch import.
"""

from __future__ import annotations

import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, Optional

from orchestrator.ckpt import stop
from orchestrator.config.schema import JobConfig

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What a terminal, ``kill`` or a closed SSH session sends a launcher."""
HELD = ("local", "hosts")
"""Cluster kinds whose job ends with its waiting launcher: a signal to it stops the job gracefully (a SLURM job
is left running: detached)."""
STOPPED_BY_REQUEST_EXIT = 128 + signal.SIGTERM
"""Exit status of a launcher whose job ``orchestrator stop`` ended: as if it had been sent SIGTERM."""


_PENDING: Optional[int] = None
"""A stop signal that reached the launcher before any job was waited on (:func:`interrupt`)."""
_PENDING_EXC: Optional[BaseException] = None
"""What a handler other than :func:`interrupt` raised for it (a SLURM sweep's detach: :func:`remember`)."""


def interrupt(signum: int, frame: Any = None) -> None:
    """The launcher's handler of SIGINT/SIGTERM/SIGHUP before a job is waited on: like Ctrl-C, remembered.
    A KeyboardInterrupt raised where Python ignores exceptions (the at-fork hooks that run while the
    tokenizer's worker processes start: "Exception ignored in ...") is lost; :func:`raise_if_interrupted`,
    called before anything is submitted, raises it again."""
    global _PENDING
    _PENDING = signum
    raise remember(KeyboardInterrupt())


def remember(exc: BaseException) -> BaseException:
    """Keep ``exc``, which a signal handler is about to raise, for :func:`raise_if_interrupted` (it may be lost
    as :func:`interrupt`'s KeyboardInterrupt may); returns it. Python reports a lost one as "Exception ignored
    in ..." with a traceback on stderr (a SIGHUP that landed in a weakref callback while a sweep waited);
    :func:`quiet_if_remembered` keeps that report off the terminal, since the exception is raised again."""
    global _PENDING_EXC
    _PENDING_EXC = exc
    if sys.unraisablehook is not quiet_if_remembered:
        _HOOKED.append(sys.unraisablehook)
        sys.unraisablehook = quiet_if_remembered
    return exc


_HOOKED: list = []
"""The ``sys.unraisablehook`` that :func:`quiet_if_remembered` replaced (it hands it everything else)."""


def quiet_if_remembered(unraisable: Any) -> None:
    """``sys.unraisablehook`` while a signal's exception is remembered: drops the report of that exception
    (raised where Python ignores exceptions; :func:`raise_if_interrupted` raises it again), and hands any other
    to the hook it replaced."""
    if unraisable.exc_value is not None and unraisable.exc_value is _PENDING_EXC:
        return
    (_HOOKED[-1] if _HOOKED else sys.__unraisablehook__)(unraisable)


def pending_signal() -> int:
    """The stop signal :func:`interrupt` took before any job was waited on (SIGINT when none: a plain
    KeyboardInterrupt); the launcher exits 128 + it, as after a job's stop."""
    return _PENDING or signal.SIGINT


def raise_if_interrupted() -> None:
    """Raise again what a stop signal raised earlier (:func:`interrupt`: KeyboardInterrupt; :func:`remember`)."""
    if _PENDING_EXC is not None:
        raise _PENDING_EXC
    if _PENDING is not None:
        raise KeyboardInterrupt


class Detached(KeyboardInterrupt):
    """The launcher leaves its SLURM job running and exits 0 after :attr:`line` (a signal told it to go)."""

    def __init__(self, line: str, signum: int, job_id: str):
        super().__init__(line)
        self.line, self.signum, self.job_id, self.code = line, signum, job_id, 0


class JobStopped(KeyboardInterrupt):
    """The waited job stopped on purpose (a signal to the launcher, ``orchestrator stop``): :attr:`line`
    says where it can resume from; :attr:`code` is the launcher's exit status (128 + the signal)."""

    def __init__(self, line: str, code: int):
        super().__init__(line)
        self.line, self.code = line, code


def tell(line: str) -> None:
    """Print ``line`` on stderr; nothing when the terminal is gone (a SIGHUP: writes fail with EIO)."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def resume_command() -> str:
    """The command that started this launcher, as a user retypes it."""
    return "python -m orchestrator " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "python -m orchestrator"


def checkpoint_words(cfg: JobConfig) -> str:
    """``run ... to resume from <checkpoint> (iteration N)``, or that a rerun starts from scratch."""
    try:
        from orchestrator.ckpt.catalogue import latest_complete
        from orchestrator.ckpt.manifest import save_dir_of

        latest = latest_complete(save_dir_of(cfg), lambda _: None, verify=False)
    except Exception:  # noqa: BLE001 - a torn directory must not turn a stop into a traceback
        latest = None
    if latest is None:
        return f"no checkpoint in {cfg.run.dir}, so `{resume_command()}` starts from scratch"
    return f"resume from {latest.path} (iteration {latest.iteration}) with: {resume_command()}"


def detach_line(cfg: JobConfig, job_id: str, signum: int) -> str:
    """The one line of a launcher that leaves SLURM job ``job_id`` running."""
    root, name = cfg.run.root, cfg.run.name
    named = Path(cfg.run.dir) == Path(root) / name  # a sweep point's run dir is not: name it by its path
    which = f"{name} --root {root}" if named else str(cfg.run.dir)
    return (
        f"detached ({signal.Signals(signum).name}): SLURM job {job_id} runs on, untouched; follow it with "
        f"`python -m orchestrator status {root}` (logs: {cfg.run.dir}/submitit/); stop it with "
        f"`python -m orchestrator stop {which}` (saves first; --now: at once)"
    )


class WaitSignals:
    """The rule above, for one :func:`~orchestrator.submit.wait.wait` on ``job_id``: a context manager
    that installs the handlers (main thread only; not with ``install=False``: the caller's stay) and puts
    the previous ones back."""

    def __init__(self, cfg: JobConfig, job_id: str, install: bool = True):
        self.cfg, self.job_id, self.install = cfg, str(job_id), install
        self.held = cfg.cluster.kind in HELD
        self.signum: Optional[int] = None
        """The first signal (a held job): the ranks were asked to stop."""
        self.again: Optional[int] = None
        """A second signal (a held job): the job was ended at once."""
        self._previous: Dict[int, Any] = {}

    def __enter__(self) -> "WaitSignals":
        if self.install and threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: Any = None) -> None:
        if not self.held:
            raise Detached(detach_line(self.cfg, self.job_id, signum), signum, self.job_id)
        if self.signum is not None:
            self.again = signum
            raise KeyboardInterrupt  # the wait ends the job at once (SIGKILL), unsaved
        self.signum = signum
        name = signal.Signals(signum).name
        stop.request(self.cfg.run.dir, self.job_id, by=f"{name} to the launcher", cause="interrupted")
        tell(
            f"[orchestrator] {name}: the ranks agree on a logged iteration (within about 10 s), save it and exit "
            f"({'Ctrl-C' if signum == signal.SIGINT else 'a signal'} again: stop at once, unsaved)"
        )

    def detached_late(self, say: bool) -> Detached:
        """A SLURM job's launcher got a signal before these handlers were in place (the entry's
        :func:`interrupt`: a KeyboardInterrupt): the same detach as :meth:`_handle`'s, never a cancel; said
        (and recorded) when ``say``."""
        signum = _PENDING or signal.SIGINT
        exc = Detached(detach_line(self.cfg, self.job_id, signum), signum, self.job_id)
        if say:
            say_detached(exc, {self.cfg.run.dir: self.job_id})
        return exc

    def stopped(self, asked: Optional[Dict[str, Any]]) -> JobStopped:
        """The job ended after the stop ``asked`` (this launcher's signal, or ``orchestrator stop``)."""
        how = "stopped at once, unsaved" if asked and asked.get("now") else "stopped after saving"
        who = signal.Signals(self.signum).name if self.signum else (asked or {}).get("by", "a stop request")
        code = 128 + self.signum if self.signum else STOPPED_BY_REQUEST_EXIT
        return JobStopped(f"{how} ({who}); {checkpoint_words(self.cfg)}", code)

    def end_words(self) -> str:
        """The end the launcher records (cause ``interrupted``) when a signal ended the job at once, unsaved:
        a second signal, or one that came before these handlers were in place (the job was just starting).
        ``status`` shows it as ``stopped (interrupted) - <these words>``."""
        if self.again:
            return f"stopped at once by a second signal to the launcher ({signal.Signals(self.again).name}), unsaved"
        name = signal.Signals(pending_signal()).name
        return f"stopped by a signal to the launcher ({name}) as the job started, unsaved"

    def ended_at_once(self) -> JobStopped:
        """A second signal ended the job at once (SIGKILL): nothing of the iteration in progress is saved."""
        name = signal.Signals(self.again or signal.SIGINT).name
        return JobStopped(
            f"stopped at once ({name} a second time), unsaved; {checkpoint_words(self.cfg)}",
            128 + (self.again or signal.SIGINT),
        )


class DetachSignals:
    """While several SLURM jobs are queued by one launcher (a sweep's points, submitted then waited on one
    after another): a signal raises :class:`Detached` wherever it lands -- in a wait, between two waits, while
    the next job is being submitted -- and is remembered (:func:`remember`). A handler installed for the waits
    alone missed the gaps between them, where the entry's :func:`interrupt` raised KeyboardInterrupt (exit 130).
    :meth:`hold` installs the handlers (main thread only), :meth:`release` puts the previous ones back and
    returns the signal, if one came. The caller composes the line (the jobs still queued) and says it."""

    def __init__(self) -> None:
        self.held: Dict[int, Any] = {}
        self.signum: Optional[int] = None

    def hold(self) -> "DetachSignals":
        if not self.held and threading.current_thread() is threading.main_thread():
            self.held = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        return self

    def release(self) -> Optional[int]:
        for sig, previous in self.held.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self.held = {}
        return self.signum

    def _handle(self, signum: int, frame: Any = None) -> None:
        self.signum = self.signum or signum
        raise remember(Detached(f"detached ({signal.Signals(signum).name})", signum, ""))


def say_detached(exc: Detached, runs: Dict[str, str]) -> None:
    """Record the detach in each run's history (``runs``: run dir -> its job id; ``detached``: the line) and
    print the line; after a SIGHUP the terminal is gone: the output goes nowhere from then on instead of failing."""
    from orchestrator.ckpt.history import record_event

    for run_dir, job_id in runs.items():
        try:
            record_event(
                run_dir,
                "detached",
                job_id=job_id,
                message=exc.line,
                signal=signal.Signals(exc.signum).name,
                time_local=time.strftime("%Y-%m-%d %H:%M:%S"),
            )
        except OSError:
            pass
    tell(f"[orchestrator] {exc.line}")
    if exc.signum == signal.SIGHUP:
        import os

        devnull = open(os.devnull, "w")  # noqa: SIM115 - the process ends soon
        sys.stdout = sys.stderr = devnull
