"""The one validate: every rule a config must pass before anything is prepared or queued.

Plan, dry-run, run, every sweep point and the job itself call :func:`validate`. Pure Python, no
torch import (installed packages are looked up in their distribution metadata, never imported).
Every refusal is one :class:`~orchestrator.errors.ConfigError` (or
:class:`~orchestrator.errors.LayoutError`) whose message is a single line
``<key>=<value>: <what>; fix: <how>`` (the layout rules of :mod:`orchestrator.config.layout_rules` read
``<key>=<value> <what> ...; fix: <how>``; several broken layout rules are joined with `` | ``).

Rooms: the values on their own in :mod:`orchestrator.config.values`, the data options in
:mod:`orchestrator.config.data_checks`, the device in :mod:`orchestrator.config.machine`, the model rules
in :mod:`orchestrator.config.model_rules`; the run's name and paths and the order of it all here.

Order, so that the first message is the one that makes sense: value types, enumerations and
ranges (``parallelism.data_parallel_size=-2`` is "must be a positive integer", never arithmetic
on -2) → ``run.name`` → the parallel layout and the model rules megatron-core checks in the
ranks (divisibility, recomputation, MoE) → what the device and the installed packages can run →
the data options (files exist, one weight per path).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import List, Tuple

from orchestrator.config.data_checks import check_data
from orchestrator.config.hf_config import hf_path
from orchestrator.config.layout import ParallelLayout, layout_from_config
from orchestrator.config.machine import check_device, check_local_gpus, runs_on_cpu
from orchestrator.config.model_rules import model_problems, recompute_problems
from orchestrator.config.ramp import problem as rampup_problem
from orchestrator.config.schema import JobConfig
from orchestrator.config.values import CHOICES, INTEGERS, NUMBERS, check_types, check_values
from orchestrator.errors import ConfigError, LayoutError
from orchestrator.text import show

__all__ = [  # the checks of the sibling rooms, read from here too (the one validate's module)
    "CHOICES",
    "INTEGERS",
    "NUMBERS",
    "check_data",
    "check_device",
    "check_local_gpus",
    "check_run",
    "check_types",
    "check_values",
    "model_problems",
    "recompute_problems",
    "runs_on_cpu",
    "validate",
    "validate_planned",
]


def validate(cfg: JobConfig) -> ParallelLayout:
    """The validated layout of ``cfg``; raises ConfigError / LayoutError (one line each)."""
    check_values(cfg)
    check_run(cfg)
    layout = layout_from_config(cfg)  # LayoutError (one line) for an under-specified allocation
    problems = layout.problems() + model_problems(cfg, layout)
    if problems:
        raise LayoutError(" | ".join(problems))
    t = cfg.training
    ramp = rampup_problem(
        t.rampup_batch_size,
        t.global_batch_size,
        t.micro_batch_size,
        layout.data_parallel_size,
        layout.pipeline_model_parallel_size,
        layout.interleaved,
    )
    if ramp:
        raise ConfigError(ramp)
    check_device(cfg)
    check_local_gpus(cfg)  # a local job's GPUs are this machine's
    check_data(cfg)
    return layout


def validate_planned(cfg: JobConfig) -> Tuple[ParallelLayout, List[str]]:
    """(layout, warnings) for a plan: the one :func:`validate` with the data swapped for a stand-in
    (mock data, byte tokenizer), so that everything but the data refuses; then the data checks on the
    real config, as warnings: a cluster's data and tokenizer files are rarely on the machine that plans
    (the job checks them again where it runs)."""
    import dataclasses

    stand_in = dataclasses.replace(
        cfg.data, kind="mock", name="mock", paths=[], weights=None, tokenizer="byte", vocab_size=None, eod_id=None
    )
    layout = validate(dataclasses.replace(cfg, data=stand_in))
    try:
        check_data(cfg)
    except ConfigError as exc:
        return layout, [f"{exc} (data are checked again where the job runs)"]
    return layout, []


def check_plan_picture(cfg: JobConfig) -> None:
    """``plan_picture``: a .png/.svg/.pdf name, with plan=true, in a directory that exists (ConfigError, one line,
    otherwise: the picture is written into it, no directory is made for it)."""
    picture = cfg.plan_picture
    if picture is not None and (
        not isinstance(picture, str) or Path(picture).suffix.lower() not in (".png", ".svg", ".pdf")
    ):
        raise ConfigError(
            f"plan_picture={show(picture)}: must be a file name ending in .png, .svg or .pdf (the "
            "picture's format); fix: plan_picture=plan.png"
        )
    if picture is not None and not cfg.plan:
        raise ConfigError(
            f"plan_picture={show(picture)}: drawn only by the plan, and plan=false runs the job "
            "instead; fix: add plan=true (a traced run draws its measured schedule with "
            "training.trace_iteration=N)"
        )
    where = Path(os.path.expanduser(picture)).parent if picture is not None else None
    if where is not None and not where.is_dir():  # written into, never made: /nonexistent/ at the root was
        raise ConfigError(
            f"plan_picture={show(picture)}: the directory {where} "
            f"{'is not a directory' if where.exists() else 'does not exist'}; fix: mkdir -p {where}, or "
            f"plan_picture=<an existing directory>/{Path(picture).name}"
        )


def check_run(cfg: JobConfig) -> None:
    """``run.name`` is one path component (the run directory is ``run.root/run.name``);
    ``plan_picture`` (:func:`check_plan_picture`); ``checkpoint.init_from`` is a directory."""
    name = cfg.run.name
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name:
        raise ConfigError(
            f"run.name={show(name)}: must be one directory name (no '/', not '.' or '..', not empty), "
            "so the run stays inside run.root; fix: run.name=<name>, and run.root=<dir> for "
            "another place"
        )
    if not isinstance(cfg.run.root, str) or not cfg.run.root:
        raise ConfigError(f"run.root={show(cfg.run.root)}: must be a directory path; fix: run.root=runs")
    check_plan_picture(cfg)
    init = cfg.checkpoint.init_from
    if init is not None and hf_path(init) is None and not Path(os.path.expanduser(init)).is_dir():
        raise ConfigError(
            f"checkpoint.init_from={show(init)}: no such directory; fix: the path of a checkpoint "
            "(<run dir>/checkpoints/iter_XXXXXXX), or checkpoint.init_from=null"
        )
