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
   stream and event (the device-to-host copy) are :class:`~orchestrator.runtime.rank.cpu_torch.NullStream` /
   :class:`~orchestrator.runtime.rank.cpu_torch.NullEvent`.
6. dist_checkpointing needs ``psutil`` (a declared dependency) or its writer
   process dies and ``save()`` hangs; :func:`activate` checks it is importable.

7. The distributed optimizer. ``DistributedOptimizer.__init__`` sorts parameters by ``param.type()``
   against CUDA type names and raises TypeError for a CPU tensor; while it builds, a CPU float tensor
   answers with its CUDA twin's name (:func:`_let_distributed_optimizer_take_cpu_tensors`). Everything
   after that is megatron-core's own: DDP's contiguous buffers, the reduce-scatter of gradients and the
   all-gather of parameters (async gloo work handles with ``overlap_grad_reduce`` /
   ``overlap_param_gather``), the sharded Adam step, dp_reshardable checkpoints (tests/test_distopt.py).

The tensor tests of the proxy and the twins: tests/test_cpu_backend.py.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Callable, Dict, List

import torch

from orchestrator.errors import BackendError
from orchestrator.runtime.rank import mcore
from orchestrator.runtime.rank.cpu_torch import TorchOnCpu

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
    "megatron.core.optimizer.distrib_optimizer",
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
    proxy = TorchOnCpu()
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
    _let_distributed_optimizer_take_cpu_tensors()
    _ACTIVE = True


_CUDA_TYPE_NAMES = {"torch.FloatTensor", "torch.HalfTensor", "torch.BFloat16Tensor"}


def _type_as_cuda(original: Callable) -> Callable:
    """``Tensor.type`` that names a CPU float tensor by its CUDA twin (``torch.FloatTensor`` ->
    ``torch.cuda.FloatTensor``) when asked for its name (no arguments); a conversion is the real one."""

    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if args or kwargs or name not in _CUDA_TYPE_NAMES:
            return name
        return "torch.cuda." + name[len("torch.") :]

    return type_


def _let_distributed_optimizer_take_cpu_tensors() -> None:
    """``DistributedOptimizer.__init__`` sorts parameters by ``param.type()`` against CUDA type names
    (``'torch.cuda.FloatTensor'`` ...; 0.16.1 distrib_optimizer.py ``_build_model_and_main_param_groups`` and
    ``__init__``, 0.19.2 likewise) and raises TypeError for anything else. While it builds, a CPU float
    tensor answers with its CUDA twin's name, so the real sharding runs on CPU tensors; nothing else is
    changed and ``Tensor.type`` is the real one again when it returns."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original_init = DistributedOptimizer.__init__
    key = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__"
    _ORIGINALS[key] = original_init

    def init_on_cpu(self, *args, **kwargs):
        saved = torch.Tensor.type
        torch.Tensor.type = _type_as_cuda(saved)
        try:
            return original_init(self, *args, **kwargs)
        finally:
            torch.Tensor.type = saved

    DistributedOptimizer.__init__ = init_on_cpu


def deactivate() -> None:
    """Undo :func:`activate` (for tests)."""
    global _ACTIVE
    for key, value in _ORIGINALS.items():
        if key.endswith("LanguageModule.setup_embeddings_and_output_layer"):
            from megatron.core.models.common.language_module.language_module import LanguageModule

            LanguageModule.setup_embeddings_and_output_layer = value
            continue
        if key.endswith("DistributedOptimizer.__init__"):
            from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

            DistributedOptimizer.__init__ = value
            continue
        modname, attr = key.rsplit(".", 1)
        setattr(importlib.import_module(modname), attr, value)
    _ORIGINALS.clear()
    _ACTIVE = False


def is_active() -> bool:
    return _ACTIVE
