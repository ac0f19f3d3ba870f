"""The SSH sessions of a ``cluster=hosts`` job: one per host, each running that host's torchrun agent.

:class:`Sessions` starts them (stdin a pipe the launcher holds open: its end of file tells the remote agent
to stop its ranks, see :mod:`orchestrator.runtime.start.agent`), watches them every
``cluster.poll_interval_s``, names the host whose session ends first with a failure, stops the others,
and afterwards removes any process of the job still on a host (``pkill -f <job file>``, over SSH).
"""

from __future__ import annotations

import pickle
import shlex
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from orchestrator.config.schema import JobConfig
from orchestrator.errors import JobFailedError

CLEANUP_TIMEOUT_S = 20.0
STOP_WAIT_S = 40.0
"""How long the other sessions get to stop their ranks (torchrun's SIGTERM-to-SIGKILL is 30 s)."""


def results(job_file: Path, world_size: int) -> Dict[int, Tuple[str, Any]]:
    """The outcome files the ranks wrote, by rank."""
    from orchestrator.runtime.start.agent import result_path

    found: Dict[int, Tuple[str, Any]] = {}
    for rank in range(world_size):
        try:
            found[rank] = pickle.loads(result_path(job_file, rank).read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError):
            continue
    return found


def failure(job_file: Path, found: Dict[int, Tuple[str, Any]], headline: str) -> JobFailedError:
    """The JobFailedError of a job whose agents ended: the headline, then the first failed rank's last lines."""
    errors = {r: o[1] for r, o in found.items() if o[0] == "error"}
    detail = ""
    for rank, text in sorted(errors.items()):
        lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
        if lines:
            detail = f"\nrank {rank}:\n" + "\n".join(lines[-8:])
            break
    return JobFailedError(headline + detail)


def _how(rc: int) -> str:
    if rc < 0:
        return f"the SSH client was killed by {signal.Signals(-rc).name}"
    if rc == 255:
        return "the SSH connection failed or was lost (ssh exit 255)"
    if rc >= 128:
        return f"its agent was stopped by signal {rc - 128}"
    return f"its ranks failed (agent exit {rc})"


class Sessions:
    """One ``ssh HOST SCRIPT`` per host; output to ``<job_dir>/<host>.log``."""

    def __init__(self, ssh: Sequence[str], hosts: Sequence[str], job_dir: Path, job_file: Path):
        self.ssh, self.hosts, self.job_dir, self.job_file = list(ssh), list(hosts), job_dir, job_file
        self.procs: Dict[str, subprocess.Popen] = {}

    def log(self, host: str) -> Path:
        return self.job_dir / f"{host}.log"

    def start(self, script: str) -> None:
        for host in self.hosts:
            with open(self.log(host), "ab") as out:  # the child keeps its own descriptor
                self.procs[host] = subprocess.Popen(
                    self.ssh + [host, script],
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def ended(self) -> Dict[str, int]:
        return {h: p.returncode for h, p in self.procs.items() if p.poll() is not None}

    def stop(self, wait_s: float) -> None:
        """Close every live session's stdin (its agent stops its ranks), wait up to ``wait_s``, then kill the
        SSH clients still running."""
        for p in self.procs.values():
            if p.poll() is None and p.stdin is not None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.2)
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()

    def cleanup(self) -> List[str]:
        """Kill whatever process of this job is left on any host (matched by its job file); the hosts where
        something was left."""
        pattern = shlex.quote(str(self.job_file).replace(".", "[.]"))  # a regex that does not match this shell
        script = f"pkill -KILL -f {pattern} && echo left || true"
        left: List[str] = []
        procs = {
            h: subprocess.Popen(
                self.ssh + [h, script],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for h in self.hosts
        }
        for host, p in procs.items():
            try:
                out, _ = p.communicate(timeout=CLEANUP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
                continue
            if "left" in out:
                left.append(host)
        return left

    def wait(self, cfg: JobConfig, world_size: int, job_id: str, *, show_progress: bool = True) -> List[Any]:
        """Block until every session ended; the ranks' summaries by rank. JobFailedError naming the host whose
        session ended first with a failure (or the failed ranks). A signal to this launcher (or ``orchestrator
        stop``) asks the ranks' graceful stop through ``stop.json``, as for a local job
        (:mod:`orchestrator.submit.signals`): JobStopped once every session ended (a second signal: at once)."""
        from orchestrator.ckpt.rundir import METRICS_FILE
        from orchestrator.submit import outcome
        from orchestrator.submit.progress import Progress, ranks_up
        from orchestrator.submit.signals import WaitSignals

        run_dir = cfg.run.dir
        progress = Progress(
            Path(run_dir) / METRICS_FILE,
            cfg.training.train_iters,
            enabled=show_progress,
            log=self.log(self.hosts[0]),
            world_size=world_size,
            ranks_up=ranks_up(Path(run_dir), job_id),
            every=2.0,
        )
        signals = WaitSignals(cfg, job_id)
        try:
            with signals:
                first, asked = self._watch(cfg, job_id, progress, signals)
        except KeyboardInterrupt:  # a second signal, or one before the handlers were in place
            outcome.record_end(
                run_dir,
                job_id,
                "interrupted",  # first: ranks cut off by the stop record a crash
                signals.end_words(),
            )
            self.stop(0.0 if signals.again else STOP_WAIT_S)
            self._finish(run_dir, job_id)
            if signals.again:
                raise signals.ended_at_once() from None
            raise
        finally:
            progress.poll()
            progress.close()
        self._finish(run_dir, job_id)
        if asked is not None:  # the ranks saved and exited on request (the job recorded why, unless they died first)
            outcome.record_end(
                run_dir, job_id, str(asked.get("cause") or "interrupted"), f"stopped by {asked.get('by')}"
            )
            raise signals.stopped(asked)
        return self._outcome(run_dir, world_size, job_id, first)

    def _watch(self, cfg: JobConfig, job_id: str, progress, signals) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
        """Poll until every session ended: (the host whose session failed first, or None; the stop asked of the
        job, or None). Once a stop is asked, sessions that end are the ranks stopping: the others get
        :data:`STOP_WAIT_S` to follow before they are stopped."""
        from orchestrator.ckpt import stop

        asked: Optional[Dict[str, Any]] = None
        since: Optional[float] = None
        while True:
            progress.poll()
            ended = self.ended()
            if asked is None and (signals.signum or stop.stop_path(cfg.run.dir).exists()):
                asked = stop.read(cfg.run.dir, job_id)
            if len(ended) == len(self.hosts):
                return None, asked
            bad = [h for h in self.hosts if ended.get(h, 0) != 0]
            if asked is not None and ended:
                since = since or time.monotonic()
                if time.monotonic() - since > STOP_WAIT_S:
                    self.stop(0.0)
                    return None, asked
            elif bad:
                print(
                    f"[orchestrator] {bad[0]}: session ended: {_how(ended[bad[0]])}; stopping the other hosts' ranks",
                    flush=True,
                )
                self.stop(STOP_WAIT_S)
                return bad[0], None
            time.sleep(cfg.cluster.poll_interval_s)

    def _outcome(self, run_dir: str, world_size: int, job_id: str, first: Optional[str]) -> List[Any]:
        """The ranks' summaries when all succeeded; else record the end and raise its JobFailedError."""
        from orchestrator.ckpt.lock import RunLock
        from orchestrator.submit import outcome

        found = results(self.job_file, world_size)
        if first is None and len(found) == world_size and all(o[0] == "success" for o in found.values()):
            return [found[r][1] for r in range(world_size)]
        rc = self.procs[first].returncode if first else None
        headline = (
            f"host {first}: {_how(rc)}; the job's ranks on every host were stopped"
            if first
            else f"the job ended without every rank's result ({len(found)} of {world_size})"
        )
        known = outcome.known_failure(run_dir, job_id, [o[1] for o in found.values() if o[0] == "error"])
        lost = rc is not None and (rc < 0 or rc == 255)
        outcome.record_end(run_dir, job_id, "node failure" if lost else "crashed", headline)
        if known and not lost:
            headline = known
        if first:
            tail = (
                "\n".join(self.log(first).read_text(errors="replace").splitlines()[-6:])
                if self.log(first).exists()
                else ""
            )
            headline += f"\n{first}'s last lines ({self.log(first)}):\n{tail}" if tail else ""
        RunLock(run_dir).release_for(job_id)
        raise failure(self.job_file, {} if lost else found, headline)  # a lost session: its peers' errors are echoes

    def _finish(self, run_dir: str, job_id: str) -> None:
        from orchestrator.ckpt.lock import RunLock

        left = self.cleanup()
        if left:
            print(f"[orchestrator] removed processes of job {job_id} left on {', '.join(left)}", flush=True)
        RunLock(run_dir).release_for(job_id)
