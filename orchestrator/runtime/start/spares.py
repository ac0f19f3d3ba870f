"""The health check before every start of a node's ranks, and spare nodes (``cluster.spare_nodes``) of a SLURM job.

Every agent of a job restarted in place (:mod:`orchestrator.runtime.start.inplace`) rendezvous through
:data:`BACKEND`: torch's c10d rendezvous handler, registered under its own name with a check in front of each
``next_rendezvous`` (the first start and every restart): :func:`health_problem` (the Python environment finds
torch, megatron-core and orchestrator; a file written, synced, read back and removed in the run root; SLURM does not
have the node drained, down or not responding). The collective across the job's nodes is the rendezvous itself
(a barrier on the c10d store of the first node) and the ranks' process-group start after it.

A node that fails the check is left out: its agent stops (:class:`LeftOut`) and says so in the attempt's folder
(``left_out_<host>.json``) and in ``jobs.jsonl`` (``node_left_out``). The spare nodes' tasks (SLURM node ids
``cluster.nodes`` and up) never enter the rendezvous while the job runs without them: a node waiting there would
make the running agents restart (torch elastic's membership change), and one past ``max_nodes`` fails the whole
rendezvous (nvidia-resiliency-ext #348). A spare waits on that folder instead: once a node is left out, the first
spare to claim it (an ``O_EXCL`` file) checks itself and joins the rendezvous the other agents are waiting in, with
the layout's world size unchanged. The first node hosts the rendezvous store and is never replaced.

A node that dies (its processes and slurmd gone) cannot say it is left out: its agent beats instead (every
:data:`BEAT_S` seconds it touches ``agent_<host>`` in the attempt's folder, :func:`beating`), and a waiting spare
that finds an active node's beat older than :data:`DEAD_AFTER_S` (and no mark of its own) writes the mark on its
behalf (:func:`dead_nodes`, the problem naming the silence and SLURM's state of the node), then takes its place as
for a drained node. torch's rendezvous drops the dead agent by its own keep-alive (15 s), and the job survives the
node's loss in SLURM's eyes through ``--no-kill`` (:mod:`orchestrator.submit.sbatch`, jobs with spares).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from orchestrator.slurm import JOB_ID_VAR

BACKEND = "orchestrator-c10d"
BEAT_S = 2.0
"""How often an active node's agent says it is alive (``agent_<host>``'s modification time)."""
DEAD_AFTER_S = 30.0
"""An active node whose agent has not beaten for this long is dead: a spare takes its place."""
UNHEALTHY_STATES = ("DRAIN", "DOWN", "FAIL", "NOT_RESPONDING", "POWER")
"""Words of ``scontrol show node``'s ``State`` that leave a node out (``DRAIN`` includes ``DRAINING``)."""


class LeftOut(RuntimeError):
    """This node failed its health check before a start of its ranks."""


def health_problem(run_dir: str, host: str) -> Optional[str]:
    """Why this node must not start ranks now (None when it may): see the module docstring."""
    for module in ("torch", "megatron.core", "orchestrator"):
        if importlib.util.find_spec(module) is None:
            return f"the Python environment cannot import {module}"
    probe = Path(run_dir) / f".health-{host}-{uuid.uuid4().hex[:8]}"
    try:
        with open(probe, "w") as f:
            f.write(host)
            f.flush()
            os.fsync(f.fileno())
        if probe.read_text() != host:
            return f"the run root {run_dir} did not read back what was written"
    except OSError as exc:
        return f"cannot write the run root {run_dir}: {exc.strerror or exc}"
    finally:
        probe.unlink(missing_ok=True)
    return slurm_problem(host)


def slurm_problem(host: str) -> Optional[str]:
    """``SLURM has the node DOWN*`` when ``scontrol show node`` says it is drained, down or not responding; None
    when it does not, or does not answer (no verdict)."""
    try:
        out = subprocess.run(["scontrol", "show", "node", host], capture_output=True, text=True, timeout=15).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = next((f.split("=", 1)[1] for f in out.split() if f.startswith("State=")), "")
    bad = [w for w in UNHEALTHY_STATES if w in state.upper()] or (["NOT_RESPONDING"] if state.endswith("*") else [])
    return f"SLURM has the node {state}" if bad else None


def register(run_dir: str, job_dir: Path) -> None:
    """Register :data:`BACKEND` (once a process): torch's c10d handler behind the health check."""
    from torch.distributed.elastic.rendezvous import RendezvousHandler, registry

    class Checked(_Checked, RendezvousHandler):
        pass

    def create(params):
        return Checked(registry._create_c10d_handler(params), run_dir, job_dir)

    try:
        registry.handler_registry.register(BACKEND, create)
    except ValueError:  # registered by an earlier call in this process
        pass


class _Checked:
    """A rendezvous handler that runs :func:`health_problem` before each ``next_rendezvous`` of ``inner`` (torch's
    c10d handler) and is ``inner`` otherwise."""

    def __init__(self, inner: Any, run_dir: str, job_dir: Path):
        self.inner, self.run_dir, self.job_dir = inner, run_dir, job_dir
        self.left_out = False

    def next_rendezvous(self):
        host = socket.gethostname()
        if (self.job_dir / f"left_out_{host}.json").exists():  # taken for dead (silent too long): a spare has come
            self.left_out = True
            raise LeftOut(f"node {host} was taken for dead by a spare node (its agent was silent too long)")
        problem = health_problem(self.run_dir, host)
        if problem:
            leave(self.run_dir, self.job_dir, host, problem)
            self.left_out = True
            raise LeftOut(f"node {host} failed its health check: {problem}")
        return self.inner.next_rendezvous()

    @property
    def use_agent_store(self) -> bool:
        return self.inner.use_agent_store

    def get_backend(self) -> str:
        return BACKEND  # (torch checks a handler against the name it was asked for)

    def is_closed(self) -> bool:
        return self.inner.is_closed()

    def set_closed(self) -> None:
        self.inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self.inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self.inner.get_run_id()

    def shutdown(self) -> bool:
        """torch closes the rendezvous when an agent ends (for every node); a node left out leaves it open, for the
        spare that takes its place."""
        return True if self.left_out else self.inner.shutdown()


def _record(run_dir: str, event: str, **fields: Any) -> None:
    from orchestrator.ckpt import history
    from orchestrator.slurm import restart_count

    try:
        history.record_event(run_dir, event, job_id=os.environ.get(JOB_ID_VAR), attempt=restart_count(), **fields)
    except OSError:
        pass


def leave(
    run_dir: str, job_dir: Path, host: str, problem: str, by: Optional[str] = None, task: Optional[int] = None
) -> bool:
    """Say that ``host`` is left out (for the spares, and in ``jobs.jsonl``); ``by``: the live node that says it for
    a dead one, whose job task was ``task`` (it writes no result: the launcher counts it as left out). False when
    the mark was there already (said once)."""
    try:
        fd = os.open(job_dir / f"left_out_{host}.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps({"host": host, "problem": problem, "time": time.time(), "by": by or host}))
    what = f"is dead ({problem}; said by node {by})" if by else f"failed its health check and is left out: {problem}"
    _record(
        run_dir, "node_left_out", host=host, problem=problem, by=by or host, task=task, message=f"node {host} {what}"
    )
    return True


def beating(job_dir: Path, task: int) -> threading.Event:
    """This active node's agent (job task ``task``) says it is alive (``agent_<host>``, holding ``task``, written
    every :data:`BEAT_S`) until the returned event is set."""
    path, stop = job_dir / f"agent_{socket.gethostname()}", threading.Event()

    def beat() -> None:
        while True:
            try:
                path.write_text(f"{task}\n")
            except OSError:
                pass
            if stop.wait(BEAT_S):
                return

    threading.Thread(target=beat, name="agent-beat", daemon=True).start()
    return stop


def dead_nodes(run_dir: str, job_dir: Path, first: Optional[str], dead_after_s: float = DEAD_AFTER_S) -> None:
    """A spare: mark left out (:func:`leave`, on their behalf) the active nodes whose agent has been silent for
    ``dead_after_s`` seconds; never ``first`` (it hosts the rendezvous store: the job cannot outlive it)."""
    now = time.time()
    for beat in job_dir.glob("agent_*"):
        host = beat.name[len("agent_") :]
        if host == first or (job_dir / f"left_out_{host}.json").exists():
            continue
        try:
            silent, text = now - beat.stat().st_mtime, beat.read_text().strip()
        except OSError:
            continue
        if silent > dead_after_s:
            slurm = slurm_problem(host)
            problem = f"its agent has been silent for {silent:.0f} s" + (f"; {slurm}" if slurm else "")
            task = int(text) if text.isdigit() else None
            leave(run_dir, job_dir, host, problem, by=socket.gethostname(), task=task)


def wait_for_a_place(
    run_dir: str, job_dir: Path, poll_s: float = 0.5, first: Optional[str] = None, dead_after_s: float = DEAD_AFTER_S
) -> Optional[str]:
    """A spare node: block until a node is left out (by itself, or by a spare for a dead one: :func:`dead_nodes`)
    and this spare claims its place (its host, returned), or the job's ranks are done (None). ``first``: the node
    that hosts the rendezvous store."""
    host = socket.gethostname()
    while not (job_dir / "done").exists():
        dead_nodes(run_dir, job_dir, first, dead_after_s)
        for marker in sorted(job_dir.glob("left_out_*.json")):
            left = json.loads(marker.read_text())["host"]
            try:
                os.close(os.open(job_dir / f"taken_{left}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            except FileExistsError:
                continue
            _record(
                run_dir,
                "spare_joined",
                host=host,
                replaces=left,
                message=f"spare node {host} takes the place of node {left}",
            )
            return left
        time.sleep(poll_s)
    return None


def mark_done(job_dir: Path) -> None:
    """The job's ranks ended (an active node's agent returned): the spares stop waiting."""
    (job_dir / "done").write_text(f"{time.time()}\n")
