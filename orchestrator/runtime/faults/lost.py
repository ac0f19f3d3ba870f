"""Which ranks a crash took: a lost node (``node failure``) or one rank's crash (``crashed``).

When a peer dies, the survivors' collectives fail within a second. Each rank that ends an attempt
in a crash first records ``rank_alive`` (its rank, this attempt) in the run's history; the rank that
records the crash then waits up to ``wait_s`` for the others' and reads every rank's host from its
heartbeat file (:mod:`orchestrator.runtime.faults.watchdog`). Every rank of some host(s) silent while
another host's answered: those nodes were lost. Otherwise (one rank killed, a one-host job, no
heartbeat files because ``training.hang_timeout_s`` is null): a crash.

Under torch elastic's agents (in-place restarts), the agent of a rank that a signal ended (SIGKILL: the OOM killer,
a user) records it the moment it dies (:data:`SIGNALLED_EVENT`, :mod:`orchestrator.runtime.start.worker_deaths`);
its peers see only a broken collective. The rank that records the crash then names that rank first (``rank 2
(node2) died: exit by signal 9, SIGKILL; then rank 3 (node2) crashed ...: Connection reset by peer``), never
its own broken connection alone. Torch-free.
"""

from __future__ import annotations

import time
from typing import Dict, List, Mapping, Set, Tuple

from orchestrator.ckpt import history
from orchestrator.ckpt.history import SIGNALLED_EVENT
from orchestrator.errors import PEER_LOST
from orchestrator.runtime.faults.watchdog import heartbeat_path, read_heartbeat

ALIVE_EVENT = "rank_alive"


def report_alive(run_dir: str, job_id: str, attempt: int, rank: int) -> None:
    """This rank outlived the failure of attempt ``attempt`` of ``job_id`` (a JSONL append)."""
    history.record_event(run_dir, ALIVE_EVENT, job_id=str(job_id), attempt=int(attempt), rank=int(rank))


def lost_hosts(alive: Set[int], hosts: Mapping[int, str]) -> Dict[str, List[int]]:
    """Host -> its ranks, for the hosts none of whose ranks is in ``alive``, when some other host's is."""
    by_host: Dict[str, List[int]] = {}
    for rank, host in sorted(hosts.items()):
        by_host.setdefault(host, []).append(rank)
    lost = {host: ranks for host, ranks in by_host.items() if not alive & set(ranks)}
    return lost if 0 < len(lost) < len(by_host) else {}


def _hosts(run_dir: str, job_id: str, attempt: int, world_size: int) -> Dict[int, str]:
    hosts: Dict[int, str] = {}
    for rank in range(world_size):
        rec = read_heartbeat(heartbeat_path(run_dir, rank))
        if rec and str(rec.get("job_id")) == str(job_id) and rec.get("attempt") == attempt and rec.get("host"):
            hosts[rank] = str(rec["host"])
    return hosts


def alive_since(run_dir: str, job_id: str, attempt: int, since: float = 0.0) -> Set[int]:
    """Ranks that reported :func:`report_alive` for attempt ``attempt`` of ``job_id`` at or after ``since`` (an
    in-place restart keeps the attempt: its ranks' start)."""
    return {
        int(r["rank"])
        for r in history.read_records(run_dir)
        if r.get("event") == ALIVE_EVENT
        and str(r.get("job_id")) == str(job_id)
        and r.get("attempt") == attempt
        and float(r.get("time") or 0) >= since
    }


def signalled_since(run_dir: str, job_id: str, attempt: int, since: float = 0.0) -> Dict[int, str]:
    """``{rank: "rank 2 (node2) died: exit by signal 9, SIGKILL"}`` for the ranks of attempt ``attempt`` of ``job_id``
    that a signal ended at or after ``since`` (:data:`SIGNALLED_EVENT`, written by their node's agent), the first
    record of each rank."""
    found: Dict[int, str] = {}
    for r in history.read_records(run_dir):
        if (
            r.get("event") == SIGNALLED_EVENT
            and str(r.get("job_id")) == str(job_id)
            and r.get("attempt") == attempt
            and float(r.get("time") or 0) >= since
        ):
            found.setdefault(int(r["rank"]), str(r.get("message") or f"rank {r['rank']} died: {r.get('how')}"))
    return found


def _signalled(run_dir: str, job_id: str, attempt: int, since: float, message: str, wait_s: float) -> Dict[int, str]:
    """:func:`signalled_since`, waited for up to ``wait_s`` when ``message`` is a peer's loss seen from this rank (the
    agent's record follows the death by milliseconds; the broken connection may come first)."""
    deadline = time.monotonic() + (wait_s if any(w in message for w in PEER_LOST) else 0.0)
    while True:
        found = signalled_since(run_dir, job_id, attempt, since)
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(0.1)


def crash_cause(
    run_dir: str,
    job_id: str,
    attempt: int,
    world_size: int,
    message: str = "",
    look: bool = True,
    wait_s: float = 3.0,
    since: float = 0.0,
    agent: bool = False,
) -> Tuple[str, str]:
    """(``node failure`` or ``crashed``, ``message`` led by the lost nodes: ``node node2 lost (ranks
    2,3): ...``) for the crash of attempt ``attempt``; call after :func:`report_alive`. Waits at most
    ``wait_s`` seconds, only for a job whose ranks span several hosts; ``look=False``: ``crashed``.
    ``agent``: torch elastic's agents run the ranks; a rank a signal ended leads the message (``crashed``)."""
    dead = _signalled(run_dir, job_id, attempt, since, message, wait_s) if agent else {}
    if dead:
        return "crashed", "; ".join(dead[r] for r in sorted(dead)) + (f"; then {message}" if message else "")
    hosts = _hosts(run_dir, job_id, attempt, world_size) if look else {}
    if len(hosts) < world_size or len(set(hosts.values())) < 2:
        return "crashed", message
    deadline = time.monotonic() + wait_s
    while True:
        alive = alive_since(run_dir, job_id, attempt, since)
        if len(alive) >= world_size or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    lost = lost_hosts(alive, hosts)
    if not lost:
        return "crashed", message
    nodes = "; ".join(f"node {host} lost (ranks {','.join(map(str, ranks))})" for host, ranks in lost.items())
    return "node failure", f"{nodes}: {message}" if message else nodes
