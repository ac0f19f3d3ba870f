"""Where the ranks meet: the rendezvous (address, port, world size, rank) from the job's environment (submitit's
local or SLURM variables, torchrun's), the local port a launcher reserves, the SLURM port derived from the job id.
No torch import (the launcher uses it)."""

from __future__ import annotations

import hashlib
import socket
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional

from orchestrator.errors import BackendError

LOCAL_PORT_VAR = "ORCHESTRATOR_MASTER_PORT"
"""The rendezvous port a local launcher reserved for its job (the only port a local run uses)."""


SLURM_PORT_RANGE = (20000, 32000)
"""Derived SLURM ports stay below Linux's ephemeral range (32768-60999), unlike submitit's 20000-60000."""


@dataclass(frozen=True)
class Rendezvous:
    """Who this rank is and where the rendezvous store lives."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str
    """``slurm``, ``local`` (submitit LocalExecutor) or ``env`` (torchrun-style variables / one process)."""

    def as_env(self) -> Dict[str, str]:
        """The torch.distributed variables (``env://`` names) for this rank."""
        return {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
        }


def reserve_local_port(host: str = "127.0.0.1") -> int:
    """A free TCP port on ``host``, parked in TIME_WAIT for about a minute.

    The port is bound, connected to and closed server side first: until TIME_WAIT ends no other
    ``bind(0)`` or plain ``bind`` gets it, while the rendezvous store (which sets SO_REUSEADDR)
    can. This is what lets many local runs start at once without colliding.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, 0))
        server.listen(1)
        port = server.getsockname()[1]
        with socket.create_connection((host, port), timeout=10):
            conn, _ = server.accept()
            conn.close()
    return port


def local_rendezvous_env() -> Dict[str, str]:
    """Environment a local launcher passes to its job: a freshly reserved rendezvous port."""
    return {LOCAL_PORT_VAR: str(reserve_local_port())}


def derived_port(job_id: str, restart: str = "0") -> int:
    low, high = SLURM_PORT_RANGE
    digest = int(hashlib.sha256(f"{job_id}:{restart}".encode()).hexdigest()[:8], 16)
    return low + digest % (high - low)


def _tasks_on_node(spec: str, node_id: int) -> Optional[int]:
    """Tasks on node ``node_id`` from SLURM's ``SLURM_STEP_TASKS_PER_NODE`` syntax (``2(x3),1``)."""
    counts: List[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "(x" in part:
            n, times = part.rstrip(")").split("(x")
            counts += [int(n)] * int(times)
        else:
            counts.append(int(part))
    return counts[node_id] if 0 <= node_id < len(counts) else None


def first_host(node_list: str) -> str:
    """The first host name of a SLURM node list (``node[3-4,7],gpu1`` → ``node3``), via submitit's parser."""
    from submitit.slurm.slurm import _parse_node_list

    hosts = _parse_node_list(node_list)
    if not hosts:
        raise BackendError(f"SLURM node list {node_list!r} names no host")
    return hosts[0]


def _resolve(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host  # let the store report it, naming the host


def rendezvous_from_env(environ: Mapping[str, str], resolve: Callable[[str], str] = _resolve) -> Rendezvous:
    """The rendezvous of this rank from its environment (pure but for ``resolve``, a name lookup).

    Raises :class:`BackendError` when a SLURM task has no node list.
    """
    executor = environ.get("SUBMITIT_EXECUTOR", "")
    if "TORCHELASTIC_RUN_ID" in environ:  # a worker of torchrun's agent (runtime.start.agent), even inside srun
        executor = "torchrun"
    if executor == "slurm" or (not executor and "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ):
        rank, world = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
        nodes = int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_JOB_NUM_NODES") or 1)
        per_node = _tasks_on_node(
            environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE", ""),
            int(environ.get("SLURM_NODEID", 0)),
        )
        node_list = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        if not node_list:
            raise BackendError("SLURM task without SLURM_STEP_NODELIST/SLURM_JOB_NODELIST: cannot find rank 0's host")
        port = environ.get("MASTER_PORT") or derived_port(
            environ.get("SLURM_JOB_ID", "0"), environ.get("SLURM_RESTART_COUNT", "0")
        )
        return Rendezvous(
            rank,
            world,
            int(environ.get("SLURM_LOCALID", 0)),
            per_node or max(1, world // nodes),
            resolve(first_host(node_list)),
            int(port),
            "slurm",
        )
    if executor == "local":
        world = int(environ.get("SUBMITIT_LOCAL_NTASKS", 1))
        port = environ.get(LOCAL_PORT_VAR) or derived_port(environ.get("SUBMITIT_LOCAL_JOB_ID", "0"))
        return Rendezvous(
            int(environ.get("SUBMITIT_LOCAL_GLOBALID", 0)),
            world,
            int(environ.get("SUBMITIT_LOCAL_LOCALID", 0)),
            world,
            "127.0.0.1",
            int(port),
            "local",
        )
    world = int(environ.get("WORLD_SIZE", 1))
    port = environ.get("MASTER_PORT") or environ.get(LOCAL_PORT_VAR)
    if port is None and world > 1:
        raise BackendError(
            f"WORLD_SIZE={world} but MASTER_PORT is not set; fix: launch through orchestrator "
            "(python -m orchestrator ...) or torchrun"
        )
    return Rendezvous(
        int(environ.get("RANK", 0)),
        world,
        int(environ.get("LOCAL_RANK", 0)),
        int(environ.get("LOCAL_WORLD_SIZE", world)),
        environ.get("MASTER_ADDR", "127.0.0.1"),
        int(port) if port is not None else reserve_local_port(),
        "env",
    )
