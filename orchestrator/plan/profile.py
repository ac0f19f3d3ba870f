"""Device profiles: the planner's free constants, measured on the device that runs, and how they price a step.

Pure Python (no torch). A :class:`DeviceProfile` holds what the planner otherwise assumes:

* memory per rank = ``memory_overhead_bytes`` + ``states_factor`` x (weights + gradients +
  optimizer state) + ``activation_factor`` x activations (bytes; the planner's terms, see
  :mod:`orchestrator.plan.memory`);
* step time (seconds) = (compute + TP comm + PP comm + framework) x (1 + (p-1)/(v m)) + DP comm + fixed,
  with compute = hardware FLOPs of the slowest stage per GPU / ``flops_per_s``, comm = bytes / the
  link's bandwidth + calls x ``latency_s``, framework = forward-equivalent layer passes x
  ``layer_pass_s`` + model-chunk passes x ``chunk_pass_s``, fixed = ``step_s`` (see :class:`StepTerms`).
  When more ranks than ``cores`` share a host (CPU ranks), a stage's idle pipeline time runs other
  ranks: every rank's work is stretched by ranks per core, and the bubble is only what megatron's
  schedule leaves when fewer ranks than cores can run (:meth:`StepTerms.stretch`).

A profile is fitted by :mod:`orchestrator.plan.calibrate` from measured runs and stored as
``<cache>/profiles/<device key>.json`` (``<cache>`` = ``data.cache_dir``, by default
``$ORCHESTRATOR_CACHE`` or ``~/.cache/orchestrator``). Device keys: ``cpu-<model name>-x<logical CPUs>``
for this machine's CPU (``gpu=cpu``), ``gpu-<preset>`` for a GPU preset. Where no profile is stored,
:func:`prior_profile` gives the uncalibrated starting values (said so in the plan's notes).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from orchestrator.config.checks import runs_on_cpu
from orchestrator.io import write_atomic
from orchestrator.plan.inputs import (
    BUS_EFFICIENCY,
    DEFAULT_MFU,
    FRAMEWORK_OVERHEAD_BYTES,
    GpuPreset,
)
from orchestrator.plan.step_terms import StepTerms, step_terms

__all__ = [  # StepTerms and step_terms live in plan/step_terms.py; the planner reads them from here too
    "DeviceProfile",
    "StepTerms",
    "device_key",
    "device_of",
    "device_profile",
    "load_profile",
    "prior_profile",
    "profile_path",
    "save_profile",
    "stage_memory_bytes",
    "step_terms",
]

PROFILE_VERSION = 4
"""Bumped when :class:`StepTerms` or the memory terms change meaning: older samples are not reused."""
TIME_CONSTANTS = (
    "flops_per_s",
    "intra_node_bytes_per_s",
    "inter_node_bytes_per_s",
    "latency_s",
    "layer_pass_s",
    "chunk_pass_s",
    "step_s",
)
"""The time constants, in the order of :meth:`StepTerms.features` (rates enter as their inverse)."""
_RATES = {"flops_per_s", "intra_node_bytes_per_s", "inter_node_bytes_per_s"}


@dataclass(frozen=True)
class DeviceProfile:
    """One device's constants (SI units). ``calibrated`` is False for :func:`prior_profile` values."""

    device: str
    """Key: ``cpu-<model>-x<logical CPUs>`` or ``gpu-<preset>``."""
    description: str
    memory_overhead_bytes: float
    """Per rank: runtime, libraries, communicator buffers, allocator slack (CPU: most of the RSS)."""
    states_factor: float
    activation_factor: float
    flops_per_s: float
    """Achieved hardware FLOP/s of one rank's busy compute."""
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    latency_s: float
    """Per latency-bound message (a point-to-point send; a ring collective over n ranks sends 2(n-1))."""
    layer_pass_s: float
    """Framework time per forward-equivalent pass of one layer over one micro-batch (3 per layer fwd+bwd)."""
    chunk_pass_s: float
    """Framework time per model chunk and micro-batch (schedule, data, loss)."""
    step_s: float
    """Fixed framework time per optimizer step."""
    cores: int = 0
    """Cores the ranks of one host share (CPU); 0 = one device per rank (GPU)."""
    calibrated: bool = False
    fit: Dict[str, Any] = field(default_factory=dict)
    """How the fit went: samples used, in-sample errors (%), Kendall tau of step times, when."""
    samples: List[Dict[str, Any]] = field(default_factory=list)
    """The measurements it was fitted from (see :mod:`orchestrator.plan.calibrate`)."""
    version: int = PROFILE_VERSION

    def time_constants(self) -> List[float]:
        """Seconds per unit of each :meth:`StepTerms.features` entry."""
        return [1.0 / getattr(self, k) if k in _RATES else getattr(self, k) for k in TIME_CONSTANTS]

    def with_time_constants(self, values: Sequence[float]) -> "DeviceProfile":
        """A copy with the time constants set from seconds-per-unit ``values`` (inverse of :meth:`time_constants`)."""
        out = {k: (1.0 / v if v > 0 else math.inf) if k in _RATES else v for k, v in zip(TIME_CONSTANTS, values)}
        return replace(self, **out)

    def bandwidth(self, intra_node: bool) -> float:
        return self.intra_node_bytes_per_s if intra_node else self.inter_node_bytes_per_s

    def summary(self) -> str:
        """One line: the device and its constants, and how they were obtained."""
        how = (
            f"calibrated from {self.fit.get('memory_samples', 0)} memory / {self.fit.get('time_samples', 0)} "
            f"step-time samples ({self.fit.get('updated', '?')})"
            if self.calibrated
            else "uncalibrated prior values"
        )
        return (
            f"{self.device}: overhead {self.memory_overhead_bytes / 2**20:.0f} MiB/rank, states x"
            f"{self.states_factor:.2f}, activations x{self.activation_factor:.2f}, "
            f"{self.flops_per_s / 1e9:.3g} GFLOP/s, {self.intra_node_bytes_per_s / 1e9:.3g} GB/s, latency "
            f"{self.latency_s * 1e6:.0f} us, {self.layer_pass_s * 1e3:.2f} ms/layer pass, "
            f"{self.chunk_pass_s * 1e3:.2f} ms/chunk pass, {self.step_s * 1e3:.1f} ms/step; {how}"
        )


# ---- device keys and storage -------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def cpu_model_name() -> str:
    """This machine's CPU model (``/proc/cpuinfo``'s model name; the platform's processor elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def device_key(preset_name: str) -> str:
    """``cpu-<model>-x<logical CPUs>`` for ``cpu`` (this machine), ``gpu-<preset>`` otherwise."""
    if preset_name.lower() == "cpu":
        return f"cpu-{_slug(cpu_model_name())}-x{os.cpu_count() or 1}"
    return f"gpu-{_slug(preset_name)}"


def profiles_dir(cache_dir: Optional[str] = None) -> Path:
    """``<cache_dir>/profiles``; an unresolved ``${...}`` (a JobConfig built in code) falls back to
    ``$ORCHESTRATOR_CACHE`` or ``~/.cache/orchestrator``, as ``data.cache_dir`` does."""
    if not cache_dir or "${" in cache_dir:
        cache_dir = os.environ.get("ORCHESTRATOR_CACHE") or "~/.cache/orchestrator"
    return Path(os.path.expanduser(cache_dir)) / "profiles"


def profile_path(key: str, cache_dir: Optional[str] = None) -> Path:
    return profiles_dir(cache_dir) / f"{key}.json"


def load_profile(key: str, cache_dir: Optional[str] = None) -> Optional[DeviceProfile]:
    """The stored profile for ``key``, or None (absent, unreadable or of another :data:`PROFILE_VERSION`)."""
    path = profile_path(key, cache_dir)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    names = {f.name for f in fields(DeviceProfile)}
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION or not names >= set(data):
        return None
    try:
        return DeviceProfile(**data)
    except TypeError:
        return None


def save_profile(profile: DeviceProfile, cache_dir: Optional[str] = None) -> Path:
    """Write the profile atomically; returns its path."""
    path = profile_path(profile.device, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(asdict(profile), indent=1) + "\n")
    return path


def prior_profile(preset: GpuPreset, key: Optional[str] = None) -> DeviceProfile:
    """Uncalibrated starting values for ``preset``.

    GPU presets: the planner's assumptions (``DEFAULT_MFU`` of dense peak, ``BUS_EFFICIENCY`` of the
    links, ``FRAMEWORK_OVERHEAD_BYTES``) plus small per-call latencies. ``cpu``: round numbers of the
    order seen with megatron-core 0.16.1 on gloo (torch 2.13 CPU, a 2-core VM): ~365 MiB RSS per
    rank before the model (4-rank gpt_tiny ranks peak at 385-391 MiB; 430 before the ranks kept
    transformers out, :mod:`orchestrator.runtime.rank.startup`), tens of GFLOP/s per core,
    milliseconds of Python per layer pass and per gloo call; calibration replaces them.
    """
    key = key or device_key(preset.name)
    if preset.name.lower() == "cpu":
        return DeviceProfile(
            device=key,
            description=f"{cpu_model_name()} ({os.cpu_count()} logical CPUs)",
            memory_overhead_bytes=365 * 2**20,
            states_factor=1.0,
            activation_factor=1.0,
            flops_per_s=3e10,
            intra_node_bytes_per_s=1e9,
            inter_node_bytes_per_s=1e8,
            latency_s=5e-4,
            layer_pass_s=3e-3,
            chunk_pass_s=3e-3,
            step_s=3e-2,
            cores=os.cpu_count() or 1,
        )
    return DeviceProfile(
        device=key,
        description=preset.name,
        memory_overhead_bytes=FRAMEWORK_OVERHEAD_BYTES,
        states_factor=1.0,
        activation_factor=1.0,
        flops_per_s=DEFAULT_MFU * preset.peak_flops_16bit,
        intra_node_bytes_per_s=BUS_EFFICIENCY * preset.intra_node_bw,
        inter_node_bytes_per_s=BUS_EFFICIENCY * preset.inter_node_bw,
        latency_s=2e-5,
        layer_pass_s=5e-5,
        chunk_pass_s=1e-4,
        step_s=1e-3,
    )


DEFAULT_GPU = "A100-80GB"
"""The GPU preset a GPU job is planned on when ``gpu`` is not set."""


def device_of(cfg) -> str:
    """The planner preset of the device ``cfg`` runs on: ``cpu`` for CPU ranks, else ``cfg.gpu`` (or :data:`DEFAULT_GPU`)."""
    return "cpu" if runs_on_cpu(cfg) else (cfg.gpu or DEFAULT_GPU)


def planned_device(cfg) -> str:
    """The preset a plan of ``cfg`` is for: ``gpu`` when set (a CPU job planned for the GPUs it will run on),
    else the device it runs on (:func:`device_of`)."""
    return cfg.gpu if cfg.gpu is not None else device_of(cfg)


def device_profile(preset: GpuPreset, cache_dir: Optional[str] = None) -> Optional[DeviceProfile]:
    """The stored profile of ``preset``'s device; for ``cpu`` without one, the uncalibrated
    :func:`prior_profile`; else None."""
    stored = load_profile(device_key(preset.name), cache_dir)
    if stored is None and preset.name.lower() == "cpu":
        return prior_profile(preset)
    return stored


def stage_memory_bytes(profile: DeviceProfile, states: float, activations: float) -> float:
    """Predicted peak bytes of one rank from the planner's states and activations of its stage."""
    return profile.memory_overhead_bytes + profile.states_factor * states + profile.activation_factor * activations
