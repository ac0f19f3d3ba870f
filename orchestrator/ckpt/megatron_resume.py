"""A resume judged by the megatron config: speed may change, the arithmetic may not.

The manifest of every checkpoint records the megatron config the job built
(``megatron_config``; :mod:`orchestrator.config.megatron_fields`). A resume whose config differs from
it only in performance fields (fusions, overlaps, bucketing) continues with one line naming them (FP8
switched on or off, or its recipe: a line of its own, the numbers change); a
difference in any other field (``apply_residual_connection_post_layernorm``, the activation, softmax
precision ...) changes the function the checkpoint's weights were trained to compute and is refused
with the diff table, as a layout change is. Pure Python.
"""

from __future__ import annotations

from typing import Callable, Optional

from orchestrator.ckpt.mismatch import REFUSE, WARN, Mismatch, format_mismatch_table
from orchestrator.config.megatron_fields import FP8_FIELDS, split_diff
from orchestrator.errors import ResumeMismatchError


def check_megatron_config(manifest: dict, requested: dict, where: str, warn: Callable[[str], None]) -> Optional[list]:
    """Compare the checkpoint's recorded megatron config with the requested one.

    Returns the carried differences (speed fields and optimizer settings, said through ``warn``), None when the checkpoint
    records none (older manifests) or nothing differs. Raises :class:`ResumeMismatchError` with the table
    when a math field differs.
    """
    recorded = manifest.get("megatron_config")
    if not recorded:
        return None
    perf, math = split_diff(recorded, requested)
    if math:
        rows = [Mismatch(f"megatron.{k}", a, b, None, REFUSE, "") for k, a, b in math]
        rows += [Mismatch(f"megatron.{k}", a, b, None, WARN, "") for k, a, b in perf]
        raise ResumeMismatchError(
            f"cannot resume from {where}: the requested megatron config computes differently from the "
            f"checkpoint's ({', '.join(k for k, _, _ in math)}); fix: restore the settings that produced them, "
            f"or start a new run.name\n{format_mismatch_table(rows)}"
        )
    fp8 = [r for r in perf if r[0].split(".", 1)[1] in FP8_FIELDS[r[0].split(".", 1)[0]]]
    speed = [r for r in perf if r not in fp8]
    if speed:
        warn(
            f"resuming from {where} with megatron config changes that leave the model's function as it was "
            "(speed, or optimizer settings): " + ", ".join(f"{k} {a} -> {b}" for k, a, b in speed)
        )
    if fp8:
        warn(
            f"resuming from {where} with FP8 changed (training.fp8: the checkpoint's weights, their GEMMs now "
            "rounded differently, so the losses move off the uninterrupted run's): "
            + ", ".join(f"{k} {a} -> {b}" for k, a, b in fp8)
        )
    return perf or None
