"""The launcher side of a conversion: ``#SBATCH`` / ``srun`` / ``torchrun`` <-> ``cluster.*``.

Import (:func:`cluster`): nodes and processes per node from ``torchrun --nnodes/--nproc-per-node``,
``srun``/``#SBATCH --nodes/--ntasks-per-node``, GPUs from ``--gpus-per-node`` / ``--gres=gpu:N``
(innermost launcher first; ``--nodes/--gpus-per-node`` on our command line win). A job with
``#SBATCH`` or ``srun``, or on more than one node, becomes ``cluster=slurm``; a one-node
``torchrun`` becomes ``cluster=local`` with that many GPUs. The other ``#SBATCH`` options go to
their ``cluster.*`` key (partition, account, qos, constraint, exclude, mem, time, cpus-per-task,
signal) or, when sbatch knows them and the orchestrator does not manage them, to
``cluster.additional_parameters``; other ``srun`` options to ``cluster.srun_args``; ``export``
lines to ``cluster.env``; other shell lines to ``cluster.setup``.

Export (:func:`slurm_lines`, :func:`launch_words`): the same keys back into ``#SBATCH`` lines and
an ``srun torchrun`` / ``torchrun`` line. ``# orchestrator:`` lines (:func:`orchestrator_lines`)
carry group choices and the settings no Megatron-LM flag or launcher option says.
"""

from __future__ import annotations

import json
import re
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.convert.launcher_options import SLURM_OPTIONS
from orchestrator.convert.sources import Source, runtime_mark
from orchestrator.errors import ConfigError

TOPOLOGY = {"nodes", "nnodes", "ntasks", "ntasks-per-node", "nproc-per-node", "gpus-per-node", "gres", "gpus"}
"""Launcher options that make the world size (read by :func:`cluster`, never copied)."""
RENDEZVOUS_PORT = 29500


def orchestrator_lines(source: Source) -> Tuple[Dict[str, str], Dict[str, Any]]:
    """(group choices, settings) from ``# orchestrator: defaults g=o ...`` and ``# orchestrator: key=<json>``."""
    groups: Dict[str, str] = {}
    extras: Dict[str, Any] = {}
    for line in source.orchestrator:
        if line.startswith("defaults "):
            for item in line.split()[1:]:
                group, _, option = item.partition("=")
                groups[group] = option
            continue
        key, sep, value = line.partition("=")
        bad = ConfigError(f"# orchestrator: {line!r} is not key=<JSON value>; fix: repair or delete the line")
        if not sep:
            raise bad
        try:
            extras[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            raise bad from None
    return groups, extras


def _int(value: Optional[Tuple[str, str]], pick=lambda nums: nums[-1]) -> Optional[Tuple[int, str]]:
    """(integer, evidence) from a launcher option value such as ``8``, ``1:4``, ``gpu:a100:8``."""
    if value is None or "$" in value[0]:
        return None
    nums = [int(n) for n in re.findall(r"\d+", value[0])]
    return (pick(nums), value[1]) if nums else None


def minutes(text: str) -> Optional[int]:
    """SLURM ``--time`` (``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]``) in whole minutes (rounded up)."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text.strip())
    if not m:
        return None
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:
        h, mi, s = a, b or 0, c or 0
    elif c is not None:
        h, mi, s = a, b, c
    else:
        h, mi, s = 0, a, b or 0
    return (days or 0) * 1440 + h * 60 + mi + (1 if s else 0)


def _topology(conv, cli_nodes: Optional[int], cli_gpus: Optional[int]):
    """(nodes, ranks per node, GPUs per node), each (value, evidence) or None."""
    L = conv.source.launcher
    nodes = (cli_nodes, "--nodes (command line)") if cli_nodes else _int(L.option("nnodes", "nodes"), min)
    gpus = (
        (cli_gpus, "--gpus-per-node (command line)")
        if cli_gpus
        else (_int(L.option("gpus-per-node")) or _int(L.option("gres")))
    )
    if L.torchrun is not None:
        ranks = _int(L.option("nproc-per-node"))
    elif L.srun is not None or L.sbatch:
        ranks = _int(L.option("ntasks-per-node"))
        total = _int(L.option("ntasks"))
        if ranks is None and total and nodes:
            ranks = (total[0] // nodes[0], total[1])
    else:
        ranks = None
    if cli_gpus:
        ranks = gpus
    ranks = ranks or gpus
    return nodes, ranks, gpus or ranks


def cluster(conv, cli_nodes: Optional[int] = None, cli_gpus: Optional[int] = None) -> None:
    """Set ``cluster.*`` and ``conv.world_size`` from the source's launcher (see the module docstring)."""
    src, L = conv.source, conv.source.launcher
    nodes, ranks, gpus = _topology(conv, cli_nodes, cli_gpus)
    slurm = bool(L.sbatch) or L.srun is not None or bool(nodes and nodes[0] > 1)
    if nodes is None and ranks is not None and (cli_gpus or L.torchrun is not None):
        nodes = (1, "one node")
    if nodes and ranks:
        conv.world_size = nodes[0] * ranks[0]
        conv.set("cluster.kind", "slurm" if slurm else "local", "#SBATCH/srun" if slurm else "one-node torchrun")
        conv.set("cluster.nodes", nodes[0], nodes[1])
        conv.set("cluster.gpus_per_node", gpus[0], gpus[1])
        one_per_gpu = slurm and gpus[0] == ranks[0]
        conv.set(
            "cluster.tasks_per_node", None if one_per_gpu else ranks[0], "one task per GPU" if one_per_gpu else ranks[1]
        )
        if slurm and not conv.from_export:
            conv.groups["cluster"] = "slurm"
        conv.derived.append(
            f"world size = nodes x processes per node = {nodes[0]} x {ranks[0]} = {conv.world_size} "
            f"({nodes[1]}; {ranks[1]})"
        )
    else:
        _assume_world(conv)
    _sbatch(conv, L, ranks)
    if L.srun:
        args = [f"--{k}={v}" if v is not None else f"--{k}" for k, v in L.srun if k not in TOPOLOGY | {"cpus-per-task"}]
        if args:
            conv.set("cluster.srun_args", args, "srun options")
    ignored = [f"--{k}" + (f" {v}" if v is not None else "") for k, v in (L.torchrun or []) if k not in TOPOLOGY]
    origins = sorted(
        {o for k, _ in L.torchrun or [] if k not in TOPOLOGY for o in L.runtime.get(f"torchrun --{k}", ())}
    )
    if ignored and not conv.from_export:
        conv.not_converted.append(
            f"torchrun {' '.join(ignored)}{runtime_mark(origins)}: rendezvous is set up by the orchestrator's launcher"
        )
    if src.env:
        conv.set("cluster.env", dict(src.env), "export lines")
    if src.setup:
        conv.set("cluster.setup", list(src.setup), "shell lines before the launch")


def _assume_world(conv) -> None:
    p = [conv.get(f"parallelism.{k}_parallel_size", 1) for k in ("tensor_model", "pipeline_model", "context")]
    dp = conv.get("parallelism.data_parallel_size") or 1
    world = p[0] * p[1] * p[2] * dp
    conv.world_size = world
    conv.set("cluster.kind", "local", "assumed (no launcher line)")
    conv.set("cluster.nodes", 1, "assumed")
    conv.set("cluster.gpus_per_node", world, "assumed: TP x PP x CP x DP")
    conv.set("cluster.tasks_per_node", world, "assumed: TP x PP x CP x DP")
    conv.assumed.append(
        f"world size: no torchrun/srun/#SBATCH line and no --nodes/--gpus-per-node; assumed the "
        f"smallest, TP x PP x CP x DP = {p[0]} x {p[1]} x {p[2]} x {dp} = {world} GPUs on one node "
        "(fix: --nodes N --gpus-per-node G)"
    )


def _sbatch(conv, L, ranks) -> None:
    """The ``#SBATCH`` options that are not the topology: cluster keys, additional_parameters, or listed."""
    from orchestrator.submit.sbatch_options import MANAGED_OPTIONS, SBATCH_OPTIONS

    extra: Dict[str, Any] = {}
    one_task_per_node = L.torchrun is not None and (_int(L.option("ntasks-per-node")) or (1, ""))[0] == 1
    for key, value in L.sbatch:
        said = f"#SBATCH --{key}" + (f"={value}" if value is not None else "")
        if key in TOPOLOGY:
            continue
        if key in SLURM_OPTIONS:
            conv.set(SLURM_OPTIONS[key], value, said)
        elif key == "time" and value is not None and minutes(value):
            conv.set("cluster.timeout_min", minutes(value), f"{said} = {minutes(value)} min")
        elif key == "cpus-per-task" and value is not None and value.isdigit():
            per = max(1, int(value) // ranks[0]) if one_task_per_node and ranks else int(value)
            shared = f" / {ranks[0]} ranks per node" if per != int(value) else ""
            conv.set("cluster.cpus_per_task", per, said + shared)
        elif key == "signal" and value and re.fullmatch(r"(?:[BR]:)?(?:SIG)?USR2@\d+", value):
            conv.set("cluster.signal_delay_s", int(value.split("@")[1]), said)
        elif key in MANAGED_OPTIONS:
            conv.not_converted.append(f"{said}: set by the orchestrator ({MANAGED_OPTIONS[key]})")
        elif key in SBATCH_OPTIONS:
            extra[key] = True if value is None else value
        else:
            conv.not_converted.append(f"{said}: not an sbatch option")
    if extra:
        conv.set("cluster.additional_parameters", extra, "other #SBATCH options")


def slurm_lines(cfg, ranks: int) -> List[str]:
    """``#SBATCH`` lines for a ``cluster.kind=slurm`` config: one torchrun task per node, ``ranks`` per node."""
    c = cfg.cluster
    lines = [f"--job-name={cfg.run.name}", f"--nodes={c.nodes}", "--ntasks-per-node=1"]
    if c.gpus_per_node:
        lines.append(f"--gpus-per-node={c.gpus_per_node}")
    if c.cpus_per_task:
        lines.append(f"--cpus-per-task={c.cpus_per_task * ranks}")
    for key, dotted in SLURM_OPTIONS.items():
        value = getattr(c, dotted.split(".")[1])
        if value is not None:
            lines.append(f"--{key}={value}")
    lines.append(f"--time={c.timeout_min // 60}:{c.timeout_min % 60:02d}:00")
    lines.append(f"--signal=USR2@{c.signal_delay_s}")
    for key, value in (c.additional_parameters or {}).items():
        if value is True:
            lines.append(f"--{key}")
        elif value not in (None, False):
            lines.append(f"--{key}={value}")
    return ["#SBATCH " + line for line in lines]


def launch_words(cfg, nodes: int, ranks: int) -> List[str]:
    """``[srun ARGS] torchrun ...`` words (before ``pretrain_gpt.py``)."""
    words: List[str] = []
    if cfg.cluster.kind == "slurm":
        words += ["srun", *cfg.cluster.srun_args]
    words += ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(ranks)]
    if nodes > 1 or cfg.cluster.kind == "slurm":
        words += [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"$MASTER_ADDR:{RENDEZVOUS_PORT}",
            "--rdzv-id",
            "$SLURM_JOB_ID",
        ]
    return words
