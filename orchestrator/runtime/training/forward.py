"""One forward step of megatron-core's schedules (a micro-batch through a model chunk, CP's share of it), the loss it
reports, and evaluation: the forward-only schedule over the validation data."""

from __future__ import annotations

from functools import partial
from typing import List, Optional

import torch

from orchestrator.runtime.rank import cp, param_sync
from orchestrator.runtime.rank.build import Data, Rank
from orchestrator.runtime.rank.model import unwrap


def forward_step(data_iterator, model):
    """One micro-batch through one model chunk. Only chunks that embed or compute loss read data;
    with CP > 1 each rank keeps its share of the sequence (runtime.cp)."""
    inner = unwrap(model)
    needs_data = getattr(inner, "pre_process", True) or getattr(inner, "post_process", True)
    timers = inner.config.timers  # Megatron-LM's pretrain_gpt times its batch the same way (runtime.training.breakdown)
    if timers is not None:
        timers("batch-generator", log_level=2).start()
    batch = cp.batch_on_this_cp_rank(next(data_iterator)) if needs_data else None
    if timers is not None:
        timers("batch-generator").stop()
    tokens = batch["tokens"] if batch is not None else None
    position_ids = batch["position_ids"] if batch is not None else None
    labels = batch["labels"] if batch is not None else None
    output = model(tokens, position_ids, None, labels=labels)
    loss_mask = batch["loss_mask"] if batch is not None else None
    return output, partial(cp.loss_func, loss_mask)


def mean_loss(rank: Rank, per_step: List[torch.Tensor]) -> Optional[float]:
    """Mean of ``per_step`` (each a last-stage mean over micro-batches) over the loss group, read on
    the host; None on other stages (collective over the last stage's loss group)."""
    from megatron.core import parallel_state as ps

    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    total = torch.stack(per_step).double().sum().reshape(1) if per_step else torch.zeros(1, dtype=torch.float64)
    total = total.to(rank.tensor_device)
    group = cp.loss_group()
    torch.distributed.all_reduce(total, group=group)
    return float(total[0]) / (torch.distributed.get_world_size(group) * max(1, len(per_step)))


def step_loss(losses) -> Optional[torch.Tensor]:
    """This iteration's mean micro-batch loss as a tensor (no host sync); None off the last stage."""
    return torch.stack([x["lm loss"] for x in losses]).mean() if losses else None


def evaluate(rank: Rank, forward_backward, data: Data) -> Optional[float]:
    """Validation lm loss (nats/token) on the logging rank's stage; None on other stages.

    Collective: every rank runs the same forward-only schedule.
    """
    t, model = rank.cfg.training, rank.built.model
    iterators = data.valid()  # type: ignore[misc]
    per_step: List[torch.Tensor] = []
    for chunk in model:
        chunk.eval()
    with torch.no_grad(), param_sync.gathered(model):  # current params on every rank (Megatron-LM)
        for _ in range(t.eval_iters):
            losses = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iterators,
                model=model,
                num_microbatches=rank.layout.num_microbatches,
                seq_length=rank.cfg.model.seq_length,
                micro_batch_size=t.micro_batch_size,
                forward_only=True,
            )
            loss = step_loss(losses)
            if loss is not None:
                per_step.append(loss)
    for chunk in model:
        chunk.train()
    return mean_loss(rank, per_step)
