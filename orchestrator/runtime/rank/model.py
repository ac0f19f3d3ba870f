"""Build megatron-core objects from the typed config: parallel state, GPT chunks, DDP, optimizer, LR schedule.

Nothing here re-implements megatron-core: it maps :class:`~orchestrator.config.schema.JobConfig`
fields onto ``TransformerConfig``, ``GPTModel``, ``DistributedDataParallel``,
``get_megatron_optimizer`` and ``OptimizerParamScheduler`` by name, explicitly
(no ``**kwargs`` passed through).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from orchestrator.config.schema import JobConfig
from orchestrator.errors import BackendError, ConfigError
from orchestrator.config.layout import padded_vocab_size
from orchestrator.config.schedule import lr_schedule


def stage_seed(seed: int, pipeline_rank: int) -> int:
    """Megatron-LM's per-stage seed: ``seed + 100 x pipeline rank`` (``_set_random_seed`` in
    megatron/training/initialize.py), so pipeline stages do not draw identical initial weights;
    megatron-core's ``model_parallel_cuda_manual_seed`` then offsets by TP (and EP) rank itself."""
    return seed + 100 * pipeline_rank


def initialize_parallel_state(cfg: JobConfig, seed: int, device: str) -> None:
    """megatron ``initialize_model_parallel`` + RNG seeding as Megatron-LM does it: Python, NumPy and
    torch seeded with :func:`stage_seed`, then megatron-core's model-parallel RNG tracker."""
    import random

    import numpy as np
    from megatron.core import parallel_state, tensor_parallel

    p = cfg.parallelism
    vpp = p.virtual_pipeline_model_parallel_size if (p.virtual_pipeline_model_parallel_size or 1) > 1 else None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        distributed_timeout_minutes=cfg.training.distributed_timeout_minutes,  # every group, as Megatron-LM
    )
    seed = stage_seed(seed, parallel_state.get_pipeline_model_parallel_rank())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def _params_dtype(cfg: JobConfig) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.training.precision]


def transformer_config(cfg: JobConfig, device: str):
    """megatron ``TransformerConfig`` for the model and parallel settings in ``cfg``."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p, t = cfg.model, cfg.parallelism, cfg.training
    if device == "cpu" and t.precision != "fp32":
        raise ConfigError(f"training.precision={t.precision} needs a GPU; fix: training.precision=fp32 on CPU")
    if device == "cpu" and cfg.optimizer.use_distributed_optimizer:
        raise ConfigError(
            "optimizer.use_distributed_optimizer=true is rejected on CPU by megatron-core 0.16.1's tensor-type "
            "checks; fix: optimizer.use_distributed_optimizer=false (or run on GPU)"
        )
    vpp = p.virtual_pipeline_model_parallel_size if (p.virtual_pipeline_model_parallel_size or 1) > 1 else None
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        normalization=m.normalization,
        gated_linear_unit=m.activation == "swiglu",
        activation_func=torch.nn.functional.silu if m.activation == "swiglu" else torch.nn.functional.gelu,
        add_bias_linear=m.add_bias_linear,
        num_moe_experts=m.num_moe_experts,
        moe_router_topk=m.moe_router_topk,
        moe_token_dispatcher_type="alltoall",  # all-to-all over the EP group (gloo on CPU, nccl on GPU)
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=m.moe_aux_loss_coeff,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        params_dtype=_params_dtype(cfg),
        pipeline_dtype=_params_dtype(cfg),
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        use_cpu_initialization=device == "cpu",
        perform_initialization=True,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=device == "cuda",
    )


def resolve_transformer_impl(cfg: JobConfig, device: str) -> str:
    """``model.transformer_impl`` resolved for this job: ``transformer_engine`` or ``local``.

    ``auto`` means Transformer Engine on GPU when it imports, the local spec otherwise. Context
    parallelism needs Transformer Engine attention (megatron's local ``DotProductAttention`` has no
    CP). Raises :class:`BackendError` for TE asked for but missing, or CP > 1 without TE.
    """
    impl = cfg.model.transformer_impl
    te_ok = False
    if impl in ("auto", "transformer_engine") and device == "cuda":
        try:
            import transformer_engine  # noqa: F401

            te_ok = True
        except ImportError:
            te_ok = False
    if impl == "transformer_engine" and not te_ok:
        raise BackendError(
            "model.transformer_impl=transformer_engine but Transformer Engine is not importable here "
            f"(device={device}); fix: install transformer-engine on the GPU nodes or set model.transformer_impl=local"
        )
    cp = cfg.parallelism.context_parallel_size
    if cp > 1 and not te_ok:
        raise BackendError(
            f"parallelism.context_parallel_size={cp} needs Transformer Engine attention, but this job uses the "
            f"local layer spec (model.transformer_impl={impl}, device={device}); fix: install transformer-engine "
            "on the GPU nodes, or parallelism.context_parallel_size=1"
        )
    return "transformer_engine" if te_ok else "local"


def layer_spec(cfg: JobConfig, device: str):
    """megatron's GPT layer spec for :func:`resolve_transformer_impl`'s choice.

    Writes the resolved value back into ``cfg.model.transformer_impl``: from here on the job's
    config says what runs (``local`` / ``transformer_engine``, never ``auto``), so the in-job resume
    check and the manifest compare the layer spec actually used.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    cfg.model.transformer_impl = resolve_transformer_impl(cfg, device)
    num_experts = cfg.model.num_moe_experts
    if num_experts:
        from orchestrator.runtime.rank import mcore

        mcore.moe_router_without_te()
    if cfg.model.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts)
    return gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts, normalization=cfg.model.normalization)


@dataclass
class Built:
    """What :func:`build_model_and_optimizer` returns."""

    model: List[torch.nn.Module]  # one DDP-wrapped GPTModel chunk per virtual stage
    optimizer: object  # MegatronOptimizer
    scheduler: object  # OptimizerParamScheduler
    tf_config: object
    padded_vocab_size: int


def build_gpt_chunks(cfg: JobConfig, vocab_size: int, device: str) -> tuple:
    """One ``GPTModel`` per (virtual) pipeline stage held by this rank, not yet wrapped."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    tf_config = transformer_config(cfg, device)
    spec = layer_spec(cfg, device)
    padded = padded_vocab_size(vocab_size, cfg.model.make_vocab_size_divisible_by,
                               cfg.parallelism.tensor_model_parallel_size)
    vpp = tf_config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        chunk = GPTModel(
            config=tf_config,
            transformer_layer_spec=spec,
            vocab_size=padded,
            max_sequence_length=cfg.model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
            position_embedding_type=cfg.model.position_embedding_type,
            vp_stage=stage,
        )
        if device == "cuda":
            chunk.cuda(torch.cuda.current_device())
        if cfg.training.precision in ("bf16", "fp16"):
            # Megatron keeps half-precision weights in a Float16Module (casts inputs/outputs);
            # the optimizer then holds fp32 main params (Float16OptimizerWithFloat16Params).
            from megatron.core.transformer.module import Float16Module

            chunk = Float16Module(tf_config, chunk)
        chunks.append(chunk)
    return chunks, tf_config, padded


def build_model_and_optimizer(cfg: JobConfig, vocab_size: int, device: str) -> Built:
    """GPT chunks → megatron DDP → megatron optimizer → LR/WD scheduler."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    chunks, tf_config, padded = build_gpt_chunks(cfg, vocab_size, device)
    o = cfg.optimizer
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=o.use_distributed_optimizer,
        average_in_collective=False,
    )
    model = [
        DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]
    opt_config = OptimizerConfig(
        optimizer=o.name,
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        sgd_momentum=o.sgd_momentum,
        clip_grad=o.clip_grad,
        bf16=cfg.training.precision == "bf16",
        fp16=cfg.training.precision == "fp16",
        params_dtype=_params_dtype(cfg),
        use_distributed_optimizer=o.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    lr = lr_schedule(cfg)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=lr.init_lr,
        max_lr=lr.max_lr,
        min_lr=lr.min_lr,
        lr_warmup_steps=lr.lr_warmup_steps,
        lr_decay_steps=lr.lr_decay_steps,
        lr_decay_style=lr.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=lr.lr_decay_steps,
        wd_incr_style="constant",
        # On resume the config's schedule wins over the checkpoint's (orchestrator.config.schedule).
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    return Built(model=model, optimizer=optimizer, scheduler=scheduler, tf_config=tf_config,
                 padded_vocab_size=padded)


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP (and Float16Module) wrappers."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def count_parameters(model: List[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in model for p in chunk.parameters())
