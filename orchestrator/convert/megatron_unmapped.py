"""Megatron-LM flags with no equivalent here, each with the reason the conversion lists it under "not converted"
(never dropped silently). Rows of :data:`orchestrator.convert.megatron_args.TABLE`. Pure data."""

from __future__ import annotations

from typing import List

from orchestrator.convert.flag_row import Flag

UNMAPPED: List[Flag] = [
    Flag(
        "--step-batch-size-schedule",
        kind="none",
        note="no arbitrary batch-size schedule here (Megatron-LM's successor of --rampup-batch-size); a linear "
        "ramp is training.rampup_batch_size (--rampup-batch-size), else give the final batch as --global-batch-size",
    ),
    Flag(
        "--tensorboard-*",
        kind="none",
        note="TensorBoard settings are fixed (logging.tensorboard: <run dir>/tensorboard)",
    ),
    Flag("--wandb-*", kind="none", note="Weights & Biases takes logging.wandb.project/entity/name/mode only"),
    Flag("--log-*", kind="none", note="logging is fixed: training.log_interval and <run dir>/metrics.jsonl"),
    Flag("--attention-backend", kind="none", note="the attention kernel follows model.transformer_impl"),
    Flag("--use-flash-attn", kind="none", note="the attention kernel follows model.transformer_impl"),
    Flag(
        "--no-*-fusion",
        kind="none",
        note='kernel fusions are Megatron-LM\'s defaults on GPU (README "Megatron config"), not configurable here',
    ),
    Flag(
        "--exit-interval",
        kind="none",
        note="no equivalent (training.exit_after_iters counts iterations of one job, not a multiple)",
    ),
    Flag(
        "--exit-duration-in-mins",
        kind="none",
        note="the SLURM time limit (cluster.timeout_min) ends a job; it saves and requeues",
    ),
    Flag("--train-data-path", kind="none", note="per-split datasets are not supported; use --data-path with --split"),
    Flag("--valid-data-path", kind="none", note="the validation set is data.split's part of --data-path"),
    Flag("--test-data-path", kind="none", note="no test evaluation here"),
    Flag("--kv-channels", kind="none", note="kv_channels is hidden_size / num_attention_heads here"),
    Flag(
        "--accumulate-allreduce-grads-in-fp32",
        kind="none",
        note="megatron-core's default with bf16 here; the planner assumes fp32 gradient accumulation",
    ),
    Flag("--ckpt-format", kind="none", note="checkpoints are always megatron-core dist_checkpointing torch_dist"),
    Flag("--use-dist-ckpt", kind="none", note="checkpoints are always megatron-core dist_checkpointing torch_dist"),
    Flag("--use-mcore-models", kind="none", note="the model is always megatron-core's GPTModel"),
    Flag(
        "--no-load-optim", kind="none", note="resume loads model and optimizer; checkpoint.init_from loads weights only"
    ),
    Flag("--no-load-rng", kind="none", note="resume restores the full state"),
    Flag(
        "--finetune", kind="none", note="say checkpoint.init_from=<orchestrator checkpoint> (weights only, iteration 0)"
    ),
    # flags of Megatron-LM's examples/llama and examples/mixtral launch scripts
    Flag(
        "--fp8-*",
        kind="none",
        note="training.fp8 takes --fp8-format, --fp8-recipe and the amax history/algorithm; other FP8 settings: "
        "+model.megatron.<field> sets megatron-core's field (e.g. fp8_margin)",
    ),
    Flag(
        "--first-last-layers-bf16",
        kind="none",
        note="+model.megatron.first_last_layers_bf16=true sets megatron-core's field (with training.fp8)",
    ),
    Flag("--rotary-percent", kind="none", note="RoPE rotates whole heads here (Megatron-LM's 1.0)"),
    Flag(
        "--apply-layernorm-1p",
        kind="none",
        note="zero-centred norm weights: +model.megatron.layernorm_zero_centered_gamma=true sets megatron-core's field",
    ),
    Flag("--decoupled-lr", kind="none", note="one learning rate for every parameter here (optimizer.lr)"),
    Flag("--decoupled-min-lr", kind="none", note="one learning rate for every parameter here (optimizer.min_lr)"),
    Flag(
        "--grad-reduce-in-bf16", kind="none", note="gradients are reduced in fp32 here (megatron-core's bf16 default)"
    ),
    Flag(
        "--cross-entropy-loss-fusion",
        kind="none",
        note="a fused GPU kernel, the same loss: +model.megatron.cross_entropy_loss_fusion=true sets megatron-core's field",
    ),
    Flag(
        "--calculate-per-token-loss",
        kind="none",
        note="the loss is averaged per micro-batch here (Megatron-LM's default); +model.megatron.calculate_per_token_loss=true "
        "sets megatron-core's field",
    ),
    Flag("--manual-gc*", kind="none", note="Python's garbage collector runs as Python decides"),
    Flag("--empty-unused-memory-level", kind="none", note="the CUDA caching allocator is left alone"),
    Flag("--tiktoken-*", kind="none", note="tiktoken tokenizers are not supported (data.tokenizer)"),
    Flag(
        "--no-create-attention-mask-in-dataloader",
        kind="none",
        note="the causal mask comes from the attention kernel here",
    ),
    Flag("--no-mmap-bin-files", kind="none", note=".bin files are always memory-mapped (megatron-core IndexedDataset)"),
    Flag("--profile*", kind="none", note="no profiler here (training.trace_iteration times one iteration's schedule)"),
    Flag(
        "--no-position-embedding",
        kind="none",
        note="no learned position table with RoPE already (megatron-core adds one only for "
        "--position-embedding-type learned_absolute); Megatron-LM refuses this deprecated flag unless "
        "--position-embedding-type rope (validate_args)",
    ),
    Flag("--moe-router-load-balancing-type", kind="none", note="the aux loss is megatron-core's default (aux_loss)"),
    Flag(
        "--moe-permute-fusion", kind="none", note="+model.megatron.moe_permute_fusion=true sets megatron-core's field"
    ),
]
