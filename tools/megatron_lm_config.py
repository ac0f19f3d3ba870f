"""Megatron-LM's own megatron config for a ``pretrain_gpt.py`` command line, as JSON (child of
``tools/megatron_golden.py``; run it under a Python that imports the Megatron-LM checkout).

    PYTHONPATH=<megatron-lm>:<orchestrator> python tools/megatron_lm_config.py --world-size 32 \
        --device-arch 80 --out FILE -- <pretrain_gpt.py flags>

Runs Megatron-LM's real ``parse_args`` -> ``validate_args`` -> ``core_transformer_config_from_args``,
``get_megatron_ddp_config`` and ``get_megatron_optimizer_config`` (megatron/training) on the flags and
writes ``{"transformer", "ddp", "optimizer"}`` (orchestrator.config.megatron_fields.fields_of), the
``gpt_model`` vocabulary its tokenizer builds (padded, as pretrain_gpt.py) and the megatron-core version. On a
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
    }
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
