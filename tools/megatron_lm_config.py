"""Megatron-LM's own megatron config for a ``pretrain_gpt.py`` command line, as JSON (child of
``tools/megatron_golden.py``; run it under a Python that imports the Megatron-LM checkout).

    PYTHONPATH=<megatron-lm>:<orchestrator> python tools/megatron_lm_config.py --world-size 32 \
        --device-arch 80 --out FILE -- <pretrain_gpt.py flags>

Runs Megatron-LM's real ``parse_args`` -> ``validate_args`` -> ``core_transformer_config_from_args``,
``get_megatron_ddp_config`` and ``get_megatron_optimizer_config`` (megatron/training) on the flags and
writes ``{"transformer", "ddp", "optimizer"}`` (orchestrator.config.megatron_fields.fields_of), the
``gpt_model`` vocabulary its tokenizer builds (padded, as pretrain_gpt.py) and the megatron-core version, and
where Megatron-LM carries the batch and its ramp (no config dataclass has ``--rampup-batch-size``):

* ``batch``: the parsed args that define the batch after ``validate_args`` (:data:`BATCH_ARGS`);
* ``scheduler``: every field of the ``OptimizerParamScheduler`` Megatron-LM's own ``get_optimizer_param_scheduler``
  (megatron/training/training.py) builds from them, for a one-parameter torch optimizer (no GPU), and its learning
  rate and weight decay at a few step counts (``lr_at``: ``[steps, lr, wd]``; steps are samples in Megatron-LM);
* ``microbatches``: megatron-core's num-microbatches calculator as Megatron-LM's ``set_global_variables``
  (megatron/training/global_vars.py) initializes it from the args: ``[consumed samples, global batch,
  num_microbatches]`` at each of ``--probe-samples``, and the ``train_iters`` that ``get_optimizer_param_scheduler``
  (``update_train_iters``) sets for ``--train-samples``.

On a
machine without a GPU two facts are supplied instead of asked from CUDA: the GPU's compute capability
(``--device-arch``, 80 = A100; validate_args reads it for the TP/CP connection rule) and, on Python
3.11, ``typing.override`` (3.12; Megatron-LM's training package uses it as a decorator only). With
Transformer Engine on the GPU nodes (the default; ``--no-transformer-engine``), TE's fused RoPE function,
whose presence ``TransformerConfig`` checks for ``apply_rope_fusion``, is stood in for (never called).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import typing
import warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--device-arch", type=int, default=80, help="compute capability x 10 (A100: 80)")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE set before parsing")
    parser.add_argument(
        "--no-transformer-engine",
        dest="transformer_engine",
        action="store_false",
        help="the GPU nodes lack Transformer Engine (default: they have it)",
    )
    parser.add_argument("--out", required=True, help="the JSON file to write (Megatron-LM prints to stdout)")
    parser.add_argument(
        "--probe-samples", default="0", help="consumed-sample counts to ask the calculator at (comma-separated)"
    )
    parser.add_argument("flags", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    flags = ns.flags[1:] if ns.flags[:1] == ["--"] else ns.flags
    os.environ.update({"WORLD_SIZE": str(ns.world_size), "RANK": "0"})
    os.environ.update(dict(item.split("=", 1) for item in ns.env))
    if not hasattr(typing, "override"):  # Python 3.11: a no-op decorator, as typing_extensions.override
        typing.override = lambda f: f  # type: ignore[attr-defined]
    warnings.simplefilter("ignore")
    from megatron.training import arguments
    from megatron.training.argument_utils import core_transformer_config_from_args
    from megatron.training.training import get_megatron_ddp_config, get_megatron_optimizer_config

    from orchestrator.config.megatron_fields import fields_of

    arguments.get_device_arch_version = lambda: ns.device_arch // 10  # the GPU's major version, not asked of CUDA
    if ns.transformer_engine:  # TE's fused RoPE, which TransformerConfig checks for: present on the GPU nodes
        from megatron.core.models.common.embeddings import rope_utils

        if rope_utils.fused_apply_rotary_pos_emb is None:
            rope_utils.fused_apply_rotary_pos_emb = lambda *a, **k: None  # never called: configs only
    sys.argv = ["pretrain_gpt.py", *flags]
    args = arguments.parse_args()
    arguments.validate_args(args)
    transformer = core_transformer_config_from_args(args)
    ddp = get_megatron_ddp_config(args)
    optimizer, _overrides = get_megatron_optimizer_config(args)
    from megatron.core import __version__ as mcore_version
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    tokenizer = build_tokenizer(args)  # sets args.padded_vocab_size, as pretrain_gpt.py's start-up does
    out = {
        "transformer": fields_of(transformer),
        "ddp": fields_of(ddp),
        "optimizer": fields_of(optimizer),
        "gpt_model": {
            "vocab_size": args.padded_vocab_size,
            "tokenizer_vocab_size": tokenizer.vocab_size,
            "eod": tokenizer.eod,
        },
        "megatron_core": mcore_version,
        **batch_and_schedule(args, [int(c) for c in ns.probe_samples.split(",")]),
    }
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    return 0


BATCH_ARGS = (
    "micro_batch_size",
    "global_batch_size",
    "rampup_batch_size",
    "step_batch_size_schedule",
    "decrease_batch_size_if_needed",
    "data_parallel_size",
    "gtp_weight_remat_size",
    "seq_length",
    "train_iters",
    "train_samples",
    "lr_warmup_iters",
    "lr_warmup_samples",
    "lr_warmup_fraction",
    "lr_decay_iters",
    "lr_decay_samples",
    "eval_global_batch_size",
)
"""The args that define the batch, its ramp and the schedule's lengths (those this Megatron-LM line has)."""


def batch_and_schedule(args, probes) -> dict:
    """``batch``, ``scheduler`` and ``microbatches`` (module docstring) for validated ``args``; Megatron-LM's own
    ``set_global_variables`` (its logging writers off: this process is not a training rank) and
    ``get_optimizer_param_scheduler``, which reads the global args and sets ``train_iters`` for ``--train-samples``."""
    import copy

    import torch
    from megatron.core import num_microbatches_calculator as nmc
    from megatron.training import global_vars
    from megatron.training.training import get_optimizer_param_scheduler

    batch = {name: getattr(args, name) for name in BATCH_ARGS if hasattr(args, name)}
    quiet = copy.copy(args)
    quiet.tensorboard_dir, quiet.wandb_project, quiet.enable_one_logger = None, "", False
    global_vars.set_global_variables(quiet, build_tokenizer=False)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = get_optimizer_param_scheduler(optimizer)
    fields = {k: v for k, v in vars(scheduler).items() if k != "optimizer"}
    g = quiet.global_batch_size
    w, d = scheduler.lr_warmup_steps, scheduler.lr_decay_steps
    steps = sorted({s // g * g for s in (0, w // 2, w, (w + d) // 2, d)} | {d + g})
    lr_at = []
    for s in steps:
        scheduler.num_steps = s
        group = optimizer.param_groups[0]
        lr_at.append([s, scheduler.get_lr(group), scheduler.get_wd(group)])
    scheduler.num_steps = 0
    at = []
    for consumed in probes:
        nmc.update_num_microbatches(consumed, consistency_check=False)
        at.append([consumed, nmc.get_current_global_batch_size(), nmc.get_num_microbatches()])
    return {
        "batch": batch,
        "scheduler": {**fields, "lr_at": lr_at},
        "microbatches": {"at": at, "train_iters": quiet.train_iters},
    }


if __name__ == "__main__":
    sys.exit(main())
