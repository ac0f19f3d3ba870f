"""Everything a rank builds before its first iteration, in order.

:func:`build_rank` — distributed init → CPU backend (device=cpu) → the launcher's layout (carried, not derived) →
megatron parallel state + seeds → tokenizer → GPT chunks, DDP, optimizer, LR schedule (megatron's
``OptimizerParamScheduler``; on resume the config's schedule wins, see
:mod:`orchestrator.runtime.training.resume`) → the hooks megatron's schedules call (no_sync, finalize grads,
loss scale).

:func:`build_data` — megatron-core GPTDatasets (train, and the held-out validation split when
``training.eval_iters > 0``) and this rank's micro-batch iterators, positioned at the consumed
sample count.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from orchestrator.config.layout import ParallelLayout
from orchestrator.config.schema import JobConfig
from orchestrator.runtime.rank import cpu as cpu_backend
from orchestrator.runtime.rank import param_sync
from orchestrator.runtime.rank.distributed import init_distributed
from orchestrator.runtime.rank.model import Built, build_model_and_optimizer, initialize_parallel_state


def say(message: str) -> None:
    """One progress line from this rank (the launcher streams rank 0's ``[orchestrator]`` lines)."""
    print(f"[orchestrator] {message}", flush=True)


@dataclass
class Rank:
    """What one rank built: who it is, the layout, megatron's objects."""

    cfg: JobConfig
    layout: ParallelLayout
    info: object  # runtime.distributed's DistInfo: rank, world_size, device, backend (, hosts)
    tokenizer: object
    built: Built
    is_logger: bool
    """Last pipeline stage, first TP/CP/DP rank: holds the global lm loss and writes the metrics."""
    link_check: Optional[dict] = None
    """The ``link_check`` record of a multi-node job (runtime.faults.links), for metrics and manifests."""

    @property
    def rank0(self) -> bool:
        return self.info.rank == 0  # type: ignore[attr-defined]

    @property
    def device(self) -> str:
        return self.info.device  # type: ignore[attr-defined]

    @property
    def tensor_device(self) -> str:
        """Where small collective tensors live: nccl reduces CUDA tensors only."""
        return "cuda" if self.device == "cuda" else "cpu"

    def say(self, message: str) -> None:
        """A progress line, from rank 0 only."""
        if self.rank0:
            say(message)


def build_rank(cfg: JobConfig, layout: ParallelLayout) -> Rank:
    """Start this rank: process group, parallel state, model, optimizer, scheduler.

    ``layout``: the launcher's validated layout, carried with the job; the rank does not derive it again
    (no hostfile, environment or config rule is read here). Raises RuntimeError when the job's rank count
    differs from the layout's world size.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    from orchestrator.config.megatron_fields import required_env

    for name, value in required_env(cfg).items():  # before CUDA starts (cluster.env or the shell may set it)
        os.environ.setdefault(name, value)
    info = init_distributed(cfg)
    if info.device == "cpu":
        cpu_backend.activate()
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    if info.world_size != layout.world_size:
        raise RuntimeError(f"job has {info.world_size} ranks but the layout needs {layout.world_size}")
    if info.rank == 0:
        say(f"{info.world_size} ranks up ({info.backend} on {info.device}); building model {cfg.model.name}")
    initialize_parallel_state(cfg, cfg.training.seed, info.device)
    from orchestrator.config.tokenizer import model_vocab_size, tokenizer_facts
    from orchestrator.data.tokenizer import dataset_tokenizer

    tokenizer = dataset_tokenizer(cfg.data)  # the vocabulary: the plan's (tokenizer_facts), not re-derived
    vocab = model_vocab_size(cfg, tokenizer_facts(cfg.data).vocab_size)[0]
    built = build_model_and_optimizer(cfg, vocab, info.device, layout)
    model = built.model
    tf = built.tf_config
    tf.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
    tf.finalize_model_grads_func = finalize_model_grads
    tf.grad_scale_func = built.optimizer.scale_loss
    param_sync.set_sync_funcs(model, tf)  # grad_sync_func / param_sync_func with the overlaps, as Megatron-LM
    is_logger = (
        ps.is_pipeline_last_stage()
        and ps.get_data_parallel_rank() == 0
        and ps.get_tensor_model_parallel_rank() == 0
        and ps.get_context_parallel_rank() == 0
    )
    return Rank(cfg=cfg, layout=layout, info=info, tokenizer=tokenizer, built=built, is_logger=is_logger)


@dataclass
class Data:
    """This rank's data: the iterator megatron's schedule reads, and a factory for validation."""

    train: object
    """One MicroBatchIterator, or a list of them (one per model chunk, interleaved schedule)."""
    valid: Optional[Callable[[], object]]
    """A fresh iterator (or list) over the first ``eval_iters`` validation batches; None: no eval."""

    def close(self) -> None:
        """Stop the training iterators' DataLoader workers now, however training ended (see
        :meth:`~orchestrator.runtime.rank.batches.MicroBatchIterator.close`)."""
        for iterator in self.train if isinstance(self.train, list) else [self.train]:
            iterator.close()


def _iterators(rank: Rank, dataset, consumed: int, workers: int) -> object:
    """One iterator per model chunk over ``dataset`` from ``consumed`` samples, each read by ``workers`` processes."""
    from megatron.core import parallel_state as ps

    from orchestrator.runtime.rank.batches import MicroBatchIterator

    mbs = rank.cfg.training.micro_batch_size
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    its: List[object] = [
        MicroBatchIterator(dataset, consumed, mbs, dp_rank, dp_size, rank.device, workers) for _ in rank.built.model
    ]
    return its if len(its) > 1 else its[0]


def build_data(rank: Rank, prepared, consumed: int) -> Data:
    """Train iterators from ``consumed`` samples on; validation from its first sample, each time.

    Raises DataError for an empty split part.
    """
    from orchestrator.data.prepare import samples_needed
    from orchestrator.runtime.rank.batches import loader_workers
    from orchestrator.runtime.rank.dataset import build_datasets

    train, valid = build_datasets(rank.cfg, prepared, rank.tokenizer, samples_needed(rank.cfg))
    # validation reads its eval_iters batches afresh at every evaluation, in the rank's process (no workers to start
    # each time); training through data.num_workers
    make_valid = (lambda: _iterators(rank, valid, 0, 0)) if valid is not None else None
    workers = loader_workers(rank.cfg.data.num_workers, rank.device)
    return Data(train=_iterators(rank, train, consumed, workers), valid=make_valid)


def versions() -> dict:
    """Software versions recorded in every manifest."""
    from importlib.metadata import version

    import orchestrator

    return {
        "orchestrator": orchestrator.__version__,
        "megatron-core": version("megatron-core"),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
    }
