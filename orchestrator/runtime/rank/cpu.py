"""megatron-core on CPU: the compatibility layer, in one place.

megatron-core is written for CUDA. Its real GPT model, 1F1B / interleaved
schedules, DDP, optimizer and dist_checkpointing run on CPU with gloo once the
CUDA-only spots below are redirected. :func:`activate` does that; it is called
only when the job's device is ``cpu`` and refuses megatron-core versions it was
not checked against (:data:`SUPPORTED_MEGATRON`).

What it changes (megatron-core 0.16.1 and 0.19.2 alike), all scoped to the named modules:

1. Device literals. ``pipeline_parallel.schedules``, ``pipeline_parallel.p2p_communication``,
   ``distributed.param_and_grad_buffer``, ``distributed.distributed_data_parallel``,
   ``optimizer.clip_grads``, ``optimizer.optimizer``, ``models.gpt.gpt_model`` and
   ``tensor_parallel.random``, ``utils`` (GlobalMemoryBuffer), the transformer and
   tensor-parallel layers (causal masks, TP buffers) and others in
   :data:`PATCHED_MODULES` allocate with ``device="cuda"`` /
   ``torch.cuda.current_device()`` and call ``torch.cuda.synchronize()`` or
   streams. Each of those modules gets a proxy of ``torch`` as its module-global
   ``torch`` that maps CUDA devices to ``cpu`` in tensor factories and turns
   ``torch.cuda`` stream / sync / memory calls into CPU no-ops. Every other
   attribute is the real ``torch``.
2. RNG tracker. ``tensor_parallel.random`` keeps named CUDA RNG states for TP
   regions; through the proxy its ``torch.cuda`` RNG calls and its private
   get/set-state helpers use the CPU default generator instead.
3. Gradient clipping. ``clip_grad_by_total_norm_fp32`` asserts
   ``param.grad.type() == 'torch.cuda.FloatTensor'``; it is replaced by a
   CPU-safe function with the same contract (scale every grad by
   ``max_norm / (total_norm + 1e-6)`` when that is < 1).
4. Tied embeddings with PP > 1: ``LanguageModule.setup_embeddings_and_output_layer``
   moves the shared weight with ``weight.data.cuda()`` before its all-reduce over the
   embedding group; on CPU that call is made a no-op for the duration of the method.
5. MoE's alltoall token dispatcher (``transformer.moe.token_dispatcher``) turns its split sizes into
   host NumPy arrays with ``maybe_move_tensor_to_cpu(..., as_numpy=True)`` only for CUDA tensors; on
   CPU they stayed tensors, which gloo's ``all_to_all_single`` refuses as split sizes. Its
   :func:`_maybe_move_tensor_to_cpu` twin converts CPU tensors as well (same contract). Its CUDA
   stream and event (the device-to-host copy) are :class:`_NullStream` / :class:`_NullEvent`.
6. dist_checkpointing needs ``psutil`` (a declared dependency) or its writer
   process dies and ``save()`` hangs; :func:`activate` checks it is importable.

The distributed optimizer is refused on CPU by megatron-core's own tensor-type
checks; :func:`check_supported` turns that into a clear config error.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import types
from typing import Any, Callable, Dict, List

import torch

from orchestrator.errors import BackendError
from orchestrator.runtime.rank import mcore

SUPPORTED_MEGATRON = mcore.LINES
"""megatron-core version prefixes this layer was written and tested against (0.16.x and 0.19.x, the lines
of :mod:`orchestrator.runtime.rank.mcore`). GPU jobs never import-depend on this module's patches: they
run megatron-core 0.16.1-0.19.x as it is."""

PATCHED_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.optimizer",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.tensor_parallel.random",
    "megatron.core.utils",
    "megatron.core.parallel_state",
    "megatron.core.rerun_state_machine",
    "megatron.core.transformer.utils",
    "megatron.core.transformer.module",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.tensor_parallel.data",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.pipeline_parallel.utils",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.torch",
    # MoE (model.num_moe_experts): the alltoall dispatcher's device-to-host stream and its
    # synchronisation, the router's and aux-loss tracker's device tensors
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.experts",
)

_ACTIVE = False
_ORIGINALS: Dict[str, Any] = {}


def _cpu_device(device: Any) -> Any:
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


def _factory(fn: Callable) -> Callable:
    def wrapped(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return fn(*args, **kwargs)

    wrapped.__name__ = getattr(fn, "__name__", "factory")
    return wrapped


class _NullEvent:
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


class _NullStream:
    """Stands in for ``torch.cuda.Stream``: waits are no-ops, a recorded event is already complete."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs):
        return None

    def wait_event(self, *args, **kwargs):
        return None

    def record_event(self, *args, **kwargs):
        return _NullEvent()

    def synchronize(self):
        return None


class _CudaOnCpu(types.SimpleNamespace):
    """The parts of ``torch.cuda`` megatron-core touches on the paths we run, as CPU no-ops."""

    def __getattr__(self, name: str) -> Any:  # anything else: the real torch.cuda
        return getattr(torch.cuda, name)


def _make_cuda_namespace() -> _CudaOnCpu:
    null_ctx = lambda *a, **k: contextlib.nullcontext()  # noqa: E731
    return _CudaOnCpu(
        current_device=lambda: "cpu",
        synchronize=lambda *a, **k: None,
        empty_cache=lambda: None,
        Stream=_NullStream,
        Event=_NullEvent,
        stream=null_ctx,
        current_stream=lambda *a, **k: _NullStream(),
        default_stream=lambda *a, **k: _NullStream(),
        device=null_ctx,
        get_rng_state=lambda *a, **k: torch.get_rng_state(),
        set_rng_state=lambda state, *a, **k: torch.set_rng_state(state),
        manual_seed=lambda seed: torch.manual_seed(seed),
        memory_allocated=lambda *a, **k: 0,
        max_memory_allocated=lambda *a, **k: 0,
        nvtx=types.SimpleNamespace(range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None, range=null_ctx),
    )


class _TorchOnCpu(types.ModuleType):
    """A stand-in for the ``torch`` module inside the patched megatron modules."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _make_cuda_namespace()
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
            setattr(self, name, _factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _clip_grad_by_total_norm_fp32_cpu(parameters, max_norm, total_norm, use_decoupled_grad=False):
    """CPU twin of megatron's ``clip_grad_by_total_norm_fp32``.

    Scales every gradient in place by ``max_norm / (total_norm + 1e-6)`` when that
    coefficient is below 1 (the same rule as megatron-core 0.16.1), without the
    CUDA tensor-type assertion.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads: List[torch.Tensor] = []
    for param in parameters:
        grad = getattr(param, "decoupled_grad", None) if use_decoupled_grad else param.grad
        if grad is not None:
            if hasattr(grad, "to_local"):
                grad = grad.to_local()
            grads.append(grad.detach())
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0 and grads:
        torch._foreach_mul_(grads, clip_coeff)


def _maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
    """CPU twin of megatron's ``moe_utils.maybe_move_tensor_to_cpu``: the tensor on the host, as a NumPy
    array when ``as_numpy`` (megatron converts only CUDA tensors; here every tensor already is on the host)."""
    if torch.is_tensor(tensor):
        tensor = tensor.detach().cpu()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def _get_rng_state_cpu(device=None, clone=False, graph_safe=False):
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_rng_state_cpu(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def check_supported(version: "str | None" = None) -> None:
    """Raise :class:`BackendError` when megatron-core ``version`` (default: the installed one) is not
    one this layer was checked against, or psutil is missing."""
    problem = mcore.cpu_line_problem(version or mcore.version())
    if problem:
        raise BackendError(problem)
    try:
        import psutil  # noqa: F401
    except ImportError:
        raise BackendError(
            "psutil is not installed: megatron dist_checkpointing's writer process dies without it and save() "
            "hangs; fix: pip install psutil"
        ) from None


def activate() -> None:
    """Install the CPU compatibility layer (idempotent). Raises BackendError on an unknown version."""
    global _ACTIVE
    if _ACTIVE:
        return
    check_supported()
    proxy = _TorchOnCpu()
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        _ORIGINALS[name + ".torch"] = module.torch
        module.torch = proxy
    random = importlib.import_module("megatron.core.tensor_parallel.random")
    for attr, repl in (("_get_cuda_rng_state", _get_rng_state_cpu), ("_set_cuda_rng_state", _set_rng_state_cpu)):
        _ORIGINALS[f"{random.__name__}.{attr}"] = getattr(random, attr)
        setattr(random, attr, repl)
    dispatcher = importlib.import_module("megatron.core.transformer.moe.token_dispatcher")
    _ORIGINALS[f"{dispatcher.__name__}.maybe_move_tensor_to_cpu"] = dispatcher.maybe_move_tensor_to_cpu
    dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu
    # The tracker warns whenever the CPU state moves inside fork(); on CPU that is by design.
    logging.getLogger(random.__name__).setLevel(logging.ERROR)
    for modname in mcore.CLIP_GRAD_MODULES:
        module = importlib.import_module(modname)
        _ORIGINALS[f"{modname}.clip_grad_by_total_norm_fp32"] = module.clip_grad_by_total_norm_fp32
        module.clip_grad_by_total_norm_fp32 = _clip_grad_by_total_norm_fp32_cpu
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original_setup = LanguageModule.setup_embeddings_and_output_layer
    _ORIGINALS[
        "megatron.core.models.common.language_module.language_module.LanguageModule.setup_embeddings_and_output_layer"
    ] = original_setup

    def setup_embeddings_and_output_layer_cpu(self):
        saved = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # keep the shared weight where it is (CPU)
        try:
            return original_setup(self)
        finally:
            torch.Tensor.cuda = saved

    LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer_cpu
    _ACTIVE = True


def deactivate() -> None:
    """Undo :func:`activate` (for tests)."""
    global _ACTIVE
    for key, value in _ORIGINALS.items():
        if key.endswith("LanguageModule.setup_embeddings_and_output_layer"):
            from megatron.core.models.common.language_module.language_module import LanguageModule

            LanguageModule.setup_embeddings_and_output_layer = value
            continue
        modname, attr = key.rsplit(".", 1)
        setattr(importlib.import_module(modname), attr, value)
    _ORIGINALS.clear()
    _ACTIVE = False


def is_active() -> bool:
    return _ACTIVE
