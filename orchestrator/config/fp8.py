"""FP8 training (``training.fp8``): megatron-core's fields for it, and what refuses it. Pure Python.

Megatron-LM's ``--fp8-format``, ``--fp8-recipe``, ``--fp8-amax-history-len`` and ``--fp8-amax-compute-algo``
are the argparse names of megatron-core ``TransformerConfig``'s own fields ``fp8``, ``fp8_recipe``,
``fp8_amax_history_len`` and ``fp8_amax_compute_algo`` (Megatron-LM d98e8a6 builds them from the dataclass;
``core_transformer_config_from_args`` copies them unchanged), with Megatron-LM's defaults: off, ``delayed``,
1, ``most_recent``. The golden ``tests/golden/megatron/llama_8b_tp2_fp8_hybrid_4x8.json`` holds what its
parser builds. FP8 GEMMs are Transformer Engine's (its ``fp8_autocast`` around megatron-core's TE layers), so a
CPU job and a job on megatron-core's local layer spec refuse it (:func:`problem`).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

FIELDS: Dict[str, str] = {
    "fp8": "training.fp8",
    "fp8_recipe": "training.fp8_recipe",
    "fp8_amax_history_len": "training.fp8_amax_history_len",
    "fp8_amax_compute_algo": "training.fp8_amax_compute_algo",
}
"""megatron-core TransformerConfig field -> the schema key that sets it."""

INSTALL = "pip install transformer-engine[pytorch] on the GPU nodes"


def transformer_fields(training) -> Dict[str, Any]:
    """The TransformerConfig arguments of ``training`` (a TrainingConfig): its four fp8 keys, as they are."""
    return {name: getattr(training, key.split(".", 1)[1]) for name, key in FIELDS.items()}


def optimizer_fields(training) -> Dict[str, Any]:
    """The OptimizerConfig arguments: ``fp8_recipe`` as Megatron-LM passes it (its distributed optimizer reads it
    for FP8 parameters); none without FP8 (megatron-core's default stays)."""
    return {"fp8_recipe": training.fp8_recipe} if training.fp8 else {}


def problem(cfg, device: str, layer_spec: str) -> Optional[str]:
    """One ``error:`` line's text when ``cfg`` asks for FP8 on ``device`` (``cpu`` / ``cuda``) with the layer spec
    ``layer_spec`` (``transformer_engine`` / ``local`` / ``auto``: resolved or as configured), else None."""
    fp8 = cfg.training.fp8
    if not fp8:
        return None
    if device == "cpu":
        return (
            f"training.fp8={fp8}: FP8 GEMMs are Transformer Engine's and run on GPUs only (this job runs on CPU); "
            "fix: training.fp8=null"
        )
    if layer_spec == "local":
        impl = cfg.model.transformer_impl
        why = "asked for" if impl == "local" else "Transformer Engine is not installed where the ranks run"
        return (
            f"training.fp8={fp8}: needs Transformer Engine's layers, but this job uses megatron-core's local layer "
            f"spec (model.transformer_impl={impl}: {why}); fix: {INSTALL} and model.transformer_impl=auto, or "
            "training.fp8=null"
        )
    return None
