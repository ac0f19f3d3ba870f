"""The bare loop's megatron config, from Megatron-LM's own (the golden file), not from ours.

``tests/golden/megatron/gpt_125m_1gpu_bf16.json`` holds what Megatron-LM d98e8a6's parser builds for the
flags ``convert to-megatron`` prints for gpt_125m on one GPU in bf16 (``tools/megatron_golden.py``).
:func:`bare_configs` turns it back into the installed megatron-core's ``TransformerConfig``,
``DistributedDataParallelConfig`` and ``OptimizerConfig``: every field the installed line has, where the
golden value is not already its default; derived fields (``init_method``: a partial of ``init_method_std``)
and the fields no job turns on (``UNUSED_FIELDS``) keep the installed defaults. What the machine cannot run
is turned off and said (Megatron-LM itself would refuse it): ``gradient_accumulation_fusion`` without apex's
``fused_weight_gradient_mlp_cuda``, ``apply_rope_fusion`` without Transformer Engine; on CPU (the code check
here) every CUDA-only field and bf16.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
from pathlib import Path
from typing import Dict, List, Tuple

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO / "tests" / "golden" / "megatron" / "gpt_125m_1gpu_bf16.json"
_SKIP = object()
CPU_OFF = (
    "gradient_accumulation_fusion",
    "masked_softmax_fusion",
    "bias_dropout_fusion",
    "persist_layer_norm",
    "apply_rope_fusion",
    "deallocate_pipeline_outputs",
    "bf16",
)
ACTIVE = {
    "transformer": (
        "bias_activation_fusion",
        "gradient_accumulation_fusion",
        "masked_softmax_fusion",
        "bias_dropout_fusion",
        "persist_layer_norm",
        "apply_rope_fusion",
        "overlap_p2p_comm",
    ),
    "ddp": ("overlap_grad_reduce", "overlap_param_gather", "grad_reduce_in_fp32", "check_for_nan_in_grad"),
}


def load_golden(path: Path = GOLDEN) -> dict:
    return json.loads(path.read_text())


def _native(value):
    """A golden JSON value back as Python: dtypes and functions by name; partials are derived (skipped)."""
    import torch

    if not isinstance(value, str):
        return value
    if "(" in value:  # functools.partial(...): derived by TransformerConfig from init_method_std
        return _SKIP
    if value.startswith("torch.") and isinstance(getattr(torch, value[6:], None), torch.dtype):
        return getattr(torch, value[6:])
    parts = value.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # "torch._C._nn.gelu": module torch._C._nn, attribute gelu
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr, _SKIP)
        if obj is not _SKIP and callable(obj):
            return obj
        break
    return value


def _from_fields(cls, section: str, values: Dict[str, object], off: Dict[str, object]) -> Tuple[object, List[str]]:
    from orchestrator.config.megatron_fields import UNUSED_FIELDS, jsonable

    kwargs, dropped = {}, []
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name, value in values.items():
        f = fields.get(name)
        if f is None:
            dropped.append(name)  # not in this megatron-core line
            continue
        if not f.init or name in UNUSED_FIELDS[section]:
            continue
        if f.default is not dataclasses.MISSING and jsonable(f.default) == value:
            continue
        native = _native(value)
        if native is not _SKIP:
            kwargs[name] = native
    kwargs.update({k: v for k, v in off.items() if k in fields})
    return cls(**kwargs), dropped


def bare_configs(golden: dict, device: str) -> dict:
    """``{"transformer", "ddp", "optimizer", "dropped", "turned_off", "active"}`` for ``device``."""
    import torch
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    t = golden["transformer"]
    off: Dict[str, object] = {}
    if device == "cpu":
        off.update({k: False for k in CPU_OFF if t.get(k)})
        off.update(params_dtype=torch.float32, pipeline_dtype=torch.float32, use_cpu_initialization=True)
    if t.get("gradient_accumulation_fusion") and importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        off["gradient_accumulation_fusion"] = False
    if t.get("apply_rope_fusion") and importlib.util.find_spec("transformer_engine") is None:
        off["apply_rope_fusion"] = False
    tf, d1 = _from_fields(TransformerConfig, "transformer", t, off)
    opt_off = {"bf16": False, "params_dtype": torch.float32} if device == "cpu" else {}
    ddp, d2 = _from_fields(DistributedDataParallelConfig, "ddp", golden["ddp"], {})
    opt, d3 = _from_fields(OptimizerConfig, "optimizer", golden["optimizer"], opt_off)
    active = {
        s: [k for k in names if getattr({"transformer": tf, "ddp": ddp}[s], k, False)] for s, names in ACTIVE.items()
    }
    return {
        "transformer": tf,
        "ddp": ddp,
        "optimizer": opt,
        "dropped": d1 + d2 + d3,
        "turned_off": sorted(k for k in off if k in CPU_OFF or k.endswith("fusion")),
        "active": active,
    }


def active_of(config_json: dict) -> Dict[str, List[str]]:
    """The fusions and overlaps on in a megatron_config.json (the orchestrator's side of the table)."""
    return {s: [k for k in names if (config_json.get(s) or {}).get(k)] for s, names in ACTIVE.items()}
