"""The ``torch`` that megatron-core's CUDA-only modules see on CPU ranks (:mod:`orchestrator.runtime.rank.cpu`
installs it as those modules' global ``torch``): tensor factories with a CUDA ``device`` allocate on the CPU,
and the ``torch.cuda`` calls megatron makes on the paths that run here (current device, streams, events,
synchronisation, RNG state, memory counters, NVTX) are CPU no-ops or the CPU generator's. Every other
attribute is the real ``torch``; nothing here runs a collective or computes."""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable

import torch


def cpu_device(device: Any) -> Any:
    """Map any CUDA device spec (``"cuda"``, ``"cuda:1"``, an int, a cuda ``torch.device``) to ``"cpu"``."""
    if device is None:
        return None
    if isinstance(device, int):
        return "cpu"
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


def factory(fn: Callable) -> Callable:
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapped.__name__ = getattr(fn, "__name__", "factory")
    return wrapped


class NullEvent:
    """Stands in for ``torch.cuda.Event``: on CPU every operation has completed when it returns."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        return None

    def wait(self, *args, **kwargs):
        return None

    def record(self, *args, **kwargs):
        return None

    def query(self):
        return True


class NullStream:
    """Stands in for ``torch.cuda.Stream``: waits are no-ops, a recorded event is already complete."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def record_event(self, *args, **kwargs):
        return NullEvent()

    def synchronize(self):
        return None


class CudaOnCpu(types.SimpleNamespace):
    """The parts of ``torch.cuda`` megatron-core touches on the paths we run, as CPU no-ops."""

    def __getattr__(self, name: str) -> Any:  # anything else: the real torch.cuda
        return getattr(torch.cuda, name)


def cuda_namespace() -> CudaOnCpu:
    null_ctx = lambda *a, **k: contextlib.nullcontext()  # noqa: E731
    return CudaOnCpu(
        current_device=lambda: "cpu",
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        Stream=NullStream,
        Event=NullEvent,
        stream=null_ctx,
        current_stream=lambda *a, **k: NullStream(),
        default_stream=lambda *a, **k: NullStream(),
        device=null_ctx,
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        manual_seed=lambda seed: torch.manual_seed(seed),
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None, range=null_ctx),
    )


class TorchOnCpu(types.ModuleType):
    """A stand-in for the ``torch`` module inside the patched megatron modules."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = cuda_namespace()
        for name in (
            "zeros",
            "ones",
            "empty",
            "full",
            "tensor",
            "arange",
            "randn",
            "rand",
            "zeros_like",
            "ones_like",
            "empty_like",
            "as_tensor",
        ):
            setattr(self, name, factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)
