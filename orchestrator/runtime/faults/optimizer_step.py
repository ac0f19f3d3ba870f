"""One optimizer step that never applies a non-finite update (the ``skip`` NaN policy of
:class:`~orchestrator.runtime.faults.guard.Guard`): megatron-core's own sequence
(``prepare_grads`` -> ``get_grad_norm`` -> clip -> ``step_with_ready_grads``) with the last two left out
for a NaN/inf global gradient norm. Torch and megatron-core are imported inside the functions."""

from __future__ import annotations

import math
from typing import Optional, Tuple


def step_unless_nonfinite(optimizer, clip: float) -> Tuple[str, bool, Optional[float]]:
    """``(state, update_ok, grad_norm)``: state ``applied`` | ``skipped`` (non-finite norm, nothing
    applied) | ``overflow`` (fp16: megatron's loss scaler skipped and rescaled; grad_norm None).
    ``grad_norm`` is the global norm, also with ``clip`` = ``optimizer.clip_grad`` = 0."""
    import torch

    with torch.no_grad():
        if optimizer.prepare_grads():
            return "overflow", False, None
        grad_norm = float(optimizer.get_grad_norm())
        if not math.isfinite(grad_norm):
            return "skipped", False, grad_norm
        if clip > 0.0:
            _clip(optimizer, clip, grad_norm)
        ok = optimizer.step_with_ready_grads()
    return "applied", bool(ok), grad_norm


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _clip(optimizer, clip: float, grad_norm: float) -> None:
    """Scale every sub-optimizer's gradients by ``clip / grad_norm`` when below 1 (megatron's rule,
    through the module attribute so the CPU backend's replacement applies)."""
    from megatron.core.optimizer import optimizer as mopt

    for sub in _sub_optimizers(optimizer):
        if getattr(sub, "is_stub_optimizer", False):
            continue
        params = sub.get_parameters()
        if params:
            mopt.clip_grad_by_total_norm_fp32(
                params,
                max_norm=clip,
                total_norm=grad_norm,
                use_decoupled_grad=sub.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
            )


def local_grads_bad(optimizer) -> bool:
    """Whether this rank's own gradients hold a NaN/inf (False when unknown)."""
    import torch

    from orchestrator.runtime.rank.mcore import grads_for_grad_norm

    return optimizer is not None and any(
        not bool(torch.isfinite(g).all()) for sub in _sub_optimizers(optimizer) for g in grads_for_grad_norm(sub)
    )
