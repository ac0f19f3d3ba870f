"""Which ``sbatch`` options a user may pass (``cluster.additional_parameters``), which ones the orchestrator sets
itself (and from which config key), and the checks that keep a typed value from becoming shell. Pure Python."""

from __future__ import annotations

import difflib
import re
from typing import Any, Dict

from orchestrator.errors import ConfigError

# sbatch long options (slurm 22.05 `sbatch --help`, plus options of later releases). A key of
# cluster.additional_parameters must be one of them (after `_` -> `-`), so a typo fails before
# the job is queued instead of being rejected by sbatch or, worse, silently ignored.
SBATCH_OPTIONS = frozenset(
    """
    account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment
    constraint container container-id contiguous core-spec cores-per-socket cpu-freq cpus-per-gpu
    cpus-per-task deadline delay-boot dependency distribution error exclude exclusive export
    export-file extra extra-node-info get-user-env gid gpu-bind gpu-freq gpus gpus-per-node
    gpus-per-socket gpus-per-task gres gres-flags hint hold ignore-pbs input job-name
    kill-on-invalid-dep licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu
    mincpus network nice no-kill no-requeue nodefile nodelist nodes ntasks ntasks-per-core
    ntasks-per-gpu ntasks-per-node ntasks-per-socket oom-kill-step open-mode output overcommit
    oversubscribe partition power prefer priority profile propagate qos reboot requeue reservation
    resv-ports segment signal sockets-per-node spread-job switches thread-spec threads-per-core time
    time-min tmp tres-bind tres-per-task uid use-min-nodes wait-all-nodes wckey x11
    """.split()
)


# Options the orchestrator sets itself (from ClusterConfig or through submitit): giving them in
# cluster.additional_parameters would silently override the managed value. Value: what to set instead.
MANAGED_OPTIONS: Dict[str, str] = {
    "job-name": "run.name",
    "partition": "cluster.partition",
    "account": "cluster.account",
    "qos": "cluster.qos",
    "constraint": "cluster.constraint",
    "exclude": "cluster.exclude",
    "mem": "cluster.mem",
    "time": "cluster.timeout_min",
    "nodes": "cluster.nodes",
    "ntasks": "cluster.nodes and cluster.tasks_per_node",
    "ntasks-per-node": "cluster.tasks_per_node",
    "cpus-per-task": "cluster.cpus_per_task",
    "gpus-per-node": "cluster.gpus_per_node",
    "gpus": "cluster.gpus_per_node (one task per GPU)",
    "gpus-per-task": "cluster.gpus_per_node (one task per GPU)",
    "ntasks-per-gpu": "cluster.gpus_per_node and cluster.tasks_per_node",
    "signal": "cluster.signal_delay_s",
    "requeue": "cluster.max_num_timeout (0 disables requeueing)",
    "no-requeue": "cluster.max_num_timeout=0",
    "no-kill": "cluster.spare_nodes (a job with spares survives a node's failure)",
    "output": "nothing: submitit writes the logs under its folder",
    "error": "nothing: submitit writes the logs under its folder",
    "open-mode": "nothing: submitit appends to its logs (a requeued job continues them)",
    "array": "nothing: one job per run (sweeps submit one job per point)",
    "wrap": "nothing: the script is generated",
}


# Keys of submitit's renderer that are not sbatch options: a user putting them into
# additional_parameters means another config key.
_NOT_SBATCH = {
    "setup": "cluster.setup",
    "srun-args": "cluster.srun_args",
    "signal-delay-s": "cluster.signal_delay_s",
    "timeout-min": "cluster.timeout_min",
    "tasks-per-node": "cluster.tasks_per_node",
    "max-num-timeout": "cluster.max_num_timeout",
    "env": "cluster.env",
    "python": "cluster.python",
}


MEM_RE = re.compile(r"^\d+([KMGT]B?)?$", re.IGNORECASE)


ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


_OPTION_RE = re.compile(r"^[a-z][a-z0-9-]*$")


_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")


def no_control(key: str, value: Any) -> str:
    """``str(value)``, refusing control characters (a newline would end an ``#SBATCH`` comment)."""
    text = str(value)
    if _CONTROL_RE.search(text):
        raise ConfigError(
            f"{key}={text!r} contains a control character (newline, tab, ...), which cannot go into an "
            f"sbatch directive; fix: remove it"
        )
    return text


def additional_parameters(cfg) -> Dict[str, Any]:
    """Validated ``cluster.additional_parameters`` plus the managed ``requeue`` flag, and ``no-kill`` for a job with
    spare nodes (``cluster.spare_nodes``: SLURM must not end it when one of its nodes fails).

    Keys are normalised to sbatch spelling (``_`` -> ``-``). A ``false`` or ``null`` value means
    "option not given" and is dropped (submitit would render ``--exclusive=False``).
    """
    c = cfg.cluster
    out: Dict[str, Any] = {}
    seen: Dict[str, str] = {}
    for raw_key, value in (c.additional_parameters or {}).items():
        key = str(raw_key).strip().lstrip("-").replace("_", "-").lower()
        where = f"cluster.additional_parameters.{raw_key}"
        if not _OPTION_RE.match(key):
            raise ConfigError(
                f"{where}: {raw_key!r} is not an sbatch option name; fix: use e.g. reservation or mail-type"
            )
        if key in seen:
            raise ConfigError(
                f"{where}: the same sbatch option as cluster.additional_parameters.{seen[key]} (--{key}); fix: keep one"
            )
        seen[key] = str(raw_key)
        if key in MANAGED_OPTIONS:
            raise ConfigError(
                f"{where}: --{key} is set by the orchestrator and must not be overridden here; "
                f"fix: remove it and set {MANAGED_OPTIONS[key]}"
            )
        if key in _NOT_SBATCH:
            raise ConfigError(f"{where}: not an sbatch option; fix: set {_NOT_SBATCH[key]} instead")
        if key not in SBATCH_OPTIONS:
            close = difflib.get_close_matches(key, sorted(SBATCH_OPTIONS), n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise ConfigError(
                f"{where}: --{key} is not an sbatch option; {hint}"
                f"fix: use a valid sbatch long option name (see `man sbatch`)"
            )
        if key in ("mem-per-cpu", "mem-per-gpu") and c.mem is not None:
            raise ConfigError(
                f"{where} and cluster.mem={c.mem!r} both set the memory; fix: keep one (cluster.mem=null)"
            )
        if value is None or value is False:
            continue
        if value is True:
            out[key] = True
            continue
        if isinstance(value, (list, dict)):
            raise ConfigError(
                f"{where}={value!r}: sbatch option values are scalars; fix: e.g. a comma-separated string"
            )
        out[key] = no_control(where, value)
    if c.max_num_timeout > 0:
        out["requeue"] = True
    if int(getattr(c, "spare_nodes", 0) or 0) > 0 and int(getattr(c, "max_restarts", 0) or 0) > 0:
        out["no-kill"] = True  # a node's death must not end the job: a spare takes its place (runtime.start.spares)
    return out
