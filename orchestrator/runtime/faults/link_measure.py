"""The link check's measurements: which cross-node links a layout uses and their bandwidth (collective).

What is measured (every rank runs :func:`measure`, one measurement at a time, the ranks meeting at a barrier of
their own gloo group between measurements, so no two share a NIC):

* ``p2p`` links: point-to-point bandwidth between ranks the layout makes talk across nodes — pipeline
  neighbours (megatron's pipeline group, in stage order; with virtual stages also last -> first) and
  data-parallel ring neighbours (the order gloo's / NCCL's ring all-reduce uses) — one rank pair per
  ordered host pair, each direction on its own (a NIC or a shaper can be slow one way). Measured as a
  ping-pong on the group the pair belongs to (``torch.distributed.send/recv``): ``megabytes`` out, 4
  bytes back; Gbit/s = 8 x bytes / the best round trip of the rounds (:data:`ROUNDS`).
* ``allreduce``: one ``all_reduce`` of ``megabytes`` on each data-parallel group spanning nodes (one
  per distinct set of hosts), as bus bandwidth (nccl-tests' busbw: 8 x bytes x 2(n-1)/n / time).

The verdict on them is :mod:`orchestrator.runtime.faults.links`'.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Dict, List, Sequence, Tuple


# ---------------------------------------------------------------- which links
def ring_pairs(ranks: Sequence[int], wrap: bool) -> List[Tuple[int, int]]:
    """Neighbours of ``ranks`` in order, (r_i, r_i+1), and (last, first) when ``wrap`` and n > 2."""
    pairs = [(ranks[i], ranks[i + 1]) for i in range(len(ranks) - 1)]
    if wrap and len(ranks) > 2:
        pairs.append((ranks[-1], ranks[0]))
    return pairs


def plan_links(
    groups: Sequence[Dict[str, List[int]]], hosts: Sequence[str], vpp: bool
) -> Tuple[List[Tuple[str, int, int]], List[List[int]]]:
    """(p2p measurements, all-reduce groups) for the layout.

    ``groups``: every rank's ``{"pp": [...], "dp": [...]}`` (global ranks, by rank); ``hosts``: every
    rank's host. p2p: ``(used_by, src, dst)`` with ``used_by`` pp or dp, one per ordered cross-node host
    pair; all-reduce: the DP groups spanning nodes, one per distinct host set.
    """
    p2p: List[Tuple[str, int, int]] = []
    seen_pairs, seen_sets = set(), set()
    reduce_groups: List[List[int]] = []
    for kind in ("pp", "dp"):
        for ranks in sorted({tuple(g[kind]) for g in groups}):
            for a, b in ring_pairs(ranks, wrap=(kind == "dp" or vpp)):
                for src, dst in ((a, b), (b, a)):
                    if hosts[src] != hosts[dst] and (hosts[src], hosts[dst]) not in seen_pairs:
                        seen_pairs.add((hosts[src], hosts[dst]))
                        p2p.append((kind, src, dst))
            host_set = tuple(sorted({hosts[r] for r in ranks}))
            if kind == "dp" and len(host_set) > 1 and host_set not in seen_sets:
                seen_sets.add(host_set)
                reduce_groups.append(list(ranks))
    return p2p, reduce_groups


# ---------------------------------------------------------------- the verdict (pure)
def interface_to(peer_host: str, backend: str) -> str:
    """The interface this rank uses towards ``peer_host``: the ``*_SOCKET_IFNAME`` the backend reads when
    set, else the one the kernel routes to the peer's address (what gloo and NCCL's socket transport pick)."""
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    if os.environ.get(var):
        return f"{os.environ[var]} ({var})"
    try:
        import psutil

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(peer_host), 9))  # no packet is sent: only the route is looked up
            local = s.getsockname()[0]
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.address == local for a in addrs):
                return f"{name} ({local}, picked by {backend}; {var} unset)"
        return f"{local} (picked by {backend}; {var} unset)"
    except OSError as exc:
        return f"unknown ({var} unset; route to {peer_host}: {exc})"


# ---------------------------------------------------------------- measuring (collective)
ROUNDS = (3, 10)
"""Rounds of measurements (each link once per round, after a warm-up round of 1/8 of the size): at least 3
while the check has run under 1.5 s (at least 1 when a slow link makes one round longer), at most 10
while under 0.5 s. Rounds interleave the links, so a moment of contention on a shared host hits every
link alike, and each link keeps its best round."""


def _more(rounds: int, elapsed: float) -> bool:
    """Whether to measure another round (round 0 is the warm-up); see :data:`ROUNDS`."""
    return rounds < 2 or (rounds <= ROUNDS[0] and elapsed < 1.5) or (rounds <= ROUNDS[1] and elapsed < 0.5)


def _ping_pong(src: int, me: int, peer: int, group, buf, small, device: str) -> float:
    """Seconds for ``buf`` src -> peer and ``small`` back (one round trip; meaningful on ``src``)."""
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    if me == src:
        dist.send(buf, peer, group=group)
        dist.recv(small, peer, group=group)
    else:
        dist.recv(buf, peer, group=group)
        dist.send(small, peer, group=group)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _allreduce(group, buf, device: str) -> float:
    """Seconds of one all-reduce of ``buf`` on ``group`` (this rank's view)."""
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    dist.all_reduce(buf, group=group)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _rounds(rank, meta, p2p, reduce_groups, nbytes: int) -> Dict[str, float]:
    """This rank's best seconds per measurement it takes part in (``p2p<i>`` on the sender, ``ar<i>``)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    me, device = rank.info.rank, rank.tensor_device
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    small = torch.zeros(1, dtype=torch.float32, device=device)
    flag = torch.zeros(1, dtype=torch.int32)
    groups = {"pp": ps.get_pipeline_model_parallel_group(), "dp": ps.get_data_parallel_group()}
    best: Dict[str, float] = {}
    rounds, t0 = 0, time.perf_counter()
    while True:
        flag[0] = int(_more(rounds, time.perf_counter() - t0))
        dist.broadcast(flag, 0, group=meta)  # rank 0's clock decides for everyone
        if not flag[0]:
            return best
        part = buf[: max(1, buf.numel() // 8)] if rounds == 0 else buf
        for i, (kind, src, dst) in enumerate(p2p):
            dist.barrier(group=meta)
            if me in (src, dst):
                took = _ping_pong(src, me, dst if me == src else src, groups[kind], part, small, device)
                if rounds and me == src:
                    best[f"p2p{i}"] = min(best.get(f"p2p{i}", took), took)
        for i, ranks in enumerate(reduce_groups):
            dist.barrier(group=meta)
            if me in ranks:
                took = _allreduce(groups["dp"], part, device)
                if rounds:
                    best[f"ar{i}"] = min(best.get(f"ar{i}", took), took)
        rounds += 1


def measure(rank, nbytes: int) -> Dict[str, object]:
    """Every cross-node link of ``rank``'s layout, measured (see the module docstring): the ``link_check``
    record without the verdict. Collective; the same result on every rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    hosts, me, backend = list(rank.info.hosts), rank.info.rank, rank.info.backend
    meta = dist.new_group(backend="gloo")  # ours: the job's groups carry the measurements only
    mine = {
        "pp": dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        "dp": dist.get_process_group_ranks(ps.get_data_parallel_group()),
    }
    groups: List[Dict[str, List[int]]] = [{} for _ in hosts]
    dist.all_gather_object(groups, mine, group=meta)
    vpp = (ps.get_virtual_pipeline_model_parallel_world_size() or 1) > 1
    p2p, reduce_groups = plan_links(groups, hosts, vpp)
    t0 = time.perf_counter()
    best = _rounds(rank, meta, p2p, reduce_groups, nbytes)
    found: Dict[str, object] = {}
    for i, (_, src, dst) in enumerate(p2p):
        if me == src:
            found[f"p2p{i}"] = (8 * nbytes / best[f"p2p{i}"] / 1e9, interface_to(hosts[dst], backend))
    for i, ranks in enumerate(reduce_groups):
        if me in ranks:
            nxt = ranks[(ranks.index(me) + 1) % len(ranks)]
            found[f"ar{i}"] = (best[f"ar{i}"], interface_to(hosts[nxt], backend) if hosts[nxt] != hosts[me] else None)
    gathered: List[Dict[str, object]] = [{} for _ in hosts]
    dist.all_gather_object(gathered, found, group=meta)
    seconds = time.perf_counter() - t0
    dist.destroy_process_group(meta)
    links: List[Dict[str, object]] = []
    for i, (kind, src, dst) in enumerate(p2p):
        gbps, interface = gathered[src][f"p2p{i}"]  # type: ignore[misc]
        links.append(
            {
                "kind": "p2p",
                "used_by": kind,
                "src": hosts[src],
                "dst": hosts[dst],
                "ranks": [src, dst],
                "gbps": round(gbps, 4),
                "interface": interface,
            }
        )
    for i, ranks in enumerate(reduce_groups):
        took = max(gathered[r][f"ar{i}"][0] for r in ranks)  # type: ignore[index]
        interface = next((gathered[r][f"ar{i}"][1] for r in ranks if gathered[r][f"ar{i}"][1]), None)  # type: ignore
        n = len(ranks)
        links.append(
            {
                "kind": "allreduce",
                "used_by": "dp",
                "hosts": sorted({hosts[r] for r in ranks}),
                "ranks": list(ranks),
                "gbps": round(8 * nbytes * 2 * (n - 1) / n / took / 1e9, 4),
                "interface": interface,
            }
        )
    return {"event": "link_check", "links": links, "megabytes": nbytes / 1e6, "seconds": round(seconds, 3)}
