"""Build megatron-core objects from the typed config: parallel state, GPT chunks, DDP, optimizer, LR schedule.

Nothing here re-implements megatron-core: the three configs come from the one builder
(:mod:`orchestrator.runtime.rank.megatron_config`), then ``GPTModel``, ``DistributedDataParallel``,
``get_megatron_optimizer`` and ``OptimizerParamScheduler`` get them, explicitly (no ``**kwargs`` passed
through).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from orchestrator.config.layout import ParallelLayout, padded_vocab_size
from orchestrator.config.schedule import lr_schedule
from orchestrator.config.schema import JobConfig
from orchestrator.runtime.rank import megatron_config


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


def layer_spec(cfg: JobConfig, mc: "megatron_config.MegatronConfig"):
    """megatron's GPT layer spec for the builder's resolved ``transformer_impl``.

    Writes the resolved value back into ``cfg.model.transformer_impl``: from here on the job's
    config says what runs (``local`` / ``transformer_engine``, never ``auto``), so the in-job resume
    check and the manifest compare the layer spec actually used.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    cfg.model.transformer_impl = mc.transformer_impl
    num_experts = cfg.model.num_moe_experts
    if num_experts:
        from orchestrator.runtime.rank import mcore

        mcore.moe_router_without_te()
    if mc.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=cfg.model.moe_grouped_gemm
        )
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=cfg.model.moe_grouped_gemm, normalization=cfg.model.normalization
    )


@dataclass
class Built:
    """What :func:`build_model_and_optimizer` returns."""

    model: List[torch.nn.Module]  # one DDP-wrapped GPTModel chunk per virtual stage
    optimizer: object  # MegatronOptimizer
    scheduler: object  # OptimizerParamScheduler
    tf_config: object
    padded_vocab_size: int
    megatron: object = None  # megatron_config.MegatronConfig: what megatron_config.json records


def build_gpt_chunks(cfg: JobConfig, vocab_size: int, device: str, mc) -> tuple:
    """One ``GPTModel`` per (virtual) pipeline stage held by this rank, not yet wrapped."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    tf_config = mc.transformer
    spec = layer_spec(cfg, mc)
    padded = padded_vocab_size(
        vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallelism.tensor_model_parallel_size
    )
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
            rotary_base=cfg.model.rotary_base,
            rope_scaling=cfg.model.rope_scaling == "llama3",
            rope_scaling_factor=cfg.model.rope_scaling_factor,
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


def without_te(cfg: JobConfig, layout: ParallelLayout, vocab_size: int) -> str:
    """The line a GPU job that asked ``model.transformer_impl=auto`` and got megatron-core's local layer spec says,
    with its cost in activation memory from the planner (:func:`orchestrator.plan.activations.layer_activation_bytes`:
    the unfused attention keeps the a·s² softmax scores flash attention never stores) and what else it runs without."""
    from orchestrator.plan.activations import layer_activation_bytes
    from orchestrator.plan.inputs import ModelShape

    shape, elem = ModelShape.from_model_config(cfg.model, vocab_size), 4 if cfg.training.precision == "fp32" else 2
    unfused, flash = (layer_activation_bytes(shape, layout, elem, attention=kind) for kind in ("unfused", "flash"))
    return (
        "model.transformer_impl=auto found no Transformer Engine on this GPU node: megatron-core's local layer spec "
        f"runs unfused attention ({unfused / 2**20:,.1f} MiB of activations per layer and micro-batch instead of flash "
        f"attention's {flash / 2**20:,.1f} MiB, {unfused / flash:.1f}x) and no TE kernels (fused RoPE, FP8, fused "
        "layer-norm GEMMs); fix: install Transformer Engine on the GPU nodes (README: GPU install) or set "
        "model.transformer_impl=local to say this is intended"
    )


def build_model_and_optimizer(cfg: JobConfig, vocab_size: int, device: str, layout: ParallelLayout) -> Built:
    """GPT chunks → megatron DDP → megatron optimizer → LR/WD scheduler (``layout``: the launcher's, carried)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.optimizer import get_megatron_optimizer

    dp = layout.data_parallel_size
    mc = megatron_config.build(cfg, device, megatron_config.installed(cfg.model.transformer_impl), dp)
    if (
        device == "cuda"
        and cfg.model.transformer_impl == "auto"
        and mc.transformer_impl == "local"
        and torch.distributed.get_rank() == 0
    ):  # said once, by rank 0
        print(f"warning: {without_te(cfg, layout, vocab_size)}", flush=True)
    chunks, tf_config, padded = build_gpt_chunks(cfg, vocab_size, device, mc)
    ddp_config = mc.ddp
    model = [
        DistributedDataParallel(config=tf_config, ddp_config=ddp_config, module=chunk, disable_bucketing=(i > 0))
        for i, chunk in enumerate(chunks)
    ]
    optimizer = get_megatron_optimizer(mc.optimizer, model)
    scheduler = lr_scheduler(cfg, optimizer)
    return Built(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        tf_config=tf_config,
        padded_vocab_size=padded,
        megatron=mc,
    )


def lr_scheduler(cfg: JobConfig, optimizer):
    """megatron-core's ``OptimizerParamScheduler`` for ``optimizer`` (a MegatronOptimizer, or any object with torch
    ``param_groups``): the schedule of :func:`orchestrator.config.schedule.lr_schedule` (iterations, or samples with
    a batch ramp), constant weight decay ``optimizer.weight_decay``, and on resume the config's schedule
    (``override_opt_param_scheduler=True``). Megatron-LM's own is ``get_optimizer_param_scheduler``
    (megatron/training/training.py; compared field by field in tests/test_megatron_config.py)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    lr, o = lr_schedule(cfg), cfg.optimizer
    return OptimizerParamScheduler(
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


def unwrap(module: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP (and Float16Module) wrappers."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


def count_parameters(model: List[torch.nn.Module]) -> int:
    return sum(p.numel() for chunk in model for p in chunk.parameters())
