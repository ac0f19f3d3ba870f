"""A logging iteration's one collective: everything the ranks agree on or report there, in one all-reduce.

Megatron-LM's step spends one collective on the loss (``train_step``: the last stage's all-reduce of
``[loss sum, tokens]`` over DP x CP, every iteration) and one more every ``--log-interval`` (``training_log``'s
interval timer, ``timers('interval-time').elapsed(barrier=True)``). The loop here spends one all-reduce (SUM
over the world, float64, on the rank's tensor device), on logging iterations only, and everything it reports
rides on it:

* the loss: ``[mean over the iteration's micro-batches, 1]`` from each last-stage rank, zeros elsewhere, so
  the sum's ratio is the mean over the last stage's ranks (its TP copies are equal: the mean over its DP x CP
  loss group, as Megatron-LM's);
* the stop poll's ``[signal flag, seconds since the previous poll]`` from every rank
  (runtime.training.stop_poll);
* when due, each rank's straggler row (runtime.faults.straggler) and step-breakdown row
  (runtime.training.breakdown), written into the rank's own slot of a ``world x width`` block that is zero
  elsewhere, so the sum is an all-gather of the rows.

Every rank must add the same parts with the same widths in the same order (what is due is decided from
iteration counts alone, the same on every rank). One host read of the result (``tolist``): on a GPU the
iteration's one device synchronisation, as Megatron-LM's ``.item()`` of the loss at its log interval.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch


class Exchange:
    """The parts of one logging all-reduce. ``add`` a per-rank contribution to be summed, or ``add_row`` this
    rank's row of a block every rank contributes one row to; :meth:`all_reduce` runs the collective."""

    def __init__(self, device, rank: int, world: int):
        self.device, self.rank, self.world = device, rank, world
        self._parts: List[Tuple[str, List[float], bool]] = []  # (name, values, a row of a world x width block)

    def add(self, name: str, values: Sequence[float]) -> None:
        self._parts.append((name, [float(v) for v in values], False))

    def add_row(self, name: str, values: Sequence[float]) -> None:
        self._parts.append((name, [float(v) for v in values], True))

    def all_reduce(self, loss: Optional[torch.Tensor] = None) -> Dict[str, object]:
        """Run the all-reduce (collective over the world). ``loss``: this rank's loss tensor (a 0-d tensor on the
        device, read nowhere before), or None off the last stage. Returns ``{"loss": mean over the ranks that
        had one, or None}``, each ``add``'s sums (a list) and each ``add_row``'s rows (a list of ``world``
        lists, rank order)."""
        sizes = [len(v) * (self.world if row else 1) for _, v, row in self._parts]
        flat = torch.zeros(2 + sum(sizes), dtype=torch.float64)
        offset = 2
        for (_, values, row), size in zip(self._parts, sizes):
            at = offset + (self.rank * len(values) if row else 0)
            flat[at : at + len(values)] = torch.tensor(values, dtype=torch.float64)
            offset += size
        flat = flat.to(self.device)
        if loss is not None:
            flat[0], flat[1] = loss.detach().double(), 1.0  # on the device: no host sync
        torch.distributed.all_reduce(flat)
        summed = flat.tolist()
        out: Dict[str, object] = {"loss": summed[0] / summed[1] if summed[1] else None}
        offset = 2
        for (name, values, row), size in zip(self._parts, sizes):
            chunk = summed[offset : offset + size]
            out[name] = [chunk[r * len(values) : (r + 1) * len(values)] for r in range(self.world)] if row else chunk
            offset += size
        return out
