"""What a run's checkpoints will take on disk, before it runs: one checkpoint's bytes and how many are held.

A torch_dist checkpoint holds every distinct parameter once (dist_checkpointing writes each shard
once, whatever the TP/PP/DP layout; DP replicas and the tied output layer's copy are not written
twice): the weights in their precision, the optimizer's fp32 states (Adam: two moments; SGD: its
momentum) and, in mixed precision, its fp32 master weights; gradients are not saved. gpt_tiny with
Adam in fp32: 858,880 parameters x 12 B = 10.3 MB predicted, 10.6 MB written (dist_checkpointing's
metadata and common.pt add ~3%). Pure Python.
"""

from __future__ import annotations

from typing import List, Optional

from orchestrator.config.layout import ParallelLayout, layout_from_config, padded_vocab_size
from orchestrator.plan.inputs import ModelShape, recipe_of, vocab_size_of
from orchestrator.plan.params import total_params


def checkpoint_params(cfg, layout: Optional[ParallelLayout] = None) -> int:
    """Distinct parameters a checkpoint of ``cfg`` holds (``layout``: carried by the caller, else derived)."""
    layout = layout if layout is not None else layout_from_config(cfg)
    vocab, _ = vocab_size_of(cfg)
    shape = ModelShape.from_model_config(cfg.model, vocab)
    vp = padded_vocab_size(shape.vocab_size, shape.make_vocab_size_divisible_by, layout.tensor_model_parallel_size)
    return total_params(shape, layout, vp)


def checkpoint_bytes(cfg, layout: Optional[ParallelLayout] = None) -> int:
    """Predicted bytes of one checkpoint of ``cfg`` (module docstring; ``layout`` as in :func:`checkpoint_params`)."""
    return checkpoint_params(cfg, layout) * recipe_of(cfg).checkpoint_bytes


def save_iterations(cfg) -> List[int]:
    """The iterations a run of ``cfg`` saves at, from iteration 0 to ``training.train_iters``; with
    ``save_interval=auto`` the most it may (every ``auto_min_interval``: the interval is chosen at run time)."""
    t, c = cfg.training, cfg.checkpoint
    every = c.auto_min_interval if c.save_interval == "auto" else c.save_interval
    out = list(range(every, t.train_iters, every)) if every else []
    if c.save_at_end and (not out or out[-1] != t.train_iters):
        out.append(t.train_iters)
    return out


def held_at_peak(cfg) -> int:
    """The most checkpoints on disk at once: while a save is written the ``keep_last`` older ones are
    still there (they are removed only after its manifest), plus every ``keep_every`` milestone."""
    keep_last, keep_every = cfg.checkpoint.keep_last, cfg.checkpoint.keep_every
    held: List[int] = []
    peak = 0
    for it in save_iterations(cfg):
        held.append(it)
        peak = max(peak, len(held))
        if keep_last is not None:
            newest = set(held[-keep_last:])
            held = [h for h in held if h in newest or (keep_every and h % keep_every == 0)]
    return peak
