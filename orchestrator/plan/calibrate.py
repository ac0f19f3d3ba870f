"""Calibration: fit a device's :class:`~orchestrator.plan.profile.DeviceProfile` to measured runs.

Pure Python + numpy (no torch). A *sample* is one finished run on the device: for every rank, the
planner's model-state bytes (weights + gradients + optimizer state) and activation bytes of that
rank's pipeline stage next to the measured peak (CPU: peak RSS; GPU: torch's peak allocated), and the
run's :class:`~orchestrator.plan.profile.StepTerms` features next to its measured median step time.

Global rank r sits on pipeline stage r // (world / PP) (Megatron's rank order tp-cp-ep-dp-pp).

The fits are ridge-regularised least squares on *relative* errors, towards the profile the samples
are added to (the prior for a new device), with non-negative constants:

* memory: measured = overhead + states_factor x states + activation_factor x activations;
* step time: measured = features . constants (:data:`~orchestrator.plan.profile.TIME_CONSTANTS`).

Directions the samples do not determine (e.g. inter-node bandwidth on one machine) stay at the prior.

Read as Bayesian regression (relative errors of sd sigma; each time multiplier a priori 1 with sd
sigma / sqrt(:data:`TIME_RIDGE`)), the step-time fit also says how sure it is: :func:`step_spread` is a
prediction's relative standard deviation, large where the samples leave a direction to the prior
(e.g. three trials that all had TP 1 and MBS 4 say nothing of TP's per-call latency). ``tune`` uses it to
choose informative trials and to stop only when no remaining candidate can plausibly win.

Entry points: :func:`sample_of`, :func:`fit_profile`, :func:`step_spread`, :func:`memory_errors`, :func:`kendall_tau`.
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from orchestrator.plan.profile import PROFILE_VERSION, DeviceProfile, stage_memory_bytes

MiB = 2**20
MAX_SAMPLES = 200
"""A profile keeps its newest samples only."""
MEMORY_RIDGE = 1e-4
TIME_RIDGE = 1e-3
"""Ridge weights (squared relative deviation of a constant from the prior, against squared relative errors)."""


def rank_stage(rank: int, world_size: int, pipeline_model_parallel_size: int) -> int:
    """Pipeline stage of a global rank (Megatron's default order tp-cp-ep-dp-pp)."""
    return rank // (world_size // pipeline_model_parallel_size)


def measured_peaks_mib(summary: Dict[str, Any]) -> Optional[List[float]]:
    """Peak memory per rank (MiB) from a job summary: torch's peak allocated on GPU, else peak RSS."""
    gpu = summary.get("peak_gpu_mem_mb_per_rank")
    if summary.get("device") == "cuda" and gpu:
        return [float(x) for x in gpu]
    rss = summary.get("peak_rss_mb_per_rank")
    return [float(x) for x in rss] if rss else None


def sample_of(plan, summary: Dict[str, Any], label: str = "", cores: int = 0) -> Dict[str, Any]:
    """One calibration sample from an *uncalibrated* plan (``profile=None``) and the run's summary.

    ``cores``: the device profile's (CPU ranks sharing a host's cores), for the step-time features.

    ``summary`` is the job's summary record (``peak_rss_mb_per_rank``, ``step_time_median_s``, ...).
    Returns a JSON-able dict: ``ranks`` [{stage, states, activations, measured}] in bytes and
    ``time`` {features, measured_s} (None without a timed iteration).
    """
    lay = plan.layout
    peaks = measured_peaks_mib(summary) or []
    ranks = []
    for r, mib in enumerate(peaks[: lay.world_size]):
        st = plan.stages[rank_stage(r, lay.world_size, lay.pipeline_model_parallel_size)]
        ranks.append(
            {
                "stage": st.stage,
                "states": st.weights + st.gradients + st.optimizer,
                "activations": st.activations,
                "measured": mib * MiB,
            }
        )
    step = summary.get("step_time_median_s")
    time = {"features": plan.terms.features(cores), "measured_s": float(step)} if step else None
    return {
        "label": label,
        "version": PROFILE_VERSION,
        "world_size": lay.world_size,
        "when": _dt.datetime.now().isoformat(timespec="seconds"),
        "ranks": ranks,
        "time": time,
    }


# ---- least squares ------------------------------------------------------------------------------


def _ridge_nonneg(rows: Sequence[Sequence[float]], targets: Sequence[float], ridge: float) -> List[float]:
    """Multipliers k >= 0 minimising sum (row . k - target)^2 + ridge x sum (k - 1)^2 (active set)."""
    import numpy as np

    a = np.asarray(rows, dtype=float).reshape(len(rows), -1)
    y = np.asarray(targets, dtype=float)
    n = a.shape[1]
    free = list(range(n))
    k = np.zeros(n)
    for _ in range(n + 1):
        sub = a[:, free]
        lhs = np.vstack([sub, np.sqrt(ridge) * np.eye(len(free))])
        rhs = np.concatenate([y, np.sqrt(ridge) * np.ones(len(free))])
        sol, *_ = np.linalg.lstsq(lhs, rhs, rcond=None)
        k = np.zeros(n)
        k[free] = sol
        negative = [i for i in free if k[i] < 0]
        if not negative:
            break
        free = [i for i in free if i not in negative]
        if not free:
            break
    return [float(max(0.0, v)) for v in k]


def _fit_memory(prior: DeviceProfile, samples: Sequence[Dict[str, Any]]) -> Tuple[float, float, float]:
    base = (prior.memory_overhead_bytes, prior.states_factor, prior.activation_factor)
    rows, targets = [], []
    for s in samples:
        for r in s["ranks"]:
            m = r["measured"]
            if m > 0:
                rows.append([base[0] / m, base[1] * r["states"] / m, base[2] * r["activations"] / m])
                targets.append(1.0)
    if not rows:
        return base
    k = _ridge_nonneg(rows, targets, MEMORY_RIDGE)
    return base[0] * k[0], base[1] * k[1], base[2] * k[2]


def _time_rows(base: Sequence[float], samples: Sequence[Dict[str, Any]]) -> List[List[float]]:
    """Per timed sample: the prior's seconds of each feature / the measured step (row . k = 1 fits it)."""
    return [
        [b * f / t["measured_s"] for b, f in zip(base, t["features"])]
        for t in (s.get("time") for s in samples)
        if t and t.get("measured_s")
    ]


def _fit_time(prior: DeviceProfile, samples: Sequence[Dict[str, Any]]) -> List[float]:
    base = prior.time_constants()
    rows = _time_rows(base, samples)
    if not rows:
        return base
    k = _ridge_nonneg(rows, [1.0] * len(rows), TIME_RIDGE)
    return [b * ki for b, ki in zip(base, k)]


def step_spread(
    prior: DeviceProfile, profile: DeviceProfile, floor: float = 0.05
) -> Callable[[Sequence[float]], float]:
    """A function: step-time features -> the relative standard deviation of ``profile``'s prediction.

    ``profile`` is :func:`fit_profile` (``prior``, its ``samples``) (or ``prior`` itself, no samples).
    Errors are taken as relative, of sd sigma = max(``floor``, rms of the fit's relative residuals); the
    ridge towards the prior is a prior of sd sigma / sqrt(:data:`TIME_RIDGE`) on each multiplier k (fitted
    constant / prior constant), so k's posterior covariance is sigma^2 (A^T A + ridge I)^-1, A the rows of
    :func:`_time_rows`; a prediction sum_j prior_j k_j f_j has relative sd sqrt(u^T cov u),
    u_j = prior_j f_j / prediction. Standard ridge-regression algebra (e.g. Bishop, PRML section 3.3).
    """
    import numpy as np

    base = prior.time_constants()
    rows = _time_rows(base, [s for s in profile.samples if s.get("version") == PROFILE_VERSION][-MAX_SAMPLES:])
    a = np.asarray(rows, dtype=float).reshape(len(rows), len(base))
    k = np.asarray([c / b if b else 0.0 for c, b in zip(profile.time_constants(), base)])
    residual = a @ k - 1.0
    sigma = max(floor, float(np.sqrt(np.mean(residual**2))) if len(rows) else floor)
    cov = sigma**2 * np.linalg.inv(a.T @ a + TIME_RIDGE * np.eye(len(base)))

    def spread(features: Sequence[float]) -> float:
        predicted = predicted_step_s(profile, features)
        if predicted <= 0:
            return 0.0
        u = np.asarray([b * f for b, f in zip(base, features)]) / predicted
        return float(np.sqrt(max(0.0, u @ cov @ u)))

    return spread


def predicted_step_s(profile: DeviceProfile, features: Sequence[float]) -> float:
    return float(sum(c * f for c, f in zip(profile.time_constants(), features)))


def memory_errors(profile: DeviceProfile, sample: Dict[str, Any]) -> List[float]:
    """Per rank: (predicted - measured) / measured of peak memory under ``profile``."""
    return [
        (stage_memory_bytes(profile, r["states"], r["activations"]) - r["measured"]) / r["measured"]
        for r in sample["ranks"]
        if r["measured"] > 0
    ]


def kendall_tau(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Kendall's tau-b of two equally long sequences (None for fewer than 2 pairs or no variation)."""
    n = len(xs)
    concordant = discordant = ties_x = ties_y = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denom = ((concordant + discordant + ties_x) * (concordant + discordant + ties_y)) ** 0.5
    return (concordant - discordant) / denom if denom else None


def fit_stats(profile: DeviceProfile, samples: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """In-sample errors of ``profile`` on ``samples``: memory (max and mean |error| %, per rank),
    step time (max and mean |error| %), Kendall tau of predicted vs measured step times."""
    mem = [abs(e) for s in samples for e in memory_errors(profile, s)]
    timed = [s["time"] for s in samples if s.get("time")]
    pred = [predicted_step_s(profile, t["features"]) for t in timed]
    meas = [t["measured_s"] for t in timed]
    step = [abs(p - m) / m for p, m in zip(pred, meas)]
    return {
        "memory_samples": sum(len(s["ranks"]) for s in samples),
        "time_samples": len(timed),
        "memory_error_max_pct": 100 * max(mem) if mem else None,
        "memory_error_mean_pct": 100 * sum(mem) / len(mem) if mem else None,
        "step_error_max_pct": 100 * max(step) if step else None,
        "step_error_mean_pct": 100 * sum(step) / len(step) if step else None,
        "kendall_tau": kendall_tau(pred, meas) if len(pred) > 1 else None,
    }


def fit_profile(prior: DeviceProfile, samples: Sequence[Dict[str, Any]]) -> DeviceProfile:
    """The profile fitted to ``samples`` (the newest :data:`MAX_SAMPLES`; samples of another
    :data:`PROFILE_VERSION` dropped), regularised towards ``prior``'s constants: a deterministic function of the two, so
    refitting the stored samples with :func:`~orchestrator.plan.profile.prior_profile` reproduces it."""
    kept = [s for s in samples if s.get("version") == PROFILE_VERSION][-MAX_SAMPLES:]
    overhead, sf, af = _fit_memory(prior, kept)
    fitted = replace(prior, memory_overhead_bytes=overhead, states_factor=sf, activation_factor=af)
    fitted = fitted.with_time_constants(_fit_time(prior, kept))
    stats = fit_stats(fitted, kept)
    stats["updated"] = _dt.datetime.now().isoformat(timespec="seconds")
    return replace(fitted, calibrated=bool(kept), fit=stats, samples=kept)
