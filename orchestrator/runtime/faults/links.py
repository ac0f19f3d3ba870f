"""The link check: before the first iteration of a multi-node job, the bandwidth of every cross-node
link the layout uses, and one line naming each slow one (``cluster.link_check``).

What is measured (collective: every rank runs :func:`check_links`, one measurement at a time, the ranks
meeting at a barrier of their own gloo group between measurements, so no two share a NIC):

* ``p2p`` links: point-to-point bandwidth between ranks the layout makes talk across nodes — pipeline
  neighbours (megatron's pipeline group, in stage order; with virtual stages also last -> first) and
  data-parallel ring neighbours (the order gloo's / NCCL's ring all-reduce uses) — one rank pair per
  ordered host pair, each direction on its own (a NIC or a shaper can be slow one way). Measured as a
  ping-pong on the group the pair belongs to (``torch.distributed.send/recv``): ``megabytes`` out, 4
  bytes back; Gbit/s = 8 x bytes / the best round trip of the rounds (:data:`ROUNDS`).
* ``allreduce``: one ``all_reduce`` of ``megabytes`` on each data-parallel group spanning nodes (one
  per distinct set of hosts), as bus bandwidth (nccl-tests' busbw: 8 x bytes x 2(n-1)/n / time).

The rule (:func:`judge`): a link is slow when it is below ``min_fraction`` x the median of the *other*
links of its kind, or below ``min_gbps`` when set. Leaving the link itself out keeps a bad link from
pulling its own reference down, and with two links of a kind each is compared with the other: on two
nodes the two directions of their one host pair, so a link slow one way is named, and one slow both ways
only by ``min_gbps``. A kind with a single link (one data-parallel group spanning nodes: one all-reduce)
has no peer: only ``min_gbps`` judges it. A check that finds a slow link measures again (at most
:data:`CONFIRMATIONS` times, each link keeping its best) and names only what stays slow. Intra-node links are never a reference (NVLink or shared memory
is legitimately many times faster than any NIC). Results go to ``metrics.jsonl`` (``link_check``) and
every manifest; ``action=refuse`` ends the job before training with :class:`SlowLinkError`.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

from orchestrator.errors import SlowLinkError

CONFIRMATIONS = 2
"""Measurements again, at most, of a check that found a slow link; each link keeps its best. A link is named only
when its best stays below the rule: a shaped or mis-routed link is slow every time, while on a busy machine (CI at
load 4-8: 12.9 against 26.6 Gbit/s on an unshaped veth) one measurement alone named a link that was not."""

FIX = (
    "fix: check that the interface is the fast fabric (`ip -s link`, `ib_write_bw` between the two hosts), "
    "set NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME in cluster.env to the fast one, or leave a host out "
    "(cluster.exclude={hosts})"
)


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
def judge(links: List[Dict[str, object]], min_fraction: float, min_gbps: Optional[float]) -> List[Dict[str, object]]:
    """Set ``reference_gbps`` (median of the other links of the kind; None without one) and ``slow`` on
    every link (see the module docstring); returns the slow ones."""
    slow = []
    for link in links:
        others = [float(o["gbps"]) for o in links if o is not link and o["kind"] == link["kind"]]
        ref = statistics.median(others) if others else None
        gbps = float(link["gbps"])  # type: ignore[arg-type]
        link["reference_gbps"] = ref
        link["slow"] = bool((ref is not None and gbps < min_fraction * ref) or (min_gbps and gbps < min_gbps))
        if link["slow"]:
            slow.append(link)
    return slow


def describe(link: Dict[str, object], min_fraction: float, min_gbps: Optional[float]) -> str:
    """One line naming a slow link: hosts, ranks, interface, measured vs reference, the fix."""
    what = {"pp": "pipeline neighbours", "dp": "data-parallel ring neighbours"}.get(str(link.get("used_by")), "")
    hosts = list(link["hosts"]) if link["kind"] == "allreduce" else [link["src"], link["dst"]]  # type: ignore
    if link["kind"] == "allreduce":
        where = f"all-reduce of data-parallel group {link['ranks']} on {', '.join(link['hosts'])}"  # type: ignore
    else:
        where = f"{link['src']} -> {link['dst']} (ranks {link['ranks'][0]} -> {link['ranks'][1]}, {what})"  # type: ignore
    ref = link.get("reference_gbps")
    versus = []
    if ref is not None:
        versus.append(f"{ref:.3g} Gbit/s, the median of the other {link['kind']} links (below {min_fraction:g}x)")
    if min_gbps and float(link["gbps"]) < min_gbps:  # type: ignore[arg-type]
        versus.append(f"cluster.link_check.min_gbps={min_gbps:g}")
    return (
        f"slow link: {where} over {link['interface']}: {float(link['gbps']):.3g} Gbit/s vs "  # type: ignore
        f"{' and '.join(versus)}; {FIX.format(hosts=' or '.join(map(str, hosts)))}"
    )


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


def check_links(rank) -> Optional[Dict[str, object]]:
    """The link check of a multi-node job (``cluster.link_check``), after the rendezvous and before anything
    else: measures, judges, prints one line per slow link (rank 0) and returns the ``link_check`` record
    (``links``, ``slow``: their lines, ``action``); None on one node or with ``action=off``. Collective.

    Raises :class:`SlowLinkError` on every rank with ``action=refuse`` and a slow link."""
    lc = rank.cfg.cluster.link_check
    if lc.action == "off" or len(set(rank.info.hosts)) < 2:
        return None
    nbytes = int(lc.megabytes * 1e6) // 4 * 4
    record = measure(rank, nbytes)
    slow = judge(record["links"], lc.min_fraction, lc.min_gbps)  # type: ignore[arg-type]
    for _ in range(CONFIRMATIONS if slow else 0):  # the same verdict on every rank: all measure again, or none
        again = measure(rank, nbytes)
        for link, other in zip(record["links"], again["links"]):  # type: ignore[call-overload]
            link["gbps"] = max(link["gbps"], other["gbps"])  # a link's best: a busy moment is not its speed
        record["seconds"] = round(record["seconds"] + again["seconds"], 3)  # type: ignore[operator]
        record["measurements"] = record.get("measurements", 1) + 1  # type: ignore[operator]
        slow = judge(record["links"], lc.min_fraction, lc.min_gbps)  # type: ignore[arg-type]
        if not slow:
            break
    lines = [describe(link, lc.min_fraction, lc.min_gbps) for link in slow]
    record.update(slow=lines, action=lc.action, min_fraction=lc.min_fraction, min_gbps=lc.min_gbps, time=time.time())
    if rank.rank0:
        kinds = {}
        for link in record["links"]:  # type: ignore[union-attr]
            kinds.setdefault(link["kind"], []).append(link["gbps"])
        said = "; ".join(f"{k} {min(v):.3g}..{max(v):.3g} Gbit/s ({len(v)})" for k, v in kinds.items())
        print(
            f"[orchestrator] link check: {said} in {record['seconds']} s{'' if lines else '; no slow link'}", flush=True
        )
        for line in lines if lc.action == "warn" else []:  # refuse: the error is the one line
            print(f"[orchestrator] warning: {line}", flush=True)
    if lines and lc.action == "refuse":
        raise SlowLinkError(
            f"cluster.link_check.action=refuse: {lines[0]}"
            f"{f' (and {len(lines) - 1} more)' if len(lines) > 1 else ''}; "
            f"or cluster.link_check.action=warn to train anyway"
        )
    return record


def links_only(cfg, layout) -> Dict[str, object]:
    """``python -m orchestrator check links``'s job (``cluster.link_check.action=only``): rendezvous and
    megatron's parallel state, the check, teardown; no model, data or checkpoint. Returns the summary the
    launcher reads (``link_check``: the record; rank 0 is the logging rank). Collective."""
    from orchestrator.runtime.rank.build import Rank
    from orchestrator.runtime.rank.distributed import init_distributed, shutdown
    from orchestrator.runtime.rank.model import initialize_parallel_state

    info = init_distributed(cfg)
    if info.device == "cpu":
        from orchestrator.runtime.rank import cpu

        cpu.activate()  # megatron's CUDA-only spots (its RNG tracker) on CPU, as build_rank does
    try:
        initialize_parallel_state(cfg, cfg.training.seed, info.device)
        rank = Rank(
            cfg=cfg,
            layout=layout,
            info=info,
            tokenizer=None,
            built=None,  # type: ignore
            is_logger=info.rank == 0,
        )
        record = check_links(rank)
    finally:
        shutdown()
    return {
        "status": "completed",
        "iteration": 0,
        "logging_rank": info.rank == 0,
        "link_check": record,
        "hosts": list(info.hosts),
    }
