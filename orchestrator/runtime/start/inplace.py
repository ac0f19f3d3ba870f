"""In-place restarts (``cluster.max_restarts`` > 0): one torch elastic agent per node, started as the job's task.

The job is submitted through submitit as before (SLURM: ``nodes`` tasks, one a node; local: one task), and each
task runs :class:`NodeAgent`: the per-node agent of :mod:`orchestrator.runtime.start.agent` (torch's
``elastic_launch``, what ``torchrun`` runs) with ``--max-restarts``, a c10d rendezvous hosted by the first node of
the allocation (id ``<job id>-<attempt>``) and the job's ranks as its workers. When a worker fails (killed, crashed,
a declared hang) its agent stops its other workers and re-enters the rendezvous; the other agents see the waiting
node and restart theirs (torch elastic's membership change), so all ranks start again in the same allocation, with
the same SLURM job id, and resume from the last complete checkpoint. ``max_restarts`` is torch's count, per agent.

Not every end is a failure to restart: a worker whose end was decided by the job (a graceful stop or a requeue, a
NaN stop, an orchestrator error, or a failure after which the job decided not to restart: its restarts are used
up, see :func:`orchestrator.runtime.faults.inplace.decide`) exits 0 after writing its outcome file, so the agent does
not start it again; :class:`NodeAgent` then turns the outcomes into the task's own end (a ``SystemExit`` of the
same code for a stop or requeue, a ``RuntimeError`` with the rank's traceback for an error).
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import time
from pathlib import Path
from typing import Any, Dict, Tuple

from orchestrator.slurm import JOB_ID_VAR

AGENTS_DIR = "agents"


def read_outcomes(job_dir: Path) -> Dict[int, Tuple[str, Any]]:
    """The ``result_<rank>.pkl`` files the ranks of one attempt wrote (see :mod:`~orchestrator.runtime.start.agent`)."""
    found: Dict[int, Tuple[str, Any]] = {}
    for path in job_dir.glob("result_*.pkl"):
        try:
            found[int(path.stem.split("_", 1)[1])] = pickle.loads(path.read_bytes())
        except (OSError, ValueError, pickle.UnpicklingError, EOFError):
            continue
    return found


def record_death(run_dir: str, job_id: str, attempt: int, rank: int, how: str) -> None:
    """A signal ended rank ``rank`` on this node (``how``: ``exit by signal 9, SIGKILL``): say so in ``jobs.jsonl``
    (:data:`~orchestrator.ckpt.history.SIGNALLED_EVENT`) before its peers' broken collectives are recorded as
    the attempt's end; the rank that records it names this rank first (:func:`~orchestrator.runtime.faults.lost.crash_cause`)."""
    from orchestrator.ckpt import history
    from orchestrator.ckpt.history import SIGNALLED_EVENT

    host = socket.gethostname()
    try:
        history.record_event(
            run_dir,
            SIGNALLED_EVENT,
            job_id=str(job_id),
            attempt=int(attempt),
            rank=int(rank),
            host=host,
            how=how,
            message=f"rank {rank} ({host}) died: {how}",
        )
    except OSError:
        pass


class NodeAgent:
    """``NodeAgent(job, run_dir, nproc_per_node, nnodes, max_restarts)()`` runs this node's share of ``job`` (a
    :class:`~orchestrator.runtime.start.job.TrainJob`) under torch's elastic agent; returns ``{"ranks": {rank:
    summary}}`` for the ranks whose outcome it found. Raises ``SystemExit(code)`` for a stop or requeue and
    ``RuntimeError`` (the first failed rank's last lines) for a failure."""

    def __init__(
        self, job: Any, run_dir: str, nproc_per_node: int, nnodes: int, max_restarts: int, spare_nodes: int = 0
    ):
        self.job, self.run_dir = job, run_dir
        self.nproc_per_node, self.nnodes, self.max_restarts = nproc_per_node, nnodes, max_restarts
        self.spare_nodes = spare_nodes

    def _endpoint(self, env: Any, job_id: str, attempt: int) -> str:
        """Local: the port the launcher reserved (``MASTER_PORT`` of the job's environment) on 127.0.0.1; SLURM:
        the first node of the allocation, a port derived from the job id and attempt."""
        from orchestrator.runtime.rank.rendezvous import derived_port

        port = self.job.env.pop("MASTER_PORT", None)
        self.job.env.pop("MASTER_ADDR", None)  # the agent tells its workers where the store is
        if getattr(env, "cluster", "") == "local":
            return f"127.0.0.1:{port or derived_port(job_id)}"
        return f"{env.hostnames[0]}:{derived_port(f'{job_id}-{attempt}')}"

    def __call__(self) -> Dict[str, Any]:
        import signal

        import submitit

        from orchestrator.runtime.start.agent import run_node, write_job
        from orchestrator.slurm import restart_count

        env = submitit.JobEnvironment()
        job_id, attempt = str(env.job_id), restart_count()
        job_dir = Path(self.run_dir).absolute() / AGENTS_DIR / job_id / f"attempt_{attempt}"
        job_dir.mkdir(parents=True, exist_ok=True)
        endpoint = self._endpoint(env, job_id, attempt)
        os.environ[JOB_ID_VAR] = job_id  # every worker's job id (records, lock, heartbeats)
        # a fresh store for each start of the ranks (rank 0 hosts it on a free port, as torchrun's static
        # rendezvous does): the agent's shared store would hand restarted ranks the keys of the failed start
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        job_file = job_dir / f"job_node{env.node}.pkl"
        write_job(job_file, self.job)
        # SLURM signals every process of the step: the workers save and stop (or requeue) themselves; the agent
        # must outlive them (submitit's own USR2 handler would end this task, and with it the workers)
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        args = argparse.Namespace(
            nnodes=self.nnodes,
            nproc_per_node=self.nproc_per_node,
            rdzv_endpoint=endpoint,
            rdzv_id=f"{job_id}-{attempt}",
            node_rank=None,
            max_restarts=self.max_restarts,
            watch_stdin=False,
            job_file=str(job_file),
            rdzv_backend="c10d",
            on_death=lambda rank, how: record_death(self.run_dir, job_id, attempt, rank, how),
        )
        if getattr(env, "cluster", "") != "local":  # SLURM: a health check before each start; spares wait
            from orchestrator.runtime.start import spares

            spares.register(self.run_dir, job_dir)
            args.rdzv_backend = spares.BACKEND
            first = env.hostnames[0]
            if env.node >= self.nnodes and spares.wait_for_a_place(self.run_dir, job_dir, first=first) is None:
                return {"ranks": {}}  # a spare the job never needed
            beat = spares.beating(job_dir, env.global_rank)  # the spares take this node's place if it dies
            try:
                code = run_node(args)
            except spares.LeftOut as exc:
                return self._left_out(job_dir, str(exc))
            except BaseException:
                spares.mark_done(job_dir)  # an end without a node left out: no spare is needed any more
                raise
            finally:
                beat.set()
            spares.mark_done(job_dir)
        else:
            code = run_node(args)
        return self._end(code, read_outcomes(job_dir))

    def _left_out(self, job_dir: Path, why: str, wait_s: float = 15.0) -> Dict[str, Any]:
        """This node failed its health check: a spare takes its place (this task ends), or, with none left, the
        requeue policy applies to the attempt (``cluster.max_failures``) and this task fails."""
        from orchestrator.ckpt import history
        from orchestrator.runtime.faults.requeue import job_identity, requeue_for_failure

        host = socket.gethostname()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if (job_dir / f"taken_{host}").exists():
                print(f"[orchestrator] {why}; a spare node takes its place", flush=True)
                return {"ranks": {}, "left_out": host}
            time.sleep(0.5)
        job_id, attempt = job_identity()
        history.clear_attempt_markers(self.run_dir, job_id, attempt)  # the failure before was decided: a restart
        if history.claim_attempt_end(self.run_dir, job_id, attempt):
            history.record_attempt_ended(self.run_dir, job_id, attempt, "node failure", message=why)
            max_failures = int(self.job.config["cluster"]["max_failures"])
            requeued, detail = requeue_for_failure(self.run_dir, max_failures)
            why = f"{why}; no spare node left (cluster.spare_nodes={self.spare_nodes}): {detail}"
            history.record_requeue_decision(self.run_dir, job_id, attempt, requeued, detail)
        print(f"[orchestrator] {why}", flush=True)
        raise RuntimeError(why)

    def _end(self, code: int, found: Dict[int, Tuple[str, Any]]) -> Dict[str, Any]:
        """This task's end from the agent's exit code and the ranks' outcomes."""
        from orchestrator.runtime.start.agent import decided_exit, exit_code_of

        decided = decided_exit(found)
        if decided is not None:
            raise SystemExit(decided)
        errors = {r: o[1] for r, o in sorted(found.items()) if o[0] == "error" and exit_code_of(o) is None}
        if errors:
            rank, text = next(iter(errors.items()))
            raise RuntimeError(f"rank {rank} failed:\n{text}")
        if code != 0:
            raise RuntimeError(
                f"the ranks on {socket.gethostname()} failed and their agent ended (exit {code}) "
                f"after cluster.max_restarts={self.max_restarts} restarts; see the log above"
            )
        return {"ranks": {r: o[1] for r, o in found.items()}}
