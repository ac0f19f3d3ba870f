"""What the SLURM partition can hold, asked of ``sinfo`` before anything is queued.

A job that asks for more nodes than its partition has is accepted by ``sbatch`` and then waits forever
(``squeue``: ``PD (PartitionNodeLimit)``); a partition that does not exist makes ``sbatch`` fail after the
data were prepared and the run directory written. Both are the user's to fix, in one line, before that.
When ``sinfo`` is not here or does not answer (a login node without the client, a slow controller), nothing
is checked: ``sbatch`` says what it says.
"""

from __future__ import annotations

import shutil
import subprocess
from typing import Dict, Optional

from orchestrator.errors import ConfigError

SINFO_TIMEOUT_S = 15.0


def partitions() -> Optional[Dict[str, int]]:
    """``{partition: nodes}`` from ``sinfo`` (the default partition under the key ``""`` too), or None when
    ``sinfo`` is missing, fails or does not answer within :data:`SINFO_TIMEOUT_S`."""
    if shutil.which("sinfo") is None:
        return None
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%P %D"], capture_output=True, text=True, timeout=SINFO_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    nodes: Dict[str, int] = {}
    for line in out.stdout.splitlines():  # one line per partition and node state: add them up
        name, _, count = line.strip().partition(" ")
        if not count.strip().isdigit():
            continue
        for key in {name.rstrip("*"), *([""] if name.endswith("*") else [])}:
            nodes[key] = nodes.get(key, 0) + int(count)
    return nodes


def check_partition(cfg) -> None:
    """ConfigError (one line) when ``cluster.partition`` does not exist, or has fewer nodes than the job asks
    for (``cluster.nodes`` + ``cluster.spare_nodes``); nothing when ``sinfo`` cannot tell."""
    c = cfg.cluster
    found = partitions()
    if not found:
        return
    name = c.partition or ""
    shown = c.partition or "(the default partition)"
    if name not in found:
        names = sorted(k for k in found if k)
        raise ConfigError(
            f"cluster.partition={c.partition}: no such partition (sinfo lists {', '.join(names)}); "
            f"fix: cluster.partition={names[0] if names else '<one of them>'}"
        )
    asked = int(c.nodes) + int(getattr(c, "spare_nodes", 0) or 0)
    if asked > found[name]:
        spares = f" + cluster.spare_nodes={c.spare_nodes}" if getattr(c, "spare_nodes", 0) else ""
        raise ConfigError(
            f"cluster.nodes={c.nodes}{spares}: partition {shown} has {found[name]} node(s) (sinfo), so "
            f"the job would wait forever (PartitionNodeLimit); fix: at most {found[name]} node(s), or "
            f"another cluster.partition"
        )
