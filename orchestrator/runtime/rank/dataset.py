"""megatron-core GPT datasets over prepared data, and the micro-batches a rank reads.

* :func:`build_datasets` — megatron-core's ``GPTDataset`` (a ``BlendedDataset`` over several
  prefixes) through ``BlendedMegatronDatasetBuilder``. :func:`cache_indices` builds and caches every
  sample index once before the ranks start (no rank waits at a barrier while rank 0 builds).
  Megatron's blended index build asks ``torch.distributed.get_rank()`` on a cold cache; outside a
  job that one build runs inside a process group of one (gloo over an in-process ``HashStore``: no
  port, no network), destroyed right after — a real world of size 1, in which megatron's own rank-0
  path builds and caches, rather than a copy of megatron's private cache-file naming.

What a rank reads of them, micro-batch by micro-batch, is :mod:`orchestrator.runtime.rank.batches`.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Iterator

from orchestrator.config.schema import JobConfig
from orchestrator.data.prepare import PreparedData, indices_marker, samples_needed, valid_samples_needed
from orchestrator.data.tokenizer import dataset_tokenizer
from orchestrator.errors import DataError


def _dataset_config(cfg: JobConfig, prepared: PreparedData, tokenizer):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    blend = None
    if prepared.prefixes:
        blend = (list(prepared.prefixes), list(prepared.weights) if prepared.weights else None)
    return GPTDatasetConfig(
        random_seed=cfg.training.seed,
        sequence_length=cfg.model.seq_length,
        blend=blend,
        split=cfg.data.split,
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
        path_to_cache=os.path.join(prepared.cache_dir, "indices"),
        mmap_bin_files=True,
    )


@contextlib.contextmanager
def _process_group_of_one(needed: bool) -> Iterator[None]:
    """A gloo process group of world size 1 (in-process HashStore: no port, no network) for the
    ``with`` block, when ``needed`` and none exists; destroyed afterwards. See the module docstring."""
    import torch.distributed as dist

    if not needed or dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _check_splits(cfg: JobConfig, config, prepared: PreparedData) -> None:
    """Refuse a data.split part with a weight that gets none of a prefix's documents: megatron's
    builder would loop forever on it (GPTDataset asks for epochs of an empty range)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in prepared.prefixes:
        n = len(IndexedDataset(prefix, mmap=True))
        for name, bounds in zip(("train", "validation", "test"), config.split_matrix):
            if bounds is not None and int(round(bounds[1] * n)) - int(round(bounds[0] * n)) == 0:
                raise DataError(
                    f"data.split={cfg.data.split!r}: the {name} part of {Path(prefix).name} gets none "
                    f"of its {n} documents; fix: \"data.split='100,0,0'\" training.eval_iters=0 (quoted: a bare comma list is a sweep) "
                    "(no held-out data), or more documents"
                )


def build_datasets(cfg: JobConfig, prepared: PreparedData, tokenizer, num_samples: int):
    """(train, validation) megatron-core GPTDatasets (MockGPTDataset; a BlendedDataset over several
    prefixes): train with at least ``num_samples`` samples of seq_length+1 tokens, validation with
    :func:`valid_samples_needed` samples of ``data.split``'s held-out part (None when that is 0).

    Called by the launcher without torch.distributed, once, to build and cache every index under
    ``<cache_dir>/indices``, and inside the job, where every rank then loads those files.
    Raises DataError for an empty split part, or a blend that oversamples a source.
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    config = _dataset_config(cfg, prepared, tokenizer)
    _check_splits(cfg, config, prepared)
    cls = MockGPTDataset if cfg.data.kind == "mock" else GPTDataset
    sizes = [num_samples, valid_samples_needed(cfg), 0]
    try:
        with _process_group_of_one(needed=len(prepared.prefixes) > 1):
            train, valid, _ = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, config).build()
    except IndexError as exc:  # megatron: "The train blend oversamples the contributing datasets ..."
        raise DataError(f"data.weights: {str(exc).split('. ')[0]}; fix: change data.weights or add data") from None
    if train is None:
        raise DataError(
            f"data.split: the train split is empty (data.split={cfg.data.split!r}); fix: give the train split weight"
        )
    return train, (valid if sizes[1] else None)


def build_train_dataset(cfg: JobConfig, prepared: PreparedData, tokenizer, num_samples: int):
    """The train dataset of :func:`build_datasets` (which also builds and caches the validation one)."""
    return build_datasets(cfg, prepared, tokenizer, num_samples)[0]


def cache_indices(cfg: JobConfig, prepared: PreparedData) -> None:
    """Build and cache the train and validation sample indices once, in the launcher, before any rank
    starts (the ranks then only load them). Nothing at all — not even the torch/megatron import, which
    takes seconds — when a marker says an earlier launch built exactly these. Raises DataError."""
    from orchestrator.io import write_atomic

    marker = indices_marker(cfg, prepared)
    if marker.exists():
        return
    build_datasets(cfg, prepared, dataset_tokenizer(cfg.data), samples_needed(cfg))
    write_atomic(marker, json.dumps({"built": True}) + "\n")
