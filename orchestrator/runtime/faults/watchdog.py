"""Hang watchdog: a heartbeat per rank (a file, and a slot of one shared file), a watchdog thread in every
rank, a launcher backstop.

Files (shared filesystem, ``<run_dir>/heartbeat/``)::

    rank_<r>                 one JSON record, rewritten in place by rank r's watchdog thread every
                             poll: job id, attempt, host, pid, the last finished iteration, a beat
                             counter (progress), an ``alive`` counter (the thread itself), the phase
    ranks                    every rank's record at once: rank r's copy in a slot of its own
                             (:data:`SLOT_BYTES` from byte r x SLOT_BYTES), rewritten by the same
                             thread at the same time; readers of every rank (the other ranks'
                             watchdogs, the launcher's :class:`JobWatch`) open this one file, not
                             one file per rank (1,024 ranks: one open and 4 MiB read per poll)
    hang_<job>_<attempt>.json   written by the rank that declares a hang (the others follow it)

Progress vs liveness. The training loop only bumps counters in memory (:meth:`Watchdog.progress`:
no syscall, no collective). The thread writes them out with its own ``alive`` counter, opening and
closing the file each time (NFS publishes on close). A rank whose main thread is blocked in a
collective still has a running thread; a stopped (SIGSTOP), frozen or dead process has not.

Detection, in every rank's thread (clock-skew free: only changes seen by the reader count):

1. once this rank's own progress is older than half of ``training.hang_timeout_s`` (before the first
   iteration: the time since the watchdog started), it starts watching every rank's slot (so the
   slots of a healthy run are read by nobody);
2. a rank whose ``alive`` counter stopped changing (its process stopped, frozen or dead) for half of
   ``training.hang_timeout_s`` while this rank has made no progress for ``training.hang_timeout_s`` is
   named at once, whatever the phase (a save, the checkpoint load, the data set-up, an iteration): a
   stopped process is a fact about that process, independent of its peers' allowance;
3. otherwise, once this rank's progress is older than its phase's allowance (``training.hang_timeout_s``;
   a checkpoint save gets ``checkpoint.save_timeout_s`` + 60 s: the long allowance covers a save
   that is slow, not a peer that stopped), the stalled ranks are named: those behind the others'
   iteration, else all of them (every rank blocked after the same iteration: a collective or I/O that
   never completes). Before the first iteration only rule 2 applies (start-up times vary);
4. the first rank to claim the attempt's end (:func:`orchestrator.ckpt.history.claim_attempt_end`)
   reports: it writes ``hang_<job>_<attempt>.json``, dumps its stacks
   (``faulthandler.dump_traceback(all_threads=True)`` into ``<run_dir>/stacks/rank_<r>.txt``), waits
   for the other live ranks' stacks, lets ``on_hang`` requeue the SLURM job, records the ``hang`` event
   and the attempt's end, and ends the process with :data:`HANG_EXIT_CODE`. Every other live rank
   sees the hang file, dumps its own stacks and exits the same way once the reporter is done.

Torch-free; the launcher uses :class:`JobWatch` (every rank silent: cancel, report).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

from orchestrator.runtime.faults.hang_report import (  # noqa: F401 - re-exported: the hang's names
    HANG_EXIT_CODE,
    HangReport,
    PathLike,
    hang_path,
    newer,
    rank_list,
    read_json,
    record_quietly,
    say,
    stacks_path,
)
from orchestrator.runtime.faults.heartbeat import (  # noqa: F401
    HEARTBEAT_DIR,
    SLOT_BYTES,
    heartbeat_path,
    read_heartbeat,
    read_slot_bytes,
    read_slots,
    slots_path,
    write_heartbeat,
    write_slot,
)


class Watchdog(HangReport):
    """Heartbeat writer and hang detector of one rank (see the module docstring).

    ``timeout_s``: ``training.hang_timeout_s``. ``on_hang(message) -> (requeued, detail)`` runs on the
    reporting rank before it exits (the SLURM requeue). ``exit`` is ``os._exit`` (tests replace it).
    """

    def __init__(
        self,
        run_dir: PathLike,
        rank: int,
        world_size: int,
        host: str,
        job_id: str,
        attempt: int,
        timeout_s: float,
        on_hang: Optional[Callable[[str], Tuple[bool, str]]] = None,
        poll_s: Optional[float] = None,
        exit: Callable[[int], None] = os._exit,
        restart: int = 0,
    ):
        self.run_dir, self.rank, self.world_size, self.host = Path(run_dir), rank, world_size, host
        self.job_id, self.attempt, self.timeout_s = str(job_id), int(attempt), float(timeout_s)
        self.poll_s = poll_s or min(5.0, max(0.25, self.timeout_s / 10))
        self.on_hang, self._exit = on_hang, exit
        self.iteration: Optional[int] = None
        self.beats = 0
        self.phase, self.allowance_s = "start", self.timeout_s
        self._last_progress: Optional[float] = None  # monotonic; None until the first finished iteration
        self._alive = 0
        self._seen: Dict[int, Tuple[Any, float, Optional[Dict[str, Any]]]] = {}
        self._watch_since: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orchestrator-watchdog", daemon=True)
        self.declared: Optional[str] = None
        self._born = time.time()  # a hang file older than this is from an earlier job with the same id
        # ranks restarted in place keep the job and attempt: a hang file of an earlier start (another restart
        # number) is not theirs, however recent (they start watching before the model build)
        self.restart = int(restart)
        self._started = time.monotonic()

    # ---- the training loop's side (cheap) ------------------------------------------------------
    def progress(self, iteration: int) -> None:
        """Iteration ``iteration`` finished on this rank (memory only)."""
        self.iteration, self.beats = iteration, self.beats + 1
        self._last_progress = time.monotonic()
        if self.phase == "start":
            self.phase = "train"

    @contextlib.contextmanager
    def phase_of(self, name: str, allowance_s: float) -> Iterator[None]:
        """A phase (e.g. a save) allowed ``allowance_s`` without progress; entering and leaving count as
        progress once training has started."""
        previous = (self.phase, self.allowance_s)
        self.phase, self.allowance_s = name, max(self.timeout_s, allowance_s)
        if self._last_progress is not None:
            self._last_progress = time.monotonic()
        try:
            yield
        finally:
            self.phase, self.allowance_s = previous
            if self._last_progress is not None:
                self._last_progress = time.monotonic()

    def start(self) -> "Watchdog":
        self.path = heartbeat_path(self.run_dir, self.rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * self.poll_s + 1)

    # ---- the thread ----------------------------------------------------------------------------
    def _record(self) -> Dict[str, Any]:
        return {
            "rank": self.rank,
            "host": self.host,
            "pid": os.getpid(),
            "job_id": self.job_id,
            "attempt": self.attempt,
            "iteration": self.iteration,
            "beats": self.beats,
            "phase": self.phase,
            "allowance_s": self.allowance_s,
            "alive": self._alive,
            "time": time.time(),
        }

    def _write(self) -> None:
        self._alive += 1
        record = self._record()
        write_heartbeat(self.path, record)
        write_slot(slots_path(self.run_dir), self.rank, record)

    def _run(self) -> None:
        complained = False
        while not self._stop.wait(self.poll_s):
            try:
                self._tick()
            except Exception as exc:  # never let the watchdog take the rank down by itself
                if not complained:
                    say(f"rank {self.rank}: hang watchdog problem (continuing): {exc!r}")
                    complained = True

    def _tick(self) -> None:
        self._write()
        hang = read_json(hang_path(self.run_dir, self.job_id, self.attempt))
        if hang is not None and self._ours(hang):
            self._follow(hang)
            return
        started = self._last_progress is not None
        stale = time.monotonic() - (self._last_progress if started else self._started)
        if stale <= self.timeout_s / 2:
            self._seen.clear()
            self._watch_since = None
            return
        self._observe()
        if (stale > self.timeout_s and self._frozen()) or (started and stale > self.allowance_s):
            self._declare(stale)

    def _ours(self, hang: Dict[str, Any]) -> bool:
        """A hang file of this start: declared since this watchdog was born (5 s of clock skew between hosts
        allowed) by a rank of the same start in place."""
        return int(hang.get("restart") or 0) == self.restart and float(hang.get("time") or 0) >= self._born - 5.0

    def _observe(self) -> None:
        now = time.monotonic()
        self._watch_since = self._watch_since or now
        records = read_slots(slots_path(self.run_dir), self.world_size)
        for r in range(self.world_size):
            rec = records.get(r)
            if rec is not None and (str(rec.get("job_id")) != self.job_id or rec.get("attempt") != self.attempt):
                rec = None  # a slot left by an earlier job or attempt
            alive = None if rec is None else rec.get("alive")
            if r not in self._seen or self._seen[r][0] != alive:
                self._seen[r] = (alive, now, rec)
            else:
                self._seen[r] = (alive, self._seen[r][1], rec)

    def _frozen(self) -> List[int]:
        """Ranks whose heartbeat thread wrote in this attempt, then stopped for half of
        ``training.hang_timeout_s`` while watched (rule 2 of the module docstring)."""
        now = time.monotonic()
        return sorted(
            r
            for r, (_, since, rec) in self._seen.items()
            if r != self.rank and rec is not None and now - since > max(3 * self.poll_s, self.timeout_s / 2)
        )

    def stalled(self) -> Tuple[List[int], str]:
        """(stalled ranks, why) from what :meth:`_observe` saw."""
        now = time.monotonic()
        silent = self._frozen() or sorted(
            r
            for r, (alive, since, rec) in self._seen.items()
            if r != self.rank and (rec is None or now - since > 3 * self.poll_s)
        )
        if silent:
            return silent, "not responding (process stopped, frozen or dead)"
        its = {r: (rec or {}).get("iteration") for r, (_, _, rec) in self._seen.items()}
        its[self.rank] = self.iteration
        known = [v for v in its.values() if v is not None]
        low, high = (min(known), max(known)) if known else (None, None)
        if low is not None and low != high:
            return sorted(r for r, v in its.items() if v == low), f"behind the others (they reached iteration {high})"
        return list(
            range(self.world_size)
        ), "every rank waits after the same iteration (a collective or I/O that never completes)"

    def _hosts(self, ranks: List[int]) -> str:
        hosts = []
        for r in ranks:
            rec = self._seen.get(r, (None, 0.0, None))[2]
            hosts.append(self.host if r == self.rank else str((rec or {}).get("host") or "?"))
        return ",".join(sorted(set(hosts)))


class JobWatch:
    """The launcher's backstop: every rank of ``job_id`` silent (no heartbeat changed) for ``timeout_s`` +
    ``grace_s`` after one was seen. Reads the ``ranks`` file (one open, whatever the number of ranks) at
    most every ``every_s``; once a record of the job was seen, a poll only compares the file's bytes with
    the last poll's (every write bumps its rank's ``alive`` counter), and parses them only for the message."""

    def __init__(
        self,
        run_dir: PathLike,
        job_id: str,
        world_size: int,
        timeout_s: float,
        grace_s: float = 60.0,
        every_s: float = 5.0,
    ):
        self.run_dir, self.job_id, self.world_size = Path(run_dir), str(job_id), world_size
        self.limit_s, self.every_s = timeout_s + grace_s, every_s
        self._raw = b""
        self._seen = False
        self._changed = time.monotonic()
        self._checked = 0.0

    @property
    def last(self) -> Dict[int, Dict[str, Any]]:
        """rank -> the job's latest heartbeat record, as last read."""
        return {
            r: rec
            for r, rec in read_slots(slots_path(self.run_dir), self.world_size, self._raw).items()
            if str(rec.get("job_id")) == self.job_id
        }

    def silent_for(self) -> Optional[float]:
        """Seconds since any rank of the job last wrote its heartbeat (None before the first one)."""
        now = time.monotonic()
        if now - self._checked >= self.every_s:
            self._checked = now
            raw = read_slot_bytes(slots_path(self.run_dir), self.world_size)
            if raw != self._raw:
                self._raw = raw
                self._seen = self._seen or bool(self.last)  # parsed only until the job's first record
                self._changed = now
        return now - self._changed if self._seen else None

    def pause(self) -> None:
        """The job is not running (pending, requeued): silence does not count."""
        self._changed = time.monotonic()

    def hung(self) -> Optional[str]:
        """A one-line message when every rank has been silent past the limit, else None."""
        silent = self.silent_for()
        if silent is None or silent <= self.limit_s:
            return None
        its = sorted({rec.get("iteration") for rec in self.last.values()}, key=lambda v: (v is None, v))
        hosts = ",".join(sorted({str(rec.get("host")) for rec in self.last.values()}))
        return (
            f"hang: no rank of job {self.job_id} (hosts {hosts}) wrote its heartbeat for {silent:.0f} s "
            f"(last iteration {its[-1] if its else '?'}): every process stopped, frozen or lost; cancelled"
        )
