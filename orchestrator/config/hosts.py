"""Nodes without a scheduler: ``cluster=hosts`` and ``cluster=torchrun`` (what is asked, torch-free).

* ``cluster.kind=hosts``: the launcher starts PyTorch's elastic agent (torchrun) on every host of
  ``cluster.hosts`` (or ``cluster.hostfile``: one host a line, ``slots=N`` as DeepSpeed and FlagScale
  hostfiles write it) over SSH (:class:`SshConfig`). World size = hosts x processes per node.
* ``cluster.kind=torchrun``: a platform (Kubernetes PyTorchJob, SkyPilot, dstack, pdsh) runs
  ``python -m orchestrator ... cluster=torchrun`` once per node and exports the rendezvous
  variables, read by :func:`node_env`. World size = nodes x processes per node.

Every refusal is one :class:`~orchestrator.errors.ConfigError` line naming the key or variable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence

from orchestrator.errors import ConfigError, LayoutError

DEFAULT_MASTER_PORT = 29500
"""torchrun's default rendezvous port (``--master-port``)."""


@dataclass
class SshConfig:
    """How the launcher reaches each host of ``cluster=hosts`` (``ssh`` options)."""

    user: Optional[str] = None
    """``ssh -l``; null = ssh's own default (your ~/.ssh/config)."""
    port: Optional[int] = None
    """``ssh -p``; null = 22 or ~/.ssh/config."""
    identity: Optional[str] = None
    """``ssh -i``: the private key file."""
    options: List[str] = field(default_factory=list)
    """Extra ``-o`` options, e.g. [StrictHostKeyChecking=accept-new, ProxyJump=bastion]."""
    connect_timeout_s: int = 10
    """``-o ConnectTimeout``: how long the reachability check waits for each host."""


@dataclass(frozen=True)
class Host:
    """One host of the list and the processes (``slots``) it offers; None: not said."""

    name: str
    slots: Optional[int] = None


def parse_hostfile(text: str, source: str) -> List[Host]:
    """Hosts of a hostfile: ``host [slots=N]`` a line, ``#`` comments and blank lines skipped.

    Raises ConfigError naming ``source:line`` for anything else (``slots`` not a positive integer,
    an unknown ``key=value``)."""
    hosts: List[Host] = []
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        slots: Optional[int] = None
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key not in ("slots", "max_slots") or not value.isdigit() or int(value) < 1:
                raise ConfigError(
                    f"cluster.hostfile={source}: line {number} {raw.strip()!r} is not 'HOST [slots=N]'; "
                    "fix: one host a line, optionally followed by slots=<processes>"
                )
            if key == "slots":
                slots = int(value)
        hosts.append(Host(words[0], slots))
    return hosts


def cluster_hosts(cluster) -> List[Host]:
    """The hosts of ``cluster=hosts``: ``cluster.hosts`` or the lines of ``cluster.hostfile`` (exactly one)."""
    if cluster.hosts and cluster.hostfile:
        raise ConfigError(
            f"cluster.hosts={list(cluster.hosts)} and cluster.hostfile={cluster.hostfile}: both set; "
            "fix: keep one (cluster.hostfile=null or cluster.hosts=[])"
        )
    if cluster.hostfile:
        path = os.path.expanduser(cluster.hostfile)
        try:
            with open(path, encoding="utf-8") as f:
                hosts = parse_hostfile(f.read(), cluster.hostfile)
        except OSError as exc:
            raise ConfigError(
                f"cluster.hostfile={cluster.hostfile}: cannot be read ({exc.strerror}); "
                "fix: the path of a file with one host a line"
            ) from None
    else:
        hosts = [Host(str(h)) for h in cluster.hosts or []]
    if not hosts:
        raise ConfigError(
            "cluster.hosts=[]: cluster=hosts needs the hosts to run on; "
            "fix: cluster.hosts=[node1,node2] or cluster.hostfile=PATH"
        )
    names = [h.name for h in hosts]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(
            f"cluster.hosts: {', '.join(twice)} listed more than once; fix: list each host once "
            "(more processes on a host: cluster.tasks_per_node or slots=N)"
        )
    return hosts


def procs_per_node(cluster, hosts: Sequence[Host] = ()) -> int:
    """Processes per node: ``cluster.tasks_per_node``, else ``cluster.gpus_per_node`` (one per GPU), else the
    hostfile's ``slots`` (the same on every host). Raises ConfigError when none says."""
    if cluster.tasks_per_node:
        return int(cluster.tasks_per_node)
    if cluster.gpus_per_node:
        return int(cluster.gpus_per_node)
    slots = {h.slots for h in hosts}
    if len(slots) == 1 and None not in slots:
        return int(slots.pop())
    if len(slots) > 1 and None not in slots:
        raise ConfigError(
            f"cluster.hostfile: hosts have different slots ({sorted(slots)}); every node runs the "
            "same number of ranks; fix: equal slots, or cluster.tasks_per_node=N"
        )
    raise ConfigError(
        f"cluster.tasks_per_node=null and cluster.gpus_per_node=0: the processes per node of "
        f"cluster.kind={cluster.kind} are unknown; fix: cluster.tasks_per_node=N (CPU ranks) or "
        "cluster.gpus_per_node=N (one rank per GPU)"
    )


def nodes_world_size(c, needed: int) -> "tuple[int, str]":
    """World size of ``cluster=hosts`` (hosts x processes per node) or ``cluster=torchrun`` (the platform's
    nodes, else ``cluster.nodes``, x processes per node). ``needed``: TP x PP x CP x DP when DP is stated
    (0: derived); a host list that cannot give exactly that many ranks is refused naming the hosts."""
    if c.kind == "torchrun":
        procs = procs_per_node(c)
        env_nodes = any(os.environ.get(v) for v in ("NNODES", "PET_NNODES", "SKYPILOT_NODE_IPS", "WORLD_SIZE"))
        env = node_env({"MASTER_ADDR": "-", "NODE_RANK": "0", **os.environ}, procs) if env_nodes else None
        nodes = env.nnodes if env else c.nodes
        said = env.nnodes_source if env else "cluster.nodes"
        if needed and nodes * procs != needed:
            raise LayoutError(
                f"{said}={nodes} nodes x {procs} processes per node = {nodes * procs} ranks, but the "
                f"layout needs TP x PP x CP x DP = {needed} (world size {needed}); fix: run on "
                f"{max(1, needed // procs)} nodes, or change the layout (parallelism.*)"
            )
        return nodes * procs, f"nodes x processes per node = {nodes} x {procs}"
    hosts = cluster_hosts(c)
    procs = procs_per_node(c, hosts)
    world = len(hosts) * procs
    if needed and world != needed and needed % procs == 0:
        names = ",".join(h.name for h in hosts)
        raise LayoutError(
            f"cluster.hosts=[{names}]: {len(hosts)} host(s) x {procs} processes = {world} ranks, but "
            f"the layout needs TP x PP x CP x DP = {needed}; fix: list {needed // procs} hosts "
            "(cluster.hosts=[...] or cluster.hostfile)"
        )
    return world, f"{len(hosts)} hosts x {procs} processes per node"


# ---------------------------------------------------------------- cluster=torchrun: the platform's variables
@dataclass(frozen=True)
class NodeEnv:
    """This node's place in a job a platform started: where rank 0's node listens, how many nodes, which one."""

    master_addr: str
    master_port: int
    nnodes: int
    node_rank: int
    source: str
    """The variables read, e.g. ``MASTER_ADDR, MASTER_PORT, NNODES, NODE_RANK``."""
    nnodes_source: str = "NNODES"
    """The variable the node count came from (``NNODES``, ``PET_NNODES``, ``SKYPILOT_NODE_IPS`` or ``WORLD_SIZE``)."""


_NNODES = ("NNODES", "PET_NNODES")
_NODE_RANK = ("NODE_RANK", "PET_NODE_RANK", "SKYPILOT_NODE_RANK", "GROUP_RANK")


def _first(environ: Mapping[str, str], names: Sequence[str]) -> "tuple[Optional[str], Optional[str]]":
    for name in names:
        if environ.get(name, "").strip():
            return name, environ[name].strip()
    return None, None


def _integer(name: str, value: str, low: int) -> int:
    if not value.lstrip("-").isdigit() or int(value) < low:
        raise ConfigError(
            f"{name}={value}: must be an integer >= {low} (cluster=torchrun reads it from the "
            "environment); fix: export it as the platform documents"
        )
    return int(value)


def node_env(environ: Mapping[str, str], procs: int) -> NodeEnv:
    """This node's rendezvous from the platform's variables (torchrun's names, Kubeflow's ``PET_*``,
    SkyPilot's ``SKYPILOT_NODE_IPS`` / ``SKYPILOT_NODE_RANK``).

    ``procs``: processes per node. ``WORLD_SIZE``, when set, is the job's rank count (torchrun's meaning):
    it must equal nodes x ``procs``, and stands in for a missing ``NNODES``. Raises ConfigError (one line)
    when a variable is missing, malformed or disagrees."""
    used: List[str] = []
    ips = [ip for ip in environ.get("SKYPILOT_NODE_IPS", "").split() if ip]
    addr_name, addr = _first(environ, ("MASTER_ADDR",))
    if addr is None and ips:
        addr_name, addr = "SKYPILOT_NODE_IPS", ips[0]
    if addr is None:
        raise ConfigError(
            "MASTER_ADDR is not set: cluster=torchrun needs node 0's address; fix: export MASTER_ADDR "
            "(Kubernetes PyTorchJob and torchrun set it; SkyPilot: SKYPILOT_NODE_IPS)"
        )
    used.append(str(addr_name))
    port_name, port = _first(environ, ("MASTER_PORT",))
    master_port = _integer("MASTER_PORT", port, 1) if port is not None else DEFAULT_MASTER_PORT
    used += [port_name] if port_name else []
    nn_name, nn = _first(environ, _NNODES)
    world_name, world = _first(environ, ("WORLD_SIZE",))
    if nn is not None:
        nnodes = _integer(str(nn_name), nn, 1)
    elif ips:
        nn_name, nnodes = "SKYPILOT_NODE_IPS", len(ips)
    elif world is not None:
        total = _integer("WORLD_SIZE", world, 1)
        if total % procs:
            raise ConfigError(
                f"WORLD_SIZE={total}: not a multiple of the {procs} processes per node; fix: "
                f"export NNODES (nodes) and WORLD_SIZE=NNODES x {procs}"
            )
        nn_name, nnodes = "WORLD_SIZE", total // procs
    else:
        raise ConfigError(
            "NNODES is not set: cluster=torchrun needs the number of nodes; fix: export NNODES "
            "(or PET_NNODES, SKYPILOT_NODE_IPS, WORLD_SIZE = nodes x processes per node)"
        )
    used.append(str(nn_name))
    if world is not None and world_name != nn_name and _integer("WORLD_SIZE", world, 1) != nnodes * procs:
        raise ConfigError(
            f"WORLD_SIZE={world} but {nn_name}={nnodes} nodes x {procs} processes per node = "
            f"{nnodes * procs} ranks; fix: export WORLD_SIZE={nnodes * procs} or unset it"
        )
    rank_name, rank = _first(environ, _NODE_RANK)
    if rank is None:
        raise ConfigError(
            "NODE_RANK is not set: cluster=torchrun needs this node's index; fix: export NODE_RANK "
            "(0 on the MASTER_ADDR node; PET_NODE_RANK / SKYPILOT_NODE_RANK are read too)"
        )
    node_rank = _integer(str(rank_name), rank, 0)
    if node_rank >= nnodes:
        raise ConfigError(f"{rank_name}={node_rank}: not below {nn_name}={nnodes}; fix: node ranks are 0..{nnodes - 1}")
    used.append(str(rank_name))
    return NodeEnv(str(addr), master_port, nnodes, node_rank, ", ".join(used), str(nn_name))
