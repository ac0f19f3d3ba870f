"""``model.megatron``, ``parallelism.megatron``, ``optimizer.megatron``: any field of the installed megatron-core's
``TransformerConfig``, ``DistributedDataParallelConfig`` or ``OptimizerConfig`` that the schema does not name
(CUDA graphs, ``tp_comm_overlap``, MoE permute fusion, whatever megatron-core adds next), set as
``model.megatron={tp_comm_overlap: true}`` or ``+model.megatron.tp_comm_overlap=true``.

The runtime applies them last, over what it derives (:mod:`orchestrator.runtime.rank.megatron_config`); the
launcher refuses, before anything is queued, a name the installed class does not have (one line with the closest
names) and a field the schema already owns (one line naming the key that sets it, from :data:`OWNED`). They are
recorded where every megatron field is (``megatron_config.json``, the manifest's config), compared on resume like
any field (a math field refused, a speed field carried: :mod:`orchestrator.config.megatron_fields`), and exported
by ``convert to-megatron`` as Megatron-LM's flag of the same name (``--tp-comm-overlap``). Pure Python.
"""

from __future__ import annotations

from typing import Any, Dict, List

from orchestrator.config.fp8 import FIELDS as FP8_FIELDS

SECTIONS = {"model": "transformer", "parallelism": "ddp", "optimizer": "optimizer"}
"""Config group -> the megatron config (:data:`orchestrator.config.megatron_fields.SECTIONS`) its ``megatron`` sets."""

_MODEL = (
    "num_layers hidden_size num_attention_heads num_query_groups ffn_hidden_size hidden_dropout attention_dropout "
    "init_method_std normalization add_bias_linear num_moe_experts moe_router_topk moe_aux_loss_coeff "
    "moe_grouped_gemm recompute_granularity recompute_method recompute_num_layers"
).split()
_PARALLEL = (
    "tensor_model_parallel_size pipeline_model_parallel_size virtual_pipeline_model_parallel_size "
    "context_parallel_size expert_model_parallel_size sequence_parallel"
).split()
_PRECISION = {name: "training.precision" for name in ("params_dtype", "pipeline_dtype", "bf16", "fp16")}

OWNED: Dict[str, Dict[str, str]] = {
    "transformer": {
        **{name: f"model.{name}" for name in _MODEL},
        **{name: f"parallelism.{name}" for name in _PARALLEL},
        **_PRECISION,
        "gated_linear_unit": "model.activation",
        "activation_func": "model.activation",
        "add_qkv_bias": "model.add_qkv_bias",
        "layernorm_epsilon": "model.norm_epsilon",
        "inference_sampling_seed": "training.seed",
        "transformer_impl": "model.transformer_impl",
        **FP8_FIELDS,
    },
    "ddp": {
        "overlap_grad_reduce": "parallelism.overlap_grad_reduce",
        "overlap_param_gather": "parallelism.overlap_param_gather",
        "use_distributed_optimizer": "optimizer.use_distributed_optimizer",
        "grad_reduce_in_fp32": "training.precision",
    },
    "optimizer": {
        **{name: f"optimizer.{name}" for name in "lr min_lr weight_decay adam_beta1 adam_beta2 adam_eps".split()},
        **{name: f"optimizer.{name}" for name in ("sgd_momentum", "clip_grad", "use_distributed_optimizer")},
        **_PRECISION,
        "optimizer": "optimizer.name",
        "fp8_recipe": "training.fp8_recipe",
        "overlap_param_gather": "parallelism.overlap_param_gather",
    },
}
"""The megatron fields a schema key sets (the key a refusal names), by megatron config."""


def passthrough(cfg) -> Dict[str, Dict[str, Any]]:
    """``{"transformer": {...}, "ddp": {...}, "optimizer": {...}}``: the fields ``cfg`` sets through the three
    ``megatron`` keys (empty dicts when none)."""
    return {section: dict(getattr(cfg, group).megatron or {}) for group, section in SECTIONS.items()}


def owned_problems(cfg) -> List[str]:
    """One line for each pass-through field that a schema key already sets (it would fight that key)."""
    problems = []
    for group, section in SECTIONS.items():
        for name, value in sorted((getattr(cfg, group).megatron or {}).items()):
            owner = OWNED[section].get(name)
            if owner is not None:
                problems.append(
                    f"{group}.megatron.{name}={value}: {owner} sets megatron-core's {name}; fix: set {owner} "
                    f"(and drop {group}.megatron.{name})"
                )
    return problems
