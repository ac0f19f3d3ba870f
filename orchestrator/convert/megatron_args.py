"""The one table: Megatron-LM ``pretrain_gpt.py`` flags and the orchestrator keys they mean.

Both directions read :data:`TABLE`: :mod:`orchestrator.convert.to_config` maps each flag of a
script onto our dotted keys, :mod:`orchestrator.convert.from_config` walks the same rows backwards
to print the flags of a composed config. Every fact is stated once, in one row:

* ``flag`` — Megatron-LM's spelling (``--num-layers``), ``key`` — ours (``model.num_layers``);
* ``kind`` — how the value converts: ``int`` / ``float`` / ``str`` (one value), ``on``
  (``store_true``: giving the flag sets ``key`` to ``value``), ``special`` (a converter in
  to_config/from_config named after the flag: derived values, several keys), ``none`` (no
  equivalent here; ``note`` says why) or ``wrong`` (a mistake for a GPT job; ``note`` says why);
* ``default`` — what Megatron-LM uses when no flag sets ``key`` (its ``arguments.py``), or
  :data:`KEEP` when it has none that applies (a required flag, or a choice Megatron-LM leaves to
  us, such as ``transformer_impl=auto``); an imported file gets it written out, so the run is the
  one Megatron-LM would have started;
* ``export`` — false for import-only spellings (deprecated aliases, flags Megatron-LM lacks);
  ``omit`` — values for which the export prints nothing (besides ``default``).

Flag names and defaults follow Megatron-LM's ``megatron/training/arguments.py`` (core 0.9 - 0.16);
the facts about tokenizers and the SwiGLU width rule are Megatron-LM's ``validate_args``.
Pure data, no imports beyond the standard library.
"""

from __future__ import annotations

import fnmatch
from typing import Any, List, Optional

from orchestrator.convert.flag_row import KEEP, Flag  # noqa: F401  (M.KEEP, M.Flag: one table's names)
from orchestrator.convert.megatron_unmapped import UNMAPPED

GPT2_BPE_VOCAB = 50257
"""Megatron-LM's GPT2BPETokenizer (the GPT-2 byte-pair encoding): 50,257 ids, eod = 50256."""
NULL_TOKENIZER_BYTE_VOCAB = 256
"""Older Megatron-LM's ``--tokenizer-type NullTokenizer --vocab-size 256`` = ids 0..255 plus eod 256 (its
legacy NullTokenizer added the eod): read as our byte tokenizer."""
BYTE_NULL_TOKENIZER = (("--vocab-size", "258"), ("--null-tokenizer-eod-id", "256"), ("--null-tokenizer-pad-id", "257"))
"""Our byte tokenizer (bytes 0..255, eod 256, pad 257: 258 ids) as megatron-core's NullTokenizer of Megatron-LM
0.20 (``tokenizers/text/libraries/null_tokenizer.py``: ``vocab_size`` ids, eod ``vocab_size - 1`` unless
``--null-tokenizer-eod-id``): the same vocabulary, padded alike (384), the same eod."""
MEGATRON_DEFAULT_SPLIT = "969, 30, 1"
"""Megatron-LM's ``--split`` when ``--data-path`` is given without one (``validate_args``)."""


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron-LM's MLP width for ``--swiglu`` without ``--ffn-hidden-size``:
    ``int(4 h x 2/3 / 64) x 64`` (keeps the parameter count near the 4h GELU MLP; multiple of 64)."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


_SPLIT_RANK = (
    "the split rank is where an encoder-decoder model (T5) switches from encoder to decoder stages "
    "(deprecated in Megatron-LM for --encoder-pipeline-model-parallel-size); a GPT model has no encoder. "
    "It does not enable 1F1B: with PP > 1 Megatron-LM always runs 1F1B, and the interleaved 1F1B "
    "schedule comes from virtual stages (--num-layers-per-virtual-pipeline-stage)"
)
_ENCODER = "encoder-decoder models only; a GPT model has no encoder"
_DATA_PARALLEL = (
    "Megatron-LM has no --data-parallel-size flag (its parser refuses unknown flags); it derives "
    "DP = world size / (TP x PP x CP). Read as parallelism.data_parallel_size and checked against the world size"
)

TABLE: List[Flag] = [
    # ---- parallel layout
    Flag("--tensor-model-parallel-size", "parallelism.tensor_model_parallel_size", "int", default=1),
    Flag(
        "--model-parallel-size",
        "parallelism.tensor_model_parallel_size",
        "int",
        export=False,
        note="Megatron-LM's deprecated name of --tensor-model-parallel-size",
    ),
    Flag("--pipeline-model-parallel-size", "parallelism.pipeline_model_parallel_size", "int", default=1),
    Flag(
        "--num-layers-per-virtual-pipeline-stage",
        "parallelism.virtual_pipeline_model_parallel_size",
        "special",
        default=None,
    ),
    Flag(
        "--num-virtual-stages-per-pipeline-rank",
        "parallelism.virtual_pipeline_model_parallel_size",
        "int",
        export=False,
    ),
    Flag(
        "--virtual-pipeline-model-parallel-size",
        "parallelism.virtual_pipeline_model_parallel_size",
        "int",
        export=False,
        note="not a Megatron-LM flag (NeMo's name); read as VPP",
    ),
    Flag("--context-parallel-size", "parallelism.context_parallel_size", "int", default=1),
    Flag("--expert-model-parallel-size", "parallelism.expert_model_parallel_size", "int", default=1),
    Flag("--sequence-parallel", "parallelism.sequence_parallel", "on", default=False),
    Flag("--distributed-backend", "parallelism.distributed_backend", "str", omit=("auto",)),
    Flag(
        "--data-parallel-size", "parallelism.data_parallel_size", "int", default=None, export=False, note=_DATA_PARALLEL
    ),
    Flag("--pipeline-model-parallel-split-rank", kind="wrong", note=_SPLIT_RANK),
    Flag("--encoder-pipeline-model-parallel-size", kind="wrong", note=_ENCODER),
    Flag("--encoder-tensor-model-parallel-size", kind="wrong", note=_ENCODER),
    Flag("--encoder-num-layers", kind="wrong", note="encoder-decoder models only; a GPT model has --num-layers"),
    Flag("--decoder-num-layers", kind="wrong", note="encoder-decoder models only; a GPT model has --num-layers"),
    Flag("--decoder-seq-length", kind="wrong", note="encoder-decoder models only; a GPT model has --seq-length"),
    # ---- model shape
    Flag("--num-layers", "model.num_layers", "int"),
    Flag("--hidden-size", "model.hidden_size", "int"),
    Flag("--num-attention-heads", "model.num_attention_heads", "int"),
    Flag("--group-query-attention", "model.num_query_groups", "special", default=None),
    Flag("--num-query-groups", "model.num_query_groups", "special", export=False),
    Flag("--ffn-hidden-size", "model.ffn_hidden_size", "special", default=None),
    Flag("--seq-length", "model.seq_length", "int"),
    Flag(
        "--encoder-seq-length", "model.seq_length", "int", export=False, note="Megatron-LM's older name of --seq-length"
    ),
    Flag("--max-position-embeddings", "model.max_position_embeddings", "int"),
    Flag("--position-embedding-type", "model.position_embedding_type", "str", default="learned_absolute"),
    Flag(
        "--use-rotary-position-embeddings",
        "model.position_embedding_type",
        "on",
        value="rope",
        export=False,
        note="deprecated in Megatron-LM for --position-embedding-type rope",
    ),
    Flag("--rotary-base", "model.rotary_base", "int", default=10000),
    Flag("--use-rope-scaling", "model.rope_scaling", "on", value="llama3", default=None),
    Flag("--rope-scaling-factor", "model.rope_scaling_factor", "float", default=8.0),
    Flag("--normalization", "model.normalization", "str", default="LayerNorm"),
    Flag("--norm-epsilon", "model.norm_epsilon", "float", default=1e-5),
    Flag("--add-qkv-bias", "model.add_qkv_bias", "on", value=True, default=None),
    Flag("--swiglu", "model.activation", "on", value="swiglu", default="gelu"),
    Flag("--disable-bias-linear", "model.add_bias_linear", "on", value=False, default=True),
    Flag("--untie-embeddings-and-output-weights", "model.untie_embeddings_and_output_weights", "on", default=False),
    Flag("--make-vocab-size-divisible-by", "model.make_vocab_size_divisible_by", "int", default=128),
    Flag("--hidden-dropout", "model.hidden_dropout", "float", default=0.1),
    Flag("--attention-dropout", "model.attention_dropout", "float", default=0.1),
    Flag("--init-method-std", "model.init_method_std", "float", default=0.02),
    Flag("--num-experts", "model.num_moe_experts", "int", default=None),
    Flag("--moe-router-topk", "model.moe_router_topk", "int", default=2),
    Flag("--moe-aux-loss-coeff", "model.moe_aux_loss_coeff", "float", default=0.0),
    Flag("--moe-grouped-gemm", "model.moe_grouped_gemm", "on", default=False),
    Flag(
        "--moe-token-dispatcher-type",
        kind="none",
        note="a MoE job here always exchanges tokens all-to-all over the EP group (exported as alltoall)",
    ),
    Flag("--recompute-granularity", "model.recompute_granularity", "str", default=None),
    Flag("--recompute-method", "model.recompute_method", "str", default=None),
    Flag("--recompute-num-layers", "model.recompute_num_layers", "int", default=None),
    Flag(
        "--recompute-activations",
        "model.recompute_granularity",
        "on",
        value="selective",
        export=False,
        note="Megatron-LM's older name of --recompute-granularity selective",
    ),
    Flag(
        "--checkpoint-activations",
        kind="wrong",
        note="removed from Megatron-LM (it refuses it); say --recompute-granularity full "
        "--recompute-method uniform --recompute-num-layers 1",
    ),
    Flag("--transformer-impl", "model.transformer_impl", "str", omit=("auto",)),
    # ---- optimizer and learning-rate schedule
    Flag("--optimizer", "optimizer.name", "str", default="adam"),
    Flag("--lr", "optimizer.lr", "float"),
    Flag("--min-lr", "optimizer.min_lr", "float", default=0.0),
    Flag("--weight-decay", "optimizer.weight_decay", "float", default=0.01),
    Flag("--adam-beta1", "optimizer.adam_beta1", "float", default=0.9),
    Flag("--adam-beta2", "optimizer.adam_beta2", "float", default=0.999),
    Flag("--adam-eps", "optimizer.adam_eps", "float", default=1e-8),
    Flag("--sgd-momentum", "optimizer.sgd_momentum", "float", default=0.9),
    Flag("--clip-grad", "optimizer.clip_grad", "float", default=1.0),
    Flag("--lr-decay-style", "optimizer.lr_decay_style", "str", default="linear"),
    Flag("--lr-warmup-iters", "optimizer.lr_warmup_iters", "int", default=0),
    Flag("--lr-warmup-fraction", "optimizer.lr_warmup_iters", "special", export=False),
    Flag("--lr-warmup-samples", "optimizer.lr_warmup_iters", "special", export=False),
    Flag("--lr-decay-iters", "optimizer.lr_decay_iters", "int", default=None),
    Flag("--lr-decay-samples", "optimizer.lr_decay_iters", "special", export=False),
    Flag("--use-distributed-optimizer", "optimizer.use_distributed_optimizer", "on", default=False),
    # ---- batches, iterations, precision
    Flag("--micro-batch-size", "training.micro_batch_size", "int"),
    Flag("--global-batch-size", "training.global_batch_size", "int"),
    Flag("--train-iters", "training.train_iters", "int"),
    Flag("--train-samples", "training.train_iters", "special", export=False),
    Flag("--rampup-batch-size", "training.rampup_batch_size", "special", default=None),
    Flag("--seed", "training.seed", "int", default=1234),
    Flag("--log-interval", "training.log_interval", "int", default=100),
    Flag("--bf16", "training.precision", "on", value="bf16", default="fp32"),
    Flag("--fp16", "training.precision", "on", value="fp16"),
    Flag("--fp8-format", "training.fp8", "str", default=None),
    Flag("--fp8-recipe", "training.fp8_recipe", "str", default="delayed"),
    Flag("--fp8-amax-history-len", "training.fp8_amax_history_len", "int", default=1),
    Flag("--fp8-amax-compute-algo", "training.fp8_amax_compute_algo", "str", default="most_recent"),
    Flag("--distributed-timeout-minutes", "training.distributed_timeout_minutes", "int", default=10),
    Flag("--eval-interval", "training.eval_interval", "int", default=1000),
    Flag("--eval-iters", "training.eval_iters", "int", default=100),
    # ---- logging
    Flag("--tensorboard-dir", "logging.tensorboard", "special", default=False),
    Flag("--wandb-project", "logging.wandb.project", "str", default=None),
    Flag("--wandb-exp-name", "logging.wandb.name", "str", default=None),
    Flag("--wandb-entity", "logging.wandb.entity", "str", default=None),
    # ---- checkpoints
    Flag("--save", "run.root", "special"),
    Flag("--load", "checkpoint.auto_resume", "special", export=False),
    Flag("--save-interval", "checkpoint.save_interval", "int", default=None),
    # ---- data and tokenizer
    Flag("--data-path", "data.paths", "special"),
    Flag("--mock-data", "data.kind", "special", export=False),
    Flag("--split", "data.split", "str"),
    Flag("--num-workers", "data.num_workers", "int"),  # unset: ours picks 2 on GPU (Megatron-LM's), 0 on CPU
    Flag(
        "--data-cache-path",
        "data.cache_dir",
        "str",
        export=False,
        note="Megatron-LM caches dataset indices there; the orchestrator keeps prepared data and indices "
        "in data.cache_dir",
    ),
    Flag("--tokenizer-type", "data.tokenizer", "special"),
    Flag("--vocab-file", "data.vocab_file", "special", export=False),
    Flag("--merge-file", "data.merge_file", "special", export=False),
    Flag("--tokenizer-model", "data.tokenizer_model", "special", export=False),
    Flag("--vocab-size", "data.vocab_size", "special", export=False),
    Flag("--null-tokenizer-eod-id", "data.eod_id", "special", export=False),
    Flag("--null-tokenizer-pad-id", "data.tokenizer", "special", export=False),
    Flag("--overlap-grad-reduce", "parallelism.overlap_grad_reduce", "on", default=False),
    Flag("--overlap-param-gather", "parallelism.overlap_param_gather", "on", default=False),
    *UNMAPPED,
]


def row(flag: str) -> Optional[Flag]:
    """The row for ``flag`` (exact spelling first, then the ``*`` patterns), or None if unknown."""
    for r in TABLE:
        if r.flag == flag:
            return r
    for r in TABLE:
        if "*" in r.flag and fnmatch.fnmatchcase(flag, r.flag):
            return r
    return None


def rows_for(key: str) -> List[Flag]:
    """Every row that sets ``key`` (exporting rows first)."""
    return sorted((r for r in TABLE if r.key == key), key=lambda r: not r.export)


def megatron_default(key: str) -> Any:
    """Megatron-LM's value for ``key`` when no flag sets it (:data:`KEEP` when it has none)."""
    for r in rows_for(key):
        if r.default is not KEEP:
            return r.default
    return KEEP


def mapped_keys() -> List[str]:
    """Our keys that some row sets, in table order (each once)."""
    out: List[str] = []
    for r in TABLE:
        if r.key and r.key not in out:
            out.append(r.key)
    return out
