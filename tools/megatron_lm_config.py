"""Megatron-LM's own megatron config for a ``pretrain_gpt.py`` command line, as JSON (child of
``tools/megatron_golden.py``; run it under a Python that imports the Megatron-LM checkout).

    PYTHONPATH=<megatron-lm>:<orchestrator> python tools/megatron_lm_config.py --world-size 32 \
        --device-arch 80 --out FILE -- <pretrain_gpt.py flags>

Runs Megatron-LM's real ``parse_args`` -> ``validate_args`` -> ``core_transformer_config_from_args``,
``get_megatron_ddp_config`` and ``get_megatron_optimizer_config`` (megatron/training) on the flags and
prints ``{"transformer", "ddp", "optimizer"}`` (orchestrator.config.megatron_fields.fields_of). On a
machine without a GPU two facts are supplied instead of asked from CUDA: the GPU's compute capability
(``--device-arch``, 80 = A100; validate_args reads it for the TP/CP connection rule) and, on Python
3.11, ``typing.override`` (3.12; Megatron-LM's training package uses it as a decorator only).
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
    sys.argv = ["pretrain_gpt.py", *flags]
    args = arguments.parse_args()
    arguments.validate_args(args)
    transformer = core_transformer_config_from_args(args)
    ddp = get_megatron_ddp_config(args)
    optimizer, _overrides = get_megatron_optimizer_config(args)
    out = {"transformer": fields_of(transformer), "ddp": fields_of(ddp), "optimizer": fields_of(optimizer)}
    with open(ns.out, "w") as f:
        json.dump(out, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
