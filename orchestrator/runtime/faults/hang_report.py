"""Declaring a hang: the record, every live rank's stacks, and the exit. Mixed into
:class:`~orchestrator.runtime.faults.watchdog.Watchdog`, which writes the heartbeat and watches for the stall."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

from orchestrator.ckpt import history
from orchestrator.ckpt.rundir import STACKS_DIR
from orchestrator.io import write_atomic
from orchestrator.runtime.faults.heartbeat import HEARTBEAT_DIR, read_heartbeat

PathLike = Union[str, Path]


HANG_EXIT_CODE = 79
"""Exit status of every live rank after a declared hang (75/76 are the requeue/stop codes)."""


FOLLOW_TIMEOUT_S = 60.0


STACKS_WAIT_S = 15.0


def stacks_path(run_dir: PathLike, rank: int) -> Path:
    return Path(run_dir) / STACKS_DIR / f"rank_{rank}.txt"


def hang_path(run_dir: PathLike, job_id: str, attempt: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in str(job_id))
    return Path(run_dir) / HEARTBEAT_DIR / f"hang_{safe}_{int(attempt)}.json"


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    return read_heartbeat(path)


def rank_list(ranks: List[int]) -> str:
    return ",".join(str(r) for r in ranks)


def newer(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since - 1.0
    except OSError:
        return False


def say(message: str) -> None:
    print(f"[orchestrator] {message}", file=sys.stderr, flush=True)


def record_quietly(write: Callable[[], Any]) -> None:
    try:
        write()
    except Exception as exc:  # a full disk must not keep the rank from exiting
        say(f"could not record a job event: {exc!r}")


class HangReport:
    """The declaring half of :class:`~orchestrator.runtime.faults.watchdog.Watchdog`: once a rank is seen stalled, the
    hang is declared once for the job (which ranks, on which hosts, at which iteration), every live rank's stacks are
    written, the decision to requeue is taken, and this rank exits with :data:`HANG_EXIT_CODE`."""

    def _declare(self, stale: float) -> None:
        ranks, why = self.stalled()
        if self.iteration is None:
            where = f"the start of the attempt ({self.phase})"
        else:
            where = f"iteration {self.iteration}" + ("" if self.phase == "train" else f" ({self.phase})")
        message = (
            f"hang: rank(s) {rank_list(ranks)} on host(s) {self._hosts(ranks)} made no progress for "
            f"{stale:.0f} s after {where} (training.hang_timeout_s={self.timeout_s:g}): {why}; "
            f"Python stacks of the live ranks in {self.run_dir / STACKS_DIR}/"
        )
        self.declared = message
        if not history.claim_attempt_end(self.run_dir, self.job_id, self.attempt):
            self._follow(None)
            return
        frozen = [
            {"rank": r, "host": rec.get("host"), "pid": rec.get("pid")}
            for r in (ranks if why.startswith("not responding") else [])
            if (rec := self._seen.get(r, (0, 0, None))[2])
        ]
        info = {
            "stalled": ranks,
            "hosts": self._hosts(ranks),
            "message": message,
            "reporter": self.rank,
            "iteration": self.iteration,
            "frozen": frozen,
            "done": False,
            "time": time.time(),
            "restart": getattr(self, "restart", 0),  # which start in place of this attempt declared it
        }
        hpath = hang_path(self.run_dir, self.job_id, self.attempt)
        write_atomic(hpath, json.dumps(info), fsync=False)
        declared_at = time.time()
        self.dump_stacks(f"hang declared by this rank: {message}")
        silent = ranks if why.startswith("not responding") else []
        live = [r for r, (_, _, rec) in self._seen.items() if rec is not None and r not in silent]
        self._await_stacks(live if self._seen else [r for r in range(self.world_size) if r not in silent], declared_at)
        record_quietly(
            lambda: history.record_event(
                self.run_dir,
                "hang",
                job_id=self.job_id,
                attempt=self.attempt,
                stalled=ranks,
                hosts=info["hosts"],
                iteration=self.iteration,
                reporter=self.rank,
            )
        )
        record_quietly(
            lambda: history.record_attempt_ended(  # first: the failure limit counts this one
                self.run_dir,
                self.job_id,
                self.attempt,
                "hang",
                iteration=self.iteration,
                message=message,
                decided=False,
            )
        )
        requeued, detail = self.on_hang(message) if self.on_hang else (False, "")
        record_quietly(
            lambda: history.record_requeue_decision(self.run_dir, self.job_id, self.attempt, requeued, detail)
        )
        write_atomic(hpath, json.dumps({**info, "done": True, "requeued": requeued, "detail": detail}), fsync=False)
        say(f"rank {self.rank}: {message}" + (f"; {detail}" if detail else ""))
        self._end_frozen(frozen)
        self._exit(HANG_EXIT_CODE)

    def _await_stacks(self, ranks: List[int], since: float) -> None:
        deadline = time.monotonic() + STACKS_WAIT_S
        while time.monotonic() < deadline:
            missing = [r for r in ranks if r != self.rank and not newer(stacks_path(self.run_dir, r), since)]
            if not missing:
                return
            time.sleep(0.2)

    def _follow(self, hang: Optional[Dict[str, Any]]) -> None:
        """Another rank declared the hang: dump this rank's stacks, exit once it is done."""
        self.dump_stacks("hang declared by rank %s" % ((hang or {}).get("reporter", "?")))
        hpath = hang_path(self.run_dir, self.job_id, self.attempt)
        deadline = time.monotonic() + FOLLOW_TIMEOUT_S
        while time.monotonic() < deadline and not (hang and hang.get("done")):
            time.sleep(0.2)
            hang = read_json(hpath) or hang
        say(f"rank {self.rank}: stopped by the hang watchdog; stacks in {stacks_path(self.run_dir, self.rank)}")
        self._end_frozen((hang or {}).get("frozen") or [])
        self._exit(HANG_EXIT_CODE)

    def _end_frozen(self, frozen: List[Dict[str, Any]]) -> None:
        """SIGKILL the processes of this host among the ranks declared frozen (``{"rank", "host", "pid"}``): a
        SIGSTOPped or frozen process ignores the SIGTERM that ends a job (torch's agent, submitit) and holds the
        job for that signal's timeout (30 s) before its SIGKILL; nothing of it can be saved anyway."""
        for rec in frozen:
            if rec.get("host") == self.host and isinstance(rec.get("pid"), int) and rec["pid"] != os.getpid():
                try:
                    os.kill(rec["pid"], signal.SIGKILL)
                except OSError:  # gone already, or not ours
                    pass

    def dump_stacks(self, header: str) -> Path:
        """Write every thread's Python stack of this process to ``<run_dir>/stacks/rank_<r>.txt``."""
        path = stacks_path(self.run_dir, self.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            f.write(
                f"# rank {self.rank} on {self.host}, pid {os.getpid()}, iteration {self.iteration}, "
                f"phase {self.phase}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n# {header}\n"
            )
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        return path
