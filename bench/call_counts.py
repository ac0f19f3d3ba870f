"""Count, in every process of a job, the collectives it calls and its host reads of tensor values.

``bench/overhead.py --counts`` puts a ``sitecustomize.py`` that imports this module on the job's
``PYTHONPATH`` with ``CALL_COUNTS_DIR`` set. :func:`install` then wraps, in each process, torch.distributed's
collectives and point-to-point calls (one count per call, by name) and the ``Tensor`` methods that read a
value on the host (``item``, ``tolist``, ``__float__``, ``__int__``, ``__bool__``: on a GPU each is a device
synchronisation), and writes ``<CALL_COUNTS_DIR>/<pid>.json`` (``{"rank", "collectives", "host_reads"}``)
when the process ends (``atexit``, or ``os._exit``, which forked ranks and submitit's fast exit use). A
forked child starts from zero. Nothing else changes: every wrapped call runs the real function.

Per-iteration numbers come from two runs that differ only in their iteration count: (counts at N2 - counts
at N1) / (N2 - N1), so start-up and shutdown cancel.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter_tensor",
    "gather",
    "broadcast",
    "barrier",
    "all_to_all_single",
    "batch_isend_irecv",
    "send",
    "recv",
)
"""Not ``isend`` / ``irecv``: ``P2POp`` checks its op *is* one of them, so they stay unwrapped (megatron's
batched point-to-point calls count once per ``batch_isend_irecv``)."""
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__")

_counts = {"collectives": {}, "host_reads": {}, "rank": None}


def _reset() -> None:
    _counts["collectives"], _counts["host_reads"], _counts["rank"] = {}, {}, None


def _dump() -> None:
    out = os.environ.get("CALL_COUNTS_DIR")
    if out and (_counts["collectives"] or _counts["host_reads"]):
        with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
            json.dump(_counts, f)


WHERE = bool(os.environ.get("CALL_COUNTS_WHERE"))
"""``CALL_COUNTS_WHERE=1``: count by name and caller (the first frame outside torch, ``file:line``)."""


def _caller() -> str:
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    return f"{'/'.join(path.split('/')[-3:])}:{frame.f_lineno}"


def _wrap(owner, name: str, kind: str, dist=None) -> None:
    real = getattr(owner, name, None)
    if real is None:
        return

    def counted(*args, **kwargs):
        table, key = _counts[kind], name
        if WHERE:
            key = f"{name}@{_caller()}"
        table[key] = table.get(key, 0) + 1
        if dist is not None and _counts["rank"] is None and dist.is_initialized():
            _counts["rank"] = dist.get_rank()
        return real(*args, **kwargs)

    setattr(owner, name, counted)


def install() -> None:
    """Wrap the calls (see the module docstring); a no-op without ``CALL_COUNTS_DIR``."""
    if not os.environ.get("CALL_COUNTS_DIR"):
        return
    import torch
    import torch.distributed as dist

    for name in COLLECTIVES:
        _wrap(dist, name, "collectives", dist)
    for name in HOST_READS:
        _wrap(torch.Tensor, name, "host_reads")
    os.register_at_fork(after_in_child=_reset)
    atexit.register(_dump)
    real_exit = os._exit

    def exiting(code):
        _dump()
        real_exit(code)

    os._exit = exiting


SITECUSTOMIZE = f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})\nimport call_counts\ncall_counts.install()\n"
"""The ``sitecustomize.py`` that installs the counting in every Python process started with its directory on
``PYTHONPATH``."""


def read(directory: str) -> list:
    """Every process's counts written under ``directory``."""
    return [json.load(open(os.path.join(directory, f))) for f in sorted(os.listdir(directory)) if f.endswith(".json")]


def per_iteration(run, n1: int, n2: int) -> dict:
    """``run(iterations)`` twice (``n1`` then ``n2`` iterations) with counting on in every process it starts:
    ``{rank: {"collectives": {name: calls per iteration}, "host_reads": {...}}}`` (processes that never joined a
    process group left out)."""
    import tempfile

    totals = []
    for n in (n1, n2):
        with tempfile.TemporaryDirectory() as d:
            Path(d, "sitecustomize.py").write_text(SITECUSTOMIZE)
            saved = {k: os.environ.get(k) for k in ("CALL_COUNTS_DIR", "PYTHONPATH")}
            os.environ["CALL_COUNTS_DIR"] = d
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (d, saved["PYTHONPATH"]) if p)
            try:
                run(n)
            finally:
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            totals.append({c["rank"]: c for c in read(d) if c["rank"] is not None})
    out = {}
    for rank in sorted(set(totals[0]) & set(totals[1])):
        out[rank] = {
            kind: {
                name: (totals[1][rank][kind].get(name, 0) - totals[0][rank][kind].get(name, 0)) / (n2 - n1)
                for name in sorted(set(totals[0][rank][kind]) | set(totals[1][rank][kind]))
            }
            for kind in ("collectives", "host_reads")
        }
    return out


BLOCKING = ("barrier",)
"""Collectives that block the calling host until every rank arrives (on NCCL too: the barrier's work is waited
on and the device synchronised): host synchronisations as much as a value's read is."""


def host_syncs(c: dict) -> float:
    """A rank's host synchronisations per iteration: its host reads plus its blocking collectives."""
    return sum(c["host_reads"].values()) + sum(v for k, v in c["collectives"].items() if k.split("@")[0] in BLOCKING)


def describe(counts: dict) -> str:
    """``rank r: N collectives (name x n, ...), M host reads (...); S host syncs`` per rank, per iteration."""
    lines = []
    for rank, c in counts.items():
        parts = []
        for kind in ("collectives", "host_reads"):
            named = {k: v for k, v in c[kind].items() if abs(v) > 1e-9}
            listed = ", ".join(f"{k} {v:g}" for k, v in named.items())
            parts.append(f"{sum(named.values()):g} {kind.replace('_', ' ')} ({listed or 'none'})")
        parts.append(f"{host_syncs(c):g} host syncs (reads + barriers)")
        lines.append(f"  rank {rank}: " + "; ".join(parts))
    return "\n".join(lines)


def compare(ours: dict, bare: dict) -> str:
    """Per rank, ours minus the bare loop's collectives and host syncs per iteration (the target: none more)."""
    lines = []
    for rank in sorted(set(ours) & set(bare)):
        extra_c = sum(ours[rank]["collectives"].values()) - sum(bare[rank]["collectives"].values())
        extra_s = host_syncs(ours[rank]) - host_syncs(bare[rank])
        verdict = "none more" if extra_c < 1e-9 and extra_s < 1e-9 else "MORE than the bare loop"
        lines.append(f"  rank {rank}: collectives {extra_c:+g}, host syncs {extra_s:+g} ({verdict})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit("import this module (bench/overhead.py --counts)")
