"""The tuner's search, pure: options, candidate layouts, memory pruning, ranking, when to stop.

No processes, no files: :mod:`orchestrator.sweep.tune` runs the trials and calls these.

* :func:`candidates` enumerates TP x PP x VPP x MBS x recomputation x distributed optimizer x
  sequence parallel for the base config's world size and GBS; every combination goes through the
  one :func:`~orchestrator.config.checks.validate` (and the planner's recomputation rules), so the
  search never runs what a user could not.
* :func:`price` plans each on the device that runs with the current device profile;
  :func:`fits` keeps those whose predicted peak per rank is at most ``memory_margin`` x the limit.
* :func:`stop_reason` says when to stop: budget (trials, minutes), no improvement by
  ``min_gain`` over ``patience`` trials, or the model bound -- the best remaining prediction,
  allowing the model's observed error, cannot beat the best measured step.
* :func:`blocked` learns from crashes: the options a crashed trial had that no completed trial had
  are suspects; remaining candidates with all of them are not run. An out-of-memory crash instead
  lowers the margin to below that trial's prediction (:func:`margin_after_oom`).
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from orchestrator.config.divisors import divisors
from orchestrator.config.layout import ParallelLayout, layout_from_config
from orchestrator.config.schema import JobConfig
from orchestrator.errors import ConfigError
from orchestrator.sweep.tune_options import RECOMPUTE, TuneConfig, parse_tune_args

__all__ = [  # the options live in sweep/tune_options.py; the search's readers take them from here too
    "RECOMPUTE",
    "TuneConfig",
    "parse_tune_args",
]

MiB = 2**20


# ---- candidates --------------------------------------------------------------------------------


@dataclass
class Candidate:
    """One valid layout/recipe: the overrides that select it, its config and (once priced) its plan."""

    overrides: List[str]
    cfg: JobConfig
    layout: ParallelLayout
    plan: Any = None
    status: str = "candidate"
    """candidate, pruned_memory, blocked, or the trial's status once run."""
    note: str = ""
    spread: float = 0.0
    """Relative standard deviation of the plan's step time (:func:`~orchestrator.plan.calibrate.step_spread`)."""

    def optimistic_s(self, explore: float) -> float:
        """The step time ``explore`` standard deviations below the prediction (never below 0)."""
        return self.plan.step_time_s * max(0.0, 1.0 - explore * self.spread)

    @property
    def label(self) -> str:
        lay, m = self.layout, self.cfg.model
        parts = [f"TP{lay.tensor_model_parallel_size}", f"PP{lay.pipeline_model_parallel_size}"]
        if lay.virtual_pipeline_model_parallel_size:
            parts.append(f"VPP{lay.virtual_pipeline_model_parallel_size}")
        parts += [f"DP{lay.data_parallel_size}", f"MBS{lay.micro_batch_size}"]
        if lay.sequence_parallel:
            parts.append("SP")
        if m.recompute_granularity:
            parts.append(f"recompute={m.recompute_granularity}")
        if self.cfg.optimizer.use_distributed_optimizer:
            parts.append("distopt")
        return " ".join(parts)

    @property
    def features(self) -> Set[str]:
        """Options that depart from the plainest layout (for :func:`blocked`)."""
        lay = self.layout
        out = {f"mbs={lay.micro_batch_size}"}
        for name, on in (
            ("tp", lay.tensor_model_parallel_size > 1),
            ("pp", lay.pipeline_model_parallel_size > 1),
            ("vpp", bool(lay.virtual_pipeline_model_parallel_size)),
            ("sp", lay.sequence_parallel),
            ("distopt", self.cfg.optimizer.use_distributed_optimizer),
        ):
            if on:
                out.add(name)
        if self.cfg.model.recompute_granularity:
            out.add(f"recompute={self.cfg.model.recompute_granularity}")
        return out


def _show(v: Any) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def search_space(base: JobConfig, opts: TuneConfig, world: int) -> Dict[str, List[Any]]:
    """The values tried per knob: ``tune.*`` where given, else every divisor / power of two that can be valid."""
    from orchestrator.config.machine import runs_on_cpu

    m, t = base.model, base.training
    node = base.cluster.gpus_per_node or world
    # on CPU ranks the distributed optimizer runs (tests/test_distopt.py) but saves no memory that matters
    # there: tried only when tune.distributed_optimizer asks, as the planner's suggestions do
    distopt = [base.optimizer.use_distributed_optimizer] if runs_on_cpu(base) else [False, True]
    return {
        "tp": opts.tp or [d for d in divisors(world) if d <= node and m.num_attention_heads % d == 0],
        "pp": opts.pp or [d for d in divisors(world) if m.num_layers % d == 0],
        "vpp": opts.vpp or [None] + [v for v in (2, 3, 4) if m.num_layers % v == 0],
        "mbs": opts.mbs or [b for b in (1, 2, 4, 8, 16, 32, 64) if t.global_batch_size % b == 0],
        "recompute": opts.recompute or list(RECOMPUTE),
        "distributed_optimizer": opts.distributed_optimizer or distopt,
        "sequence_parallel": opts.sequence_parallel or [False, True],
    }


def candidates(base: JobConfig, opts: TuneConfig) -> Tuple[List[Candidate], Dict[str, int]]:
    """Valid candidates for the base config's world size, and a count of rejections by first reason.

    Each combination becomes a JobConfig (base with the knobs replaced; DP stated so a local run keeps
    its world size) and must pass :func:`~orchestrator.config.checks.validate`.
    """
    from orchestrator.config.checks import validate
    from orchestrator.plan.memory import recipe_of, recipe_problems

    world = layout_from_config(base).world_size
    space = search_space(base, opts, world)
    cp = base.parallelism.context_parallel_size
    found: List[Candidate] = []
    rejected: Dict[str, int] = {}
    for tp, pp, vpp, mbs, rec, distopt, sp in itertools.product(*space.values()):
        if world % (tp * pp * cp) or (sp and tp == 1):
            continue  # not a layout of this world size / not an option
        g, method, n = RECOMPUTE[rec]
        cfg = replace(
            base,
            parallelism=replace(
                base.parallelism,
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                virtual_pipeline_model_parallel_size=vpp,
                sequence_parallel=sp,
                data_parallel_size=world // (tp * pp * cp),
            ),
            training=replace(base.training, micro_batch_size=mbs),
            model=replace(base.model, recompute_granularity=g, recompute_method=method, recompute_num_layers=n),
            optimizer=replace(base.optimizer, use_distributed_optimizer=distopt),
        )
        try:
            layout = validate(cfg)
            problems = recipe_problems(recipe_of(cfg), layout)
            if problems:
                raise ConfigError(problems[0])
        except ConfigError as exc:
            reason = str(exc).split(";")[0][:100]
            rejected[reason] = rejected.get(reason, 0) + 1
            continue
        overrides = [
            f"parallelism.tensor_model_parallel_size={tp}",
            f"parallelism.pipeline_model_parallel_size={pp}",
            f"parallelism.virtual_pipeline_model_parallel_size={_show(vpp)}",
            f"parallelism.data_parallel_size={world // (tp * pp * cp)}",
            f"parallelism.sequence_parallel={_show(sp)}",
            f"training.micro_batch_size={mbs}",
            f"model.recompute_granularity={_show(g)}",
            f"model.recompute_method={_show(method)}",
            f"model.recompute_num_layers={_show(n)}",
            f"optimizer.use_distributed_optimizer={_show(distopt)}",
        ]
        found.append(Candidate(overrides, cfg, layout))
    return found, rejected


# ---- pricing, pruning, ranking -------------------------------------------------------------------


def price(cands: Sequence[Candidate], device: str, profile: Any, spread: Any = None) -> None:
    """Plan every candidate on ``device`` (a preset name; ``cpu``) with ``profile``; ``spread``
    (features -> relative sd, :func:`~orchestrator.plan.calibrate.step_spread`) sets each ``Candidate.spread``."""
    from orchestrator.plan import memory as planner

    for c in cands:
        c.plan = planner.plan(c.cfg, gpu=device, profile=profile)
        if spread is not None and c.plan.terms is not None and profile is not None:
            c.spread = spread(c.plan.terms.features(profile.cores))


def memory_limit_bytes(cand: Candidate, opts: TuneConfig) -> float:
    return opts.memory_limit_mb * MiB if opts.memory_limit_mb else float(cand.plan.gpu.memory_bytes)


def fits(cand: Candidate, opts: TuneConfig, margin: float) -> bool:
    """Predicted peak per rank <= margin x limit."""
    return cand.plan.peak_bytes <= margin * memory_limit_bytes(cand, opts)


def ranked(cands: Sequence[Candidate], explore: float = 0.0) -> List[Candidate]:
    """Lowest optimistic step first (:meth:`Candidate.optimistic_s`; with ``explore`` 0 the fastest
    prediction), then the fastest prediction, then least memory."""
    return sorted(cands, key=lambda c: (c.optimistic_s(explore), c.plan.step_time_s, c.plan.peak_bytes))


# ---- learning from trials --------------------------------------------------------------------------

_OOM = re.compile(r"out of memory|OutOfMemory|MemoryError|died without a result|\bKilled\b|oom", re.IGNORECASE)


def is_oom(reason: str) -> bool:
    return bool(_OOM.search(reason or ""))


def margin_after_oom(margin: float, predicted_peak: float, limit: float) -> float:
    """After an OOM at ``predicted_peak``: at most 95% of that trial's predicted share of the limit."""
    return min(margin, 0.95 * predicted_peak / limit)


def suspects(crashed: Sequence[Candidate], completed: Sequence[Candidate]) -> List[Set[str]]:
    """Per crashed (not OOM) trial: its options no completed trial had."""
    seen: Set[str] = set().union(*(c.features for c in completed)) if completed else set()
    return [c.features - seen for c in crashed]


def blocked(cand: Candidate, suspect_sets: Sequence[Set[str]]) -> Optional[Set[str]]:
    """The first suspect set ``cand`` has all of (then it is not run), else None."""
    return next((s for s in suspect_sets if s and s <= cand.features), None)


@dataclass
class TrialOutcome:
    """What the stop rule needs of one trial."""

    measured_step_s: Optional[float]
    """None when the trial did not complete."""
    predicted_step_s: float
    """When the trial was chosen (a prediction for a configuration the model had not seen)."""
    calibrated: bool = False
    """Whether that prediction came from a calibrated profile (the prior's errors say nothing of the fit)."""
    predicted_sd: float = 0.0
    """The prediction's relative standard deviation (``Candidate.spread``) when it was chosen."""
    exploring: bool = False
    """Chosen for what it teaches the model: predicted no faster than the best step measured before it
    (only its uncertainty made it a contender); ``patience`` does not count it."""


def stop_reason(
    opts: TuneConfig,
    trials: Sequence[TrialOutcome],
    remaining_predicted_s: Sequence[float],
    elapsed_s: float,
    next_trial_s: float = 0.0,
    remaining_spread: Sequence[float] = (),
) -> Optional[str]:
    """Why to stop now, or None to run the next candidate.

    Budget: ``max_trials`` trials run, or ``max_minutes`` would be passed by another trial of the
    average length so far. No candidates left. After ``min_trials``: ``patience`` trials in a row
    (exploring ones not counted) without a step ``min_gain`` faster than the best before; or the model bound: every remaining
    candidate's prediction x (1 - its allowance) >= the best measured step, allowance = the larger of
    ``explore`` x the candidate's spread (``remaining_spread``, relative sd of its prediction; none
    given: 0) and the model's surprise: max(``model_error_floor``, the largest |measured / predicted - 1|
    of the completed trials a calibrated profile predicted before they ran, where that error exceeded
    ``explore`` x the trial's own spread -- errors its stated uncertainty allowed for are no surprise).
    """
    if len(trials) >= opts.max_trials:
        return f"budget: tune.max_trials={opts.max_trials} trials run"
    if elapsed_s + next_trial_s > 60 * opts.max_minutes:
        return f"budget: another trial would pass tune.max_minutes={opts.max_minutes:g}"
    if not remaining_predicted_s:
        return "every candidate that fits has been tried or ruled out"
    done = [t for t in trials if t.measured_step_s]
    if len(trials) < opts.min_trials or not done:
        return None
    best, since = None, 0
    for t in trials:
        if t.measured_step_s and (best is None or t.measured_step_s < best * (1 - opts.min_gain)):
            best, since = t.measured_step_s, 0
        elif not t.exploring:
            since += 1
    if since >= opts.patience:
        return f"no step {opts.min_gain:.0%} faster than the best in the last {opts.patience} trials (tune.patience)"
    best = min(t.measured_step_s for t in done)
    errors = [(abs(t.measured_step_s / t.predicted_step_s - 1), t.predicted_sd) for t in done if t.calibrated]
    error = max([opts.model_error_floor] + [e for e, sd in errors if e > opts.explore * sd])  # the surprises
    spreads = list(remaining_spread) or [0.0] * len(remaining_predicted_s)
    allowance = [max(error, opts.explore * s) for s in spreads]
    floor, i = min((p * (1 - a), i) for i, (p, a) in enumerate(zip(remaining_predicted_s, allowance)))
    if floor >= best:
        return (
            f"model bound: the best remaining candidate is predicted at {remaining_predicted_s[i] * 1e3:.1f} ms "
            f"(>= {floor * 1e3:.1f} ms allowing the model's {allowance[i]:.0%} error) vs {best * 1e3:.1f} ms "
            "measured"
        )
    return None
