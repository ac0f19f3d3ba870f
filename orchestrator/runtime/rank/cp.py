"""Context parallelism (CP) the megatron-core way: split each micro-batch's sequence, reduce the loss.

With ``parallelism.context_parallel_size = CP > 1`` the CP ranks of one group read the same
micro-batch (they share a data-parallel rank) and each keeps 2 of the ``2·CP`` sequence chunks,
chosen by megatron-core's :func:`megatron.core.utils.get_batch_on_this_cp_rank` over the CP group
(:func:`orchestrator.runtime.rank.mcore.batch_on_cp_rank`): chunks ``i`` and
``2·CP−1−i`` on CP rank ``i``, so causal attention work is balanced. ``seq_length % (2·CP) == 0``
is checked before launch (``config/layout_rules.py``). Attention across the chunks is Transformer Engine's
(megatron's local attention has no CP), so CP > 1 needs the TE layer spec
(:func:`orchestrator.runtime.rank.megatron_config.resolve_transformer_impl` refuses it otherwise).

The loss of a micro-batch is the mean over its *whole* sequence: each CP rank sums its tokens'
losses, the (sum, count) pair is all-reduced over the CP group (a value only, no gradient), and the
rank's loss is ``local_sum / global_count`` — its share of the full-sequence mean. megatron's
schedule multiplies a 2-tuple loss by the CP size and its DDP averages gradients over DP × CP
(``get_data_parallel_group(with_context_parallel=True)``), which together give the gradient of the
full-sequence mean. The reported ``lm loss`` is the full-sequence mean on every CP rank, so the
logged loss (averaged over DP × CP) is the same number as without CP. With CP = 1 this is exactly
``sum(loss · mask) / sum(mask)``.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch


def cp_size() -> int:
    """The context-parallel world size of megatron's parallel state (1 before it is initialised)."""
    from megatron.core import parallel_state as ps

    return ps.get_context_parallel_world_size() if ps.model_parallel_is_initialized() else 1


def batch_on_this_cp_rank(
    batch: Optional[Dict[str, Optional[torch.Tensor]]],
) -> Optional[Dict[str, Optional[torch.Tensor]]]:
    """This CP rank's share of a micro-batch (``tokens``, ``labels``, ``loss_mask``, ``position_ids``:
    ``[b, s]`` → ``[b, s / CP]``); the batch itself when CP = 1 or there is none (middle stages)."""
    if batch is None or cp_size() == 1:
        return batch
    from megatron.core import parallel_state as ps

    from orchestrator.runtime.rank.mcore import batch_on_cp_rank

    return batch_on_cp_rank(dict(batch), ps.get_context_parallel_group())


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """This rank's share of the micro-batch's mean per-token cross entropy (nats), and the full mean.

    ``loss_mask`` and ``output_tensor`` (per-token losses): ``[b, s / CP]``. Returns
    ``(local_sum / global_count, {"lm loss": global_sum / global_count})`` (global: over the CP group).
    """
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    local_sum = torch.sum(losses * mask)
    if cp_size() == 1:
        loss = local_sum / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}  # megatron divides the loss in place (/= num_microbatches)
    from megatron.core import parallel_state as ps

    totals = torch.stack([local_sum.detach(), mask.sum()])
    torch.distributed.all_reduce(totals, group=ps.get_context_parallel_group())
    return local_sum / totals[1], {"lm loss": (totals[0] / totals[1]).detach()}


def loss_group():
    """The group the logged lm loss is averaged over: DP × CP (every CP rank reports the same mean)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True)
