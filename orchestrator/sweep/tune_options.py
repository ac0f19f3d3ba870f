"""The tune's command line: the ``tune.*`` options (:class:`TuneConfig`, :func:`parse_tune_args`) apart from
the Hydra overrides, and the one base config they compose to (:func:`compose_base`). The search itself:
:mod:`orchestrator.sweep.search`; the session: :mod:`orchestrator.sweep.tune`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

from orchestrator.errors import ConfigError, OrchestratorError, plain

RECOMPUTE = {"none": (None, None, None), "selective": ("selective", None, None), "full": ("full", "uniform", 1)}
"""tune.recompute values -> (model.recompute_granularity, recompute_method, recompute_num_layers)."""


@dataclass
class TuneConfig:
    """``tune.*`` options of ``python -m orchestrator tune`` (lists: ``tune.mbs=1,2,4`` or ``[1,2,4]``)."""

    name: Optional[str] = None
    """Experiment name; trials in ``<run.root>/tune/<name>/<n>``. Default: ``<run.name>_tuned``."""
    max_trials: int = 8
    max_minutes: float = 60.0
    patience: int = 3
    """Stop after this many trials in a row without a step faster by ``min_gain``."""
    min_trials: int = 3
    """No early stop before this many trials."""
    min_gain: float = 0.02
    model_error_floor: float = 0.05
    """The model's error is never taken below this (step-time noise between runs)."""
    explore: float = 2.0
    """Standard deviations of a prediction's uncertainty (:func:`~orchestrator.plan.calibrate.step_spread`)
    a candidate may turn out faster by: the next trial is the candidate with the lowest optimistic step
    (prediction x (1 - explore x spread)), and the model bound stops only when no candidate's optimistic
    step beats the best measured one. 0: the fastest prediction, trusted as it is."""
    iters: int = 8
    """Training iterations per trial (the first ``warmup_iters`` are not timed)."""
    warmup_iters: int = 2
    memory_margin: float = 0.9
    """Run a candidate only if its predicted peak per rank <= this x the memory limit."""
    memory_limit_mb: Optional[float] = None
    """Per rank; default: the device's (GPU preset, or this machine's RAM / ranks on it)."""
    tp: Optional[List[int]] = None
    pp: Optional[List[int]] = None
    vpp: Optional[List[Optional[int]]] = None
    mbs: Optional[List[int]] = None
    recompute: Optional[List[str]] = None
    """none, selective, full (full = uniform, 1 layer per group)."""
    distributed_optimizer: Optional[List[bool]] = None
    sequence_parallel: Optional[List[bool]] = None
    out: Optional[str] = None
    """Where to write the winner (default ``./conf/experiment/<name>.yaml``)."""
    calibrate: bool = True
    """Fit the device profile to the trials and store it."""
    dry_run: bool = False
    """Print the ranked candidates; run nothing."""
    trial_timeout_min: int = 10
    trace_iteration: Optional[int] = None
    """Trace this iteration of every trial (``training.trace_iteration``, 1..``tune.iters``): the
    table's measured bubble column beside the predicted one."""
    warm_pool: bool = True
    """Run trials on warm rank processes (orchestrator.submit.pool; SLURM: one allocation for every
    trial); false: each trial a fresh ``python -m orchestrator`` job."""


_LISTS = {
    "tp": int,
    "pp": int,
    "vpp": int,
    "mbs": int,
    "recompute": str,
    "distributed_optimizer": bool,
    "sequence_parallel": bool,
}


def _scalar(text: str, kind: type, key: str) -> Any:
    """One value as YAML (``null``, ``true``, numbers), checked against ``kind``."""
    import yaml

    value = yaml.safe_load(text) if text.strip() else None
    if value is None:
        return None
    if kind is str:
        return str(value)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    noun, hint = {
        int: ("an integer", "<integer>"),
        float: ("a number", "<number>"),
        bool: ("true or false", "true"),
    }.get(kind, (kind.__name__, f"<{kind.__name__}>"))
    raise ConfigError(f"tune.{key}={text!r} is not {noun}; fix: tune.{key}={hint}")


def parse_tune_args(args: Sequence[str]) -> TuneConfig:
    """``tune.key=value`` strings -> :class:`TuneConfig` (ConfigError naming the key otherwise)."""
    types = {f.name: f.type for f in fields(TuneConfig)}
    defaults = TuneConfig()
    values: Dict[str, Any] = {}
    for arg in args:
        key, eq, text = arg.partition("=")
        key = key[len("tune.") :]
        if not eq or key not in types:
            raise ConfigError(f"tune.{key}: unknown tune option; fix: one of {', '.join('tune.' + k for k in types)}")
        if key in _LISTS:
            parts = [p for p in re.split(r"\s*,\s*", text.strip().strip("[]")) if p]
            values[key] = [_scalar(p, _LISTS[key], key) for p in parts]
            if key == "recompute" and any(v not in RECOMPUTE for v in values[key]):
                raise ConfigError(
                    f"tune.recompute={text}: values must be among {', '.join(RECOMPUTE)}; "
                    "fix: tune.recompute=none,selective"
                )
        else:
            default = getattr(defaults, key)
            kind = (
                type(default)
                if default is not None
                else {"name": str, "out": str, "trace_iteration": int}.get(key, float)
            )
            values[key] = _scalar(text, kind, key)
    opts = TuneConfig(**values)
    for key in ("max_trials", "iters", "patience", "trial_timeout_min"):
        if getattr(opts, key) < 1:
            raise ConfigError(f"tune.{key}={getattr(opts, key)} must be >= 1; fix: tune.{key}=<a positive integer>")
    if not 0 <= opts.warmup_iters < opts.iters:
        raise ConfigError(
            f"tune.warmup_iters={opts.warmup_iters} must be < tune.iters={opts.iters} (some "
            "iterations must be timed); fix: tune.warmup_iters=1"
        )
    if opts.trace_iteration is not None and not 1 <= opts.trace_iteration <= opts.iters:
        raise ConfigError(
            f"tune.trace_iteration={opts.trace_iteration} must be one of the trial's iterations "
            f"1..tune.iters={opts.iters}; fix: tune.trace_iteration={opts.iters}"
        )
    if opts.explore < 0:
        raise ConfigError(f"tune.explore={opts.explore} must be >= 0 (standard deviations); fix: tune.explore=2")
    if opts.max_minutes <= 0:
        raise ConfigError(f"tune.max_minutes={opts.max_minutes} must be > 0; fix: tune.max_minutes=30")
    if not 0 < opts.memory_margin <= 1:
        raise ConfigError(f"tune.memory_margin={opts.memory_margin} must be in (0, 1]; fix: tune.memory_margin=0.9")
    return opts


def split_args(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """(``tune.*`` arguments, Hydra overrides)."""
    tune = [a for a in argv if a.startswith("tune.")]
    return tune, [a for a in argv if not a.startswith("tune.")]


def compose_base(overrides: List[str]):
    """The base JobConfig (ConfigError for anything Hydra or the schema refuses)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from orchestrator.config.compose import compose_config

    flags = [o for o in overrides if o.startswith("-")]
    try:
        sweeps = [
            o.input_line
            for o in OverridesParser.create().parse_overrides([o for o in overrides if o not in flags])
            if o.is_sweep_override()
        ]
    except Exception:
        sweeps = []  # compose_config names the bad override below
    if sweeps or flags:
        raise ConfigError(
            f"{(sweeps or flags)[0]}: tune takes one base config, not a sweep or a flag; fix: drop it "
            "(tune chooses TP/PP/VPP/MBS/recompute itself; narrow it with tune.tp=1,2 ...)"
        )
    try:
        return compose_config([*overrides, "run.dir=."])
    except OrchestratorError:
        raise
    except Exception as exc:  # Hydra's and OmegaConf's composition errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"overrides: {first}; fix: check the override names and values") from None


USAGE = (
    "usage: python -m orchestrator tune OVERRIDES... [tune.NAME=VALUE ...]\n"
    "  e.g. python -m orchestrator tune +experiment=gpt_pp2_dp2 tune.max_trials=6 tune.max_minutes=20\n"
    "       python -m orchestrator tune +experiment=gpt_pp2_dp2 tune.dry_run=true   # the ranked candidates only"
)
"""What a bare ``tune`` prints."""


def help_or_usage(argv: Sequence[str], doc: str) -> Optional[int]:
    """``--help``: ``doc`` as plain text and every ``tune.*`` option with its default (exit 0). No arguments at all:
    :data:`USAGE` and one ``error:`` line (exit 2), as every sub-tool answers a bare call: tuning runs real jobs
    and writes files, so it never starts on the defaults unasked. None otherwise (tune)."""
    if not argv:
        print(USAGE)
        print(
            "error: tune: no config to tune (a tune runs trial jobs and writes conf/experiment/<name>_tuned.yaml); "
            "fix: name the run's overrides, e.g. python -m orchestrator tune +experiment=gpt_pp2_dp2 "
            "(python -m orchestrator tune --help)",
            file=sys.stderr,
        )
        return 2
    if not any(a in ("-h", "--help") for a in argv):
        return None
    print(plain(doc))
    print("tune options (tune.<name>=<value>):")
    for f in fields(TuneConfig):
        print(f"  tune.{f.name} (default {f.default if f.default is not None else 'auto'})")
    return 0
