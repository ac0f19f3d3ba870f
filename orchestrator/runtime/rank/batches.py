"""The micro-batches a rank reads: a ``torch.utils.data.DataLoader`` in Megatron's pretraining order.

Order (Megatron-LM's ``MegatronPretrainingSampler``, ``megatron/training/datasets/data_samplers.py``): global
batch ``k`` holds samples ``[k*GBS, (k+1)*GBS)``; within it, micro-batch ``j`` of DP rank ``r`` holds samples
``k*GBS + j*MBS*DP + r*MBS + [0, MBS)``. It depends only on the consumed-sample count, so every layout, every
resume and a batch-size ramp (which changes the micro-batches per iteration, not their order) see the same
global batches. Past the dataset's end the indices wrap around (megatron-core's GPTDataset is built with the
samples the run needs, so they never do in a run of ``train_iters``).

Loading (Megatron-LM's ``build_pretraining_data_loader``): a DataLoader over that batch sampler with
``data.num_workers`` worker processes (Megatron-LM's ``--num-workers``, default 2), persistent, each
prefetching 2 micro-batches, and pinned host memory on a GPU; the copy to the device is non-blocking. A CPU
rank reads in its own process by default (its cores are the job's ranks'; a worker would compete with them).
Workers ignore the job's signals (SIGINT, SIGTERM, SIGUSR1, SIGUSR2): the rank decides a stop with its peers
and keeps reading until the agreed iteration; a worker ends with its rank (torch checks the parent's liveness).
"""

from __future__ import annotations

import signal
from typing import Dict, Iterator, List, Optional

KEYS = ("tokens", "labels", "loss_mask", "position_ids")
"""What megatron's GPT forward step reads of a GPTDataset sample."""

WORKERS_ON_GPU = 2
"""``data.num_workers=null`` on a GPU rank: Megatron-LM's ``--num-workers`` default."""


def loader_workers(num_workers: Optional[int], device: str) -> int:
    """Worker processes of a rank's DataLoader: ``data.num_workers``, or (null) 2 on ``cuda``, 0 on ``cpu``."""
    if num_workers is not None:
        return num_workers
    return WORKERS_ON_GPU if device == "cuda" else 0


class PretrainingBatchSampler:
    """This DP rank's sample indices, one list of ``micro_batch_size`` per micro-batch, from ``consumed_samples``
    on (the module docstring's order); endless. A ``batch_sampler`` for ``torch.utils.data.DataLoader``."""

    def __init__(self, total: int, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        if total <= 0:
            raise ValueError(f"an empty dataset has no micro-batches (total={total})")
        self.total, self.next_sample = total, consumed_samples
        self.mbs, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size

    def __iter__(self) -> Iterator[List[int]]:
        while True:
            start = self.next_sample + self.dp_rank * self.mbs
            self.next_sample += self.mbs * self.dp_size
            yield [(start + i) % self.total for i in range(self.mbs)]


def _collate(items: List[Dict[str, object]]) -> Dict[str, object]:
    """Stack the samples' :data:`KEYS` into ``[micro_batch_size, seq_length]`` tensors."""
    import torch

    return {key: torch.stack([item[key] for item in items]) for key in KEYS}  # type: ignore[misc]


def _ignore_job_signals(_worker_id: int) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)


class MicroBatchIterator:
    """The iterator megatron's schedule reads: this DP rank's micro-batches from ``consumed_samples`` on, each a
    dict of :data:`KEYS` tensors of shape ``[micro_batch_size, seq_length]`` on ``device``.

    ``num_workers``: DataLoader worker processes (0: read in this process), started at the first read; raises
    ValueError for an empty dataset."""

    def __init__(
        self,
        dataset,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        device: str = "cpu",
        num_workers: int = 0,
    ):
        import torch

        self.device = device
        sampler = PretrainingBatchSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
        extra = dict(persistent_workers=True, prefetch_factor=2, worker_init_fn=_ignore_job_signals)
        self.loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=_collate,
            num_workers=num_workers,
            pin_memory=device == "cuda",
            **(extra if num_workers > 0 else {}),
        )
        self._batches = None  # started at the first read: a chunk that never reads (a middle stage) starts no worker

    def __iter__(self):
        return self

    def close(self) -> None:
        """Stop this iterator's DataLoader workers (none started: nothing to do). The loader and its persistent
        iterator are dropped, so torch's iterator shuts its workers down at once (its ``__del__``). Left to the
        collector instead, a worker could outlive training: the workers ignore the job's signals, so at the
        process's exit multiprocessing's ``terminate()`` does not end them and its ``join()`` waits (seen: a
        Ctrl-C'd job's rank hung 60 s, until its exit watchdog, once start-up's objects were frozen)."""
        self._batches, self.loader = None, None

    def __next__(self) -> Dict[str, object]:
        if self._batches is None:
            self._batches = iter(self.loader)
        batch = next(self._batches)
        return {key: value.to(self.device, non_blocking=True) for key, value in batch.items()}
