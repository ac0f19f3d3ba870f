"""Megatron-LM's parameter/gradient sync hooks for the overlapped distributed optimizer: one place.

With ``ddp_config.overlap_param_gather`` (distributed optimizer), megatron-core launches each bucket's
parameter all-gather from the *next* forward's pre-hook, so between ``optimizer.step()`` and that forward
the copies of parameters a rank does not own are one step old. Megatron-LM (``megatron/training/training.py``)
therefore:

- forces the gather before every ``save_checkpoint`` and every ``evaluate`` with its module-level
  ``disable_forward_pre_hook(model, param_sync=True)`` and re-enables with ``enable_forward_pre_hook(model)``
  (both gated by ``should_disable_forward_pre_hook(args)``: distributed optimizer and overlap_param_gather);
  :func:`gathered` is that pair;
- in ``train()`` sets ``config.grad_sync_func`` (``align_grad_reduce``, with ``overlap_grad_reduce``) and
  ``config.param_sync_func`` (``overlap_param_gather`` and ``align_param_gather``) to the chunks'
  ``start_grad_sync`` / ``start_param_sync`` (a list per chunk, a single callable with one chunk), which
  the pipeline schedules call to dispatch the next bucket's collective; :func:`set_sync_funcs` is that.

Nothing here reimplements a collective: megatron-core's DDP methods do the work.
"""

from contextlib import contextmanager
from typing import Iterator, List


def _ddp_config(model: List[object]):
    return getattr(model[0], "ddp_config", None)


def overlapped_param_gather(model: List[object]) -> bool:
    """True when the forward pre-hooks hold the param all-gather (Megatron-LM's should_disable_forward_pre_hook)."""
    ddp = _ddp_config(model)
    return bool(ddp is not None and ddp.use_distributed_optimizer and ddp.overlap_param_gather)


def set_sync_funcs(model: List[object], tf_config) -> None:
    """Set ``tf_config.grad_sync_func`` / ``param_sync_func`` as Megatron-LM's ``train()`` does.

    ``model``: the DDP-wrapped chunks (one per virtual pipeline stage). Leaves the fields None when the
    overlaps are off (the schedules then dispatch nothing early).
    """
    ddp = _ddp_config(model)
    if ddp is None:
        return

    def one_or_list(funcs):
        return funcs[0] if len(funcs) == 1 else funcs

    if ddp.overlap_grad_reduce:  # Megatron-LM: and args.align_grad_reduce (default True; no flag here)
        tf_config.grad_sync_func = one_or_list([chunk.start_grad_sync for chunk in model])
    if ddp.overlap_param_gather and ddp.align_param_gather:
        tf_config.param_sync_func = one_or_list([chunk.start_param_sync for chunk in model])


@contextmanager
def gathered(model: List[object]) -> Iterator[None]:
    """Parameters all-gathered (current on every rank) inside; the forward pre-hooks back on after.

    Megatron-LM's ``disable_forward_pre_hook(model, param_sync=True)`` ... ``enable_forward_pre_hook(model)``
    around ``save_checkpoint`` and ``evaluate``. Collective when the overlap is on: every rank enters.
    A no-op otherwise.
    """
    if not overlapped_param_gather(model):
        yield
        return
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        for chunk in model:
            chunk.enable_forward_pre_hook()
