"""The link check: before the first iteration of a multi-node job, the bandwidth of every cross-node
link the layout uses, and one line naming each slow one (``cluster.link_check``).

What is measured, and how: :mod:`orchestrator.runtime.faults.link_measure`.

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

import statistics
import time
from typing import Dict, List, Optional

from orchestrator.errors import SlowLinkError
from orchestrator.runtime.faults.link_measure import measure

CONFIRMATIONS = 2
"""Measurements again, at most, of a check that found a slow link; each link keeps its best. A link is named only
when its best stays below the rule: a shaped or mis-routed link is slow every time, while on a busy machine (CI at
load 4-8: 12.9 against 26.6 Gbit/s on an unshaped veth) one measurement alone named a link that was not."""

FIX = (
    "fix: check that the interface is the fast fabric (`ip -s link`, `ib_write_bw` between the two hosts), "
    "set NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME in cluster.env to the fast one, or leave a host out "
    "(cluster.exclude={hosts})"
)


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
