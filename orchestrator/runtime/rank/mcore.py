"""The megatron-core calls whose names or signatures differ between the lines we run: 0.16.x and 0.19.x.

Every version-dependent megatron-core call of the runtime is made here, each written for both lines;
no other module tests a version or probes megatron with ``hasattr``. Each call detects the spelling it
needs (the renamed attribute, the new parameter), so a 0.17/0.18 on a GPU machine (pyproject admits
0.16.1-0.19.x) takes whichever it has.

* CP split of a micro-batch: ``utils.get_batch_on_this_cp_rank``. 0.16.x: ``(batch, cp_group=None)``,
  None meaning parallel_state's CP group. 0.19.x: ``(batch, is_hybrid_cp, cp_group=None, ...)``,
  ``is_hybrid_cp`` required and None meaning the *world* group (a wrong split with DP > 1).
* The gradients of the grad norm (NaN attribution): 0.16.x ``optimizer.get_main_grads_for_grad_norm()``,
  0.19.x ``optimizer.get_grads_for_grad_norm(grad_norm_group=None)``.
* The checkpoint writer's results queue (a multiprocessing Manager, started at the first save):
  0.16.x ``filesystem_async._get_write_results_queue()``, 0.19.x
  ``filesystem_async.get_write_results_queue(mp_mode="spawn")``.
* Loading optimizer state: 0.16.x matches the saved param groups to the current ones by position;
  0.19.x by a key that includes ``max_lr`` / ``min_lr`` (``optimizer.param_group_identifier_keys``), so a
  resume with a new ``optimizer.lr`` (the config's schedule applies on resume, README) found no group
  and raised ValueError. :func:`load_optimizer_state` gives the saved groups the current lr bounds
  first (the runtime sets them from the config right after the load anyway).
* The MoE router without Transformer Engine: 0.16.x's ``transformer.moe.moe_utils`` binds
  ``te_general_gemm`` only when TE imports, yet its ``RouterGatingLinearFunction`` reads it always
  (NameError); 0.19.x binds it to None. :func:`moe_router_without_te` gives 0.16.x the None, so the router
  takes megatron's own ``torch.mm`` path, as 0.19.x does.
* The asynchronous-save queue: ``dist_checkpointing.strategies.async_utils.AsyncCallsQueue`` in both;
  0.19.x deprecates it for nvidia-resiliency-ext's (same interface), taken when installed.

* Notices at import and at run time: 0.19.x warns about its own defaults and logs two deprecations we
  cannot follow (``GPTModel`` -> ``HybridModel``, which has no local, non-TE layer spec and other
  state-dict keys; "MCore's async save" -> nvidia-resiliency-ext); :func:`quiet_notices` drops exactly
  those (called by ``orchestrator/runtime/__init__.py``, before any megatron import).
* The lines a CPU job runs on: :data:`LINES`, :func:`cpu_line_problem` (the CPU compatibility layer,
  :mod:`orchestrator.runtime.rank.cpu`, is tested on these only).

Same in both (relied on, tested on both): ``initialize_model_parallel(distributed_timeout_minutes=)``,
``filesystem_async._results_queue`` (the module's cached queue), ``GPTModel``, ``megatron.core.jit``'s
``disable_jit_fuser()`` and the ``try/except ImportError`` around megatron-core's own ``transformers`` and
``wandb`` imports (what :mod:`orchestrator.runtime.rank.startup` relies on), ``clip_grad_by_total_norm_fp32``
bound in :data:`CLIP_GRAD_MODULES` and the RNG helpers' ``graph_safe`` parameter (what the CPU layer
replaces). Across the lines' checkpoints: a line reads what its own and older lines saved, not newer
(0.16.1 fails inside its load on a 0.19.x checkpoint); that rule is applied before a job is queued, so it
lives torch-free below the runtime, in ``orchestrator/ckpt/compare.py`` (``_version_mismatch``).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from typing import Any, Callable, Dict, List, Optional

LINES = ("0.16.", "0.19.")
"""The megatron-core version prefixes the runtime is written and tested against (CPU: enforced by
:func:`orchestrator.runtime.rank.cpu.check_supported`; CI runs both, see README "Tests")."""

CLIP_GRAD_MODULES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")
"""The modules that bind ``clip_grad_by_total_norm_fp32`` (defined in the first, imported by the second)
in both lines: the CPU layer replaces it in each."""

IGNORED_WARNINGS = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "The pad token id in the tokenizer collides",
    # 0.19: TransformerConfig's own default (cuda_graph_modules="full"; CUDA graphs are off)
    "full scope is deprecated",
    # 0.19: importing megatron.core.models.mimo (get_megatron_optimizer does), and
    # log_single_rank before torch.distributed is up (GPTDatasetConfig in the launcher)
    "MimoModelConfig is experimental",
    "Could not determine rank from torch.distributed",
)
"""megatron-core's warnings at import on every rank: expected on CPU and without Apex/Transformer Engine,
and otherwise burying the training log."""

DROPPED_NOTICES = {
    "megatron.core.models.gpt.gpt_model": "GPTModel IS DEPRECATED",
    "megatron.core.dist_checkpointing.strategies.torch": "MCore's async save is deprecated",
}
"""0.19.x's deprecations logged at WARNING on every model build and first save, whose replacements we
cannot take: ``HybridModel`` (no local layer spec, other state-dict keys: a 0.16 checkpoint would no
longer load) and NVRx (not a dependency; 0.19's *synchronous* torch_dist save runs through the
deprecated async path and logs it too). Logger name -> message prefix."""


class _DropNotice(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_notices() -> None:
    """Ignore :data:`IGNORED_WARNINGS` and drop :data:`DROPPED_NOTICES` (no megatron import; idempotent)."""
    for pattern in IGNORED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    for name, prefix in DROPPED_NOTICES.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) for f in logger.filters):
            logger.addFilter(_DropNotice(prefix))


def cpu_line_problem(version: str) -> Optional[str]:
    """Why megatron-core ``version`` cannot run a CPU job (one sentence with the fix), or None."""
    if version.startswith(LINES):
        return None
    return (
        f"a CPU run needs megatron-core {', '.join(v + 'x' for v in LINES)} (the CPU compatibility layer, "
        f"orchestrator/runtime/rank/cpu.py, is tested only there), found {version}; fix: pip install "
        "'megatron-core>=0.16.1,<0.17' (0.19.x needs Python 3.12), or run on GPUs (cluster.gpus_per_node=<n>), "
        "which megatron-core 0.16.1-0.19.x serve without this layer"
    )


def version() -> str:
    """The installed megatron-core's version (its distribution metadata, e.g. ``0.19.2``)."""
    from importlib.metadata import version as dist_version

    return dist_version("megatron-core")


def batch_on_cp_rank(batch: Dict[str, Any], cp_group) -> Dict[str, Any]:
    """megatron-core's zigzag CP split of ``batch`` over ``cp_group`` (always passed: 0.19 reads None as
    the world group). ``is_hybrid_cp=False``: one CP group of fixed size, as ``pretrain_gpt.py`` without
    ``--hybrid-context-parallel``."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:  # 0.19.x
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(batch, cp_group=cp_group)  # 0.16.x


def grads_for_grad_norm(optimizer) -> List[Any]:
    """The gradients a megatron (sub-)optimizer feeds its grad norm: main grads, no shared duplicates."""
    if hasattr(optimizer, "get_grads_for_grad_norm"):  # 0.19.x (None: the main norm's group)
        return optimizer.get_grads_for_grad_norm()
    return optimizer.get_main_grads_for_grad_norm()  # 0.16.x


def write_results_queue_starter() -> Optional[Callable[[], Any]]:
    """The function that starts (once) and returns megatron's checkpoint-writer results queue, or None
    for a megatron-core without one (nothing to shield)."""
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa
    except ImportError:  # pragma: no cover
        return None
    if hasattr(fsa, "get_write_results_queue"):  # 0.19.x
        return lambda: fsa.get_write_results_queue(mp_mode="spawn")
    return getattr(fsa, "_get_write_results_queue", None)  # 0.16.x


def write_results_queue_started() -> bool:
    """Whether megatron's writer results queue of this process exists already."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    return getattr(fsa, "_results_queue", None) is not None


def set_write_results_queue(queue: Any) -> None:
    """Make ``queue`` the one megatron's writers use (both lines cache it in ``_results_queue``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fsa

    fsa._results_queue = queue


def load_optimizer_state(optimizer, state_dict: Any) -> None:
    """``optimizer.load_state_dict(state_dict)`` with the saved param groups' ``max_lr``/``min_lr`` set to
    the current groups' (position by position, as 0.16 loads them): 0.19.x matches groups by those."""
    from megatron.core.optimizer import optimizer as mopt

    if hasattr(mopt, "param_group_identifier_keys"):  # 0.19.x
        subs = subs_of(optimizer)
        many = state_dict.values() if isinstance(state_dict, dict) else state_dict
        parts = [state_dict] if len(subs) == 1 else list(many)
        for sub, part in zip(subs, parts):
            groups = part.get("param_groups") or (part.get("optimizer") or {}).get("param_groups") or []
            for saved, current in zip(groups, sub.optimizer.param_groups):
                saved["max_lr"], saved["min_lr"] = current.get("max_lr"), current.get("min_lr")
    optimizer.load_state_dict(state_dict)
    _own_adam_steps(subs_of(optimizer), state_dict)


def fill_distributed_optimizer_states(optimizer) -> None:
    """Give a fresh ``DistributedOptimizer``'s inner torch optimizer its states before a load.

    Without Apex or Transformer Engine (CPU ranks; a GPU job without them), megatron-core's
    ``DistributedOptimizer.state_dict()`` reads Adam's ``step`` from the inner optimizer's states, which are
    empty before the first step (``assert len(steps) == 1``, 0.16.1 and 0.19.2), so a resume failed before
    it read a byte. megatron-core fills them for its FSDP load with its own
    ``_init_optimizer_states_with_dummy_values`` (a zero-gradient step on the main shards); every value it
    writes is overwritten by the load that follows (the model's weights and the optimizer's states)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in subs_of(optimizer):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def subs_of(optimizer) -> list:
    """The optimizers a (chained) megatron optimizer holds, in its order (itself when not chained)."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _own_adam_steps(subs: list, state_dict: Any) -> None:
    """After a load, give every parameter of a ``DistributedOptimizer`` without Apex or Transformer Engine its
    own Adam ``step`` tensor holding the saved step.

    megatron-core's non-Apex/TE path (0.16.1 and 0.19.2 ``DistributedOptimizer.load_state_dict``: "Extract
    'step', for non-Apex/TE support") puts *one* tensor in every parameter's state, which torch's foreach
    Adam then increments once per parameter (52 times per step on gpt_tiny: bias corrections of step 105 at
    iteration 4), and the parameter-state load that follows leaves the value of the states it found (the
    zero-gradient step's 1, not the saved 2). A resumed run then took different updates from iteration 2 on
    (0.054 in the loss at iteration 12 of a PP2 x DP2 run). The saved step is the param groups' ``step``."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    if HAVE_APEX_OR_TE:
        return
    many = state_dict.values() if isinstance(state_dict, dict) else state_dict
    parts = [state_dict] if len(subs) == 1 else list(many)
    for sub, part in zip(subs, parts):
        groups = (part.get("optimizer") or {}).get("param_groups") or []
        steps = {float(g["step"]) for g in groups if g.get("step") is not None}
        if not isinstance(sub, DistributedOptimizer) or len(steps) != 1:
            continue
        step = steps.pop()
        for state in sub.optimizer.state.values():
            if "step" in state:
                state["step"] = torch.tensor(step, dtype=torch.float32)


def async_calls_queue_class() -> Any:
    """The ``AsyncCallsQueue`` class that drives asynchronous checkpoint writes: nvidia-resiliency-ext's
    when installed (what 0.19.x recommends; not run in this project), else megatron-core's own."""
    try:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue  # type: ignore
    except ImportError:
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    return AsyncCallsQueue


def moe_router_without_te() -> None:
    """Let megatron-core's MoE router run without Transformer Engine (its ``torch.mm`` path): bind
    ``moe_utils.te_general_gemm = None`` where the module left it undefined (0.16.x); a no-op on 0.19.x
    and wherever TE imported."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # 0.16.x without TE
        moe_utils.te_general_gemm = None
