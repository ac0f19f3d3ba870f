"""The token batch a run's evaluation reads, written to a file with the loss the run measured on it, so an export can
be checked outside the run (``convert to-hf RUN OUT --eval-batch FILE``; issue 38: the trained export's loss in
transformers equals our last evaluation's).

The evaluation (:func:`orchestrator.runtime.training.forward.evaluate`) reads the first ``training.eval_iters``
global batches of the validation split, from its first sample every time: samples ``[0, eval_iters * GBS)`` of
megatron-core's validation ``GPTDataset``, built here by the ranks' own :func:`build_datasets` from the run's config
and data (the same cached sample indices). Micro-batch ``j`` of DP rank ``r`` in global batch ``k`` is samples
``k*GBS + j*MBS*DP + r*MBS + [0, MBS)`` (:class:`~orchestrator.runtime.rank.batches.MicroBatchIterator`), so the file's rows in order are the
micro-batches, ``MBS`` rows each.

Its loss (nats/token): megatron-core's cross entropy of ``logits[b, s]`` against ``labels[b, s]`` (the next token:
GPTDataset's ``text[1:]``), masked by ``loss_mask`` and averaged per micro-batch, then over micro-batches
(:func:`orchestrator.runtime.rank.cp.loss_func`, :func:`orchestrator.runtime.training.forward.mean_loss`). Our
``loss_mask`` is all ones (``eod_mask_loss`` off, no padding id), so that is the mean over every token of the file,
which is what ``torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())`` computes on
transformers' logits for ``tokens``. Causal attention over the whole sample and positions ``0..S-1``
(``reset_attention_mask`` / ``reset_position_ids`` off), as transformers' default.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from orchestrator.config.schema import JobConfig
from orchestrator.data.prepare import PreparedData, samples_needed
from orchestrator.data.tokenizer import dataset_tokenizer
from orchestrator.errors import DataError
from orchestrator.runtime.rank.dataset import build_datasets

KEYS = ("tokens", "labels", "loss_mask")


def samples(cfg: JobConfig, prepared: PreparedData, eval_iters: int) -> Dict[str, torch.Tensor]:
    """``tokens`` and ``labels`` (int64) and ``loss_mask`` (float32), each ``[eval_iters * GBS, seq_length]``: the
    validation samples one evaluation of ``cfg``'s run reads, in its order. DataError when the run has none."""
    _, valid = build_datasets(cfg, prepared, dataset_tokenizer(cfg.data), samples_needed(cfg))
    if valid is None:
        raise DataError(
            f"--eval-batch: the run has no validation samples (data.split={cfg.data.split!r}, training.eval_iters="
            f"{cfg.training.eval_iters}, training.train_iters={cfg.training.train_iters}); fix: a run that evaluated"
        )
    n = eval_iters * cfg.training.global_batch_size
    items = [valid[i % len(valid)] for i in range(n)]  # the iterator's wrap-around, never reached: len >= n
    return {
        k: torch.stack([it[k] for it in items]).to(torch.float32 if k == "loss_mask" else torch.int64) for k in KEYS
    }


def write(path: str, batch: Dict[str, torch.Tensor], cfg: JobConfig, iteration: int, loss: Optional[float]) -> None:
    """``batch`` as a safetensors file; its metadata (strings): ``iteration``, ``lm_loss`` (ours at that iteration,
    ``repr`` of the float; absent when the run logged no evaluation there), ``micro_batch_size``, ``eval_iters``."""
    from safetensors.torch import save_file

    meta = {
        "iteration": str(iteration),
        "micro_batch_size": str(cfg.training.micro_batch_size),
        "eval_iters": str(batch["tokens"].shape[0] // cfg.training.global_batch_size),
    }
    if loss is not None:
        meta["lm_loss"] = repr(float(loss))
    save_file({k: v.contiguous() for k, v in batch.items()}, path, metadata=meta)
