"""Render, then submit: the SLURM side of a job as pure functions of the config.

:func:`executor_parameters` maps :class:`~orchestrator.config.schema.ClusterConfig` onto the keyword
arguments of submitit's generic ``update_parameters`` names; :func:`slurm_executor_parameters` gives
the same in ``SlurmExecutor.update_parameters`` names (constructor: ``python=python_command(cfg)``),
what :func:`orchestrator.submit.executor.make_executor` submits with. :func:`render_sbatch`
feeds the same parameters to submitit's own renderer (``submitit.slurm.slurm._make_sbatch_string``,
the function ``SlurmExecutor`` calls when it writes the script it hands to ``sbatch``), so the
preview *is* the submitted script; a test compares the two byte for byte.

No torch, no megatron, no subprocess: this runs on a login node in milliseconds.

Quoting — what a user types never becomes shell by accident:

* ``#SBATCH`` values (job name, partition, account, qos, constraint, exclude, mem, log paths,
  ``additional_parameters``) are ``shlex.quote``-d by submitit and read by ``sbatch`` (not bash;
  they are comments to the shell). Control characters (a newline could end the comment and start a
  shell line) are refused here with a :class:`ConfigError`.
* The srun line: log paths and every ``cluster.srun_args`` item are quoted by submitit; the python
  executable (``cluster.python``, a path, not a command line) and the submitit folder are quoted here.
* ``cluster.env`` becomes ``export KEY=<shlex.quote(value)>`` lines; keys must be identifiers.
* ``cluster.setup`` lines are **shell on purpose** (``module load``, ``source venv/bin/activate``):
  they are copied verbatim. Everything else is data.

Script layout (the ``# setup`` section, in this order): ``unset`` of the torch.distributed variables
the submitting shell may carry (sbatch exports the submitter's environment and submitit's
``TorchDistributedEnvironment.export()`` refuses to overwrite them), then ``cluster.setup``, then
the ``cluster.env`` exports (so presets win over whatever a ``module load`` sets).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

from orchestrator.errors import ConfigError, LayoutError
from orchestrator.submit.sbatch_options import (
    ENV_KEY_RE,
    MEM_RE,
    additional_parameters,
    no_control,
)

# Variables a submitting shell may carry that would confuse the job's torch.distributed setup.
_DIST_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def job_name(cfg) -> str:
    """The SLURM job name of a run: ``run.name`` (validated, quoted later by submitit)."""
    name = cfg.run.name or "orchestrator"
    return no_control("run.name", name)


def tasks_per_node(cfg) -> int:
    """``cluster.tasks_per_node``, or one task per GPU when null."""
    c = cfg.cluster
    tasks = c.tasks_per_node if c.tasks_per_node is not None else c.gpus_per_node
    if not tasks or tasks < 1:
        raise LayoutError(
            f"cluster.tasks_per_node={c.tasks_per_node} and cluster.gpus_per_node={c.gpus_per_node}: "
            f"the number of tasks per node is unknown; fix: set cluster.tasks_per_node (CPU jobs) "
            f"or cluster.gpus_per_node (one task per GPU)"
        )
    return tasks


def _setup_lines(cfg) -> List[str]:
    """The ``# setup`` section: unset dist vars, ``cluster.setup`` (shell), ``cluster.env`` exports (quoted)."""
    c = cfg.cluster
    lines = ["unset " + " ".join(_DIST_VARS)]
    for i, line in enumerate(c.setup or []):
        if not isinstance(line, str):
            raise ConfigError(f"cluster.setup[{i}]={line!r} must be a shell line (string)")
        lines.append(line)
    for key, value in (c.env or {}).items():
        if not ENV_KEY_RE.match(str(key)):
            raise ConfigError(
                f"cluster.env.{key}: {key!r} is not a valid environment variable name "
                f"(letters, digits, underscore; not starting with a digit)"
            )
        if value is None:
            raise ConfigError(f"cluster.env.{key} is null; fix: give a string value or remove the key")
        if isinstance(value, bool):
            value = "1" if value else "0"
        lines.append(f"export {key}={shlex.quote(str(value))}")
    return lines


def executor_parameters(cfg, world_size: int) -> Dict[str, Any]:
    """Keyword arguments for ``submitit.AutoExecutor(cluster="slurm").update_parameters``.

    Generic submitit names where submitit has one (``name``, ``timeout_min``, ``nodes``,
    ``tasks_per_node``, ``gpus_per_node``, ``cpus_per_task``), ``slurm_*`` otherwise. Unset
    (null) values are left out, so the site's defaults apply. Raises :class:`ConfigError` for
    values that cannot go into an sbatch script, and :class:`LayoutError` when
    ``nodes x tasks_per_node`` is not ``world_size``.
    """
    c = cfg.cluster
    if c.kind != "slurm":
        raise ConfigError(
            f"cluster.kind={c.kind!r}: there is no sbatch script for it; fix: cluster=slurm or cluster=slurm_dev"
        )
    if not isinstance(c.nodes, int) or c.nodes < 1:
        raise ConfigError(f"cluster.nodes={c.nodes!r} must be a positive integer")
    tasks = tasks_per_node(cfg)
    if c.nodes * tasks != world_size:
        raise LayoutError(
            f"the allocation has cluster.nodes x tasks per node = {c.nodes} x {tasks} = {c.nodes * tasks} tasks "
            f"but the layout needs world size {world_size}; fix: change cluster.nodes or cluster.tasks_per_node"
        )
    if not isinstance(c.timeout_min, int) or c.timeout_min < 1:
        raise ConfigError(f"cluster.timeout_min={c.timeout_min!r} must be a positive number of minutes")
    if not 0 <= c.signal_delay_s < min(65536, c.timeout_min * 60):
        raise ConfigError(
            f"cluster.signal_delay_s={c.signal_delay_s} must be >= 0 and shorter than the time limit "
            f"(cluster.timeout_min={c.timeout_min} -> {c.timeout_min * 60} s); otherwise USR2 arrives at the start"
        )
    if c.max_num_timeout < 0:
        raise ConfigError(f"cluster.max_num_timeout={c.max_num_timeout} must be >= 0")
    if c.gpus_per_node < 0:
        raise ConfigError(f"cluster.gpus_per_node={c.gpus_per_node} must be >= 0")
    if c.cpus_per_task is not None and c.cpus_per_task < 1:
        raise ConfigError(f"cluster.cpus_per_task={c.cpus_per_task} must be >= 1 or null")

    agent = bool(c.max_restarts)  # one task a node: its torch elastic agent starts the node's ranks (inplace)
    params: Dict[str, Any] = {
        "name": job_name(cfg),
        "timeout_min": c.timeout_min,
        "nodes": c.nodes + (c.spare_nodes if agent else 0),
        "tasks_per_node": 1 if agent else tasks,
    }
    if c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    if c.cpus_per_task is not None:
        params["cpus_per_task"] = c.cpus_per_task * (tasks if agent else 1)
    if c.mem is not None:
        mem = no_control("cluster.mem", c.mem).strip()
        if not MEM_RE.match(mem):
            raise ConfigError(
                f"cluster.mem={c.mem!r} is not an sbatch memory size; fix: e.g. 500G, 64000M, or 0 (all of the node's memory)"
            )
        params["slurm_mem"] = mem
    for key in ("partition", "account", "qos", "constraint", "exclude"):
        value = getattr(c, key)
        if value is not None and str(value) != "":
            params[f"slurm_{key}"] = no_control(f"cluster.{key}", value)
    params["slurm_signal_delay_s"] = int(c.signal_delay_s)
    additional = additional_parameters(cfg)
    if additional:
        params["slurm_additional_parameters"] = additional
    params["slurm_setup"] = _setup_lines(cfg)
    srun_args = []
    for i, arg in enumerate(c.srun_args or []):
        srun_args.append(no_control(f"cluster.srun_args[{i}]", arg))
    if not any(_is_kill_on_bad_exit(a) for a in srun_args):
        srun_args.insert(0, KILL_ON_BAD_EXIT)
    params["slurm_srun_args"] = srun_args
    return params


KILL_ON_BAD_EXIT = "--kill-on-bad-exit=1"
"""Always on the srun line (unless ``cluster.srun_args`` says otherwise, e.g. ``--kill-on-bad-exit=0``):
the ranks of one job are useless without each other, so when one task exits non-zero or is killed
(OOM killer, a dead GPU) srun ends the whole step at once instead of leaving its peers blocked in
a collective until the process-group timeout (NCCL notices a dead peer late, or never). A requeue
or a graceful stop is unaffected: every rank has saved and passed a barrier before any exits."""


def _is_kill_on_bad_exit(arg: str) -> bool:
    return arg.startswith("--kill-on-bad-exit") or arg == "-K" or (arg.startswith("-K") and arg[2:] in ("0", "1"))


def slurm_executor_parameters(cfg, world_size: int) -> Dict[str, Any]:
    """The same parameters in ``submitit.SlurmExecutor.update_parameters`` names
    (``job_name``, ``time``, ``ntasks_per_node``, ``partition``, ``setup``, ...).

    Use with ``SlurmExecutor(folder, max_num_timeout=..., python=python_command(cfg))``.
    """
    return _renderer_kwargs(executor_parameters(cfg, world_size))


def python_command(cfg) -> str:
    """The quoted python executable that runs each task (``cluster.python`` or this interpreter)."""
    python = cfg.cluster.python or sys.executable
    return shlex.quote(no_control("cluster.python", python))


def _renderer_kwargs(params: Dict[str, Any]) -> Dict[str, Any]:
    """AutoExecutor names -> ``_make_sbatch_string`` names, as AutoExecutor + SlurmExecutor convert them."""
    from submitit.slurm.slurm import SlurmExecutor, _convert_mem

    generic = SlurmExecutor._equivalence_dict()
    out: Dict[str, Any] = {}
    for key, value in params.items():
        if value is None:
            continue
        if key.startswith("slurm_"):
            out[key[len("slurm_") :]] = value
        elif key == "mem_gb":
            out["mem"] = _convert_mem(value)
        elif key in generic:
            out[generic[key]] = value
        else:
            raise ConfigError(f"internal: unknown submitit parameter {key!r}")
    return out


def render_sbatch(cfg, world_size: int, folder: Union[str, Path]) -> str:
    """The exact sbatch script submitit writes for this config and submitit ``folder``.

    ``folder`` is the executor's folder (it may contain ``%j``); it is made absolute as submitit does.
    """
    from submitit.slurm.slurm import _make_sbatch_string

    params = executor_parameters(cfg, world_size)
    folder_path = Path(no_control("submitit folder", folder)).expanduser().absolute()
    command = " ".join([python_command(cfg), "-u -m submitit.core._submit", shlex.quote(str(folder_path))])
    return _make_sbatch_string(command=command, folder=folder_path, **_renderer_kwargs(params))


def srun_line(script: str) -> Optional[str]:
    """The srun command line of a rendered script (for printing next to it)."""
    for line in script.splitlines():
        if line.startswith("srun "):
            return line
    return None
