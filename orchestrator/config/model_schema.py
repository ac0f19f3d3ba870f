"""The network and how it is split over ranks: ``model`` and ``parallelism`` (a part of the typed
configuration; :mod:`orchestrator.config.schema` composes every section into ``JobConfig``).

Megatron's own names (TransformerConfig, Megatron-LM's arguments) for every field. Derived values
(``data_parallel_size`` when not stated, layers per stage) come from :mod:`orchestrator.config.layout`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass
class ParallelismConfig:
    """Parallel degrees. ``data_parallel_size`` is derived from the world size when null."""

    name: str = "none"
    tensor_model_parallel_size: int = 1
    """TP: each layer's weight matrices are split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: the layer stack is split into this many stages."""
    virtual_pipeline_model_parallel_size: Optional[int] = None
    """VPP: model chunks per pipeline rank (interleaved 1F1B); null = plain 1F1B."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Megatron-LM's way to say VPP: transformer layers per model chunk. Set, it derives
    VPP = num_layers / (PP x this), refused unless it divides (and unless a stated VPP agrees)."""
    context_parallel_size: int = 1
    """CP: the sequence is split over this many ranks (attention only)."""
    expert_model_parallel_size: int = 1
    """EP: MoE experts are split over this many ranks (needs model.num_moe_experts)."""
    data_parallel_size: Optional[int] = None
    """DP. Null: derived as world_size / (TP x PP x CP). Stated: must agree with the world size."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1)."""
    distributed_backend: str = "auto"
    """torch.distributed backend: auto (nccl on GPU, gloo on CPU), nccl or gloo."""
    overlap_grad_reduce: Optional[bool] = None
    """Overlap DP gradient reduction with the backward pass (megatron DDP). Null: on for a GPU job with
    DP > 1 (as NVIDIA's recipes), off on CPU (orchestrator/config/megatron_fields.py)."""
    overlap_param_gather: Optional[bool] = None
    """Overlap the distributed optimizer's parameter all-gather with the forward pass. Null: on for a GPU
    job with DP > 1 and optimizer.use_distributed_optimizer, else off."""
    megatron: Dict[str, Any] = field(default_factory=dict)
    """Any field of megatron-core's DistributedDataParallelConfig the schema does not name, applied last (:mod:`orchestrator.config.megatron_passthrough`)."""


@dataclass
class ModelConfig:
    """GPT model shape (Megatron TransformerConfig names)."""

    name: str = "gpt_tiny"
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None
    """Grouped-query attention groups; null = num_attention_heads (multi-head attention)."""
    ffn_hidden_size: Optional[int] = None
    """MLP width; null = 4 x hidden_size."""
    seq_length: int = 128
    max_position_embeddings: int = 128
    position_embedding_type: str = "learned_absolute"
    """learned_absolute or rope."""
    rotary_base: int = 10000
    """RoPE's base theta (Megatron-LM ``--rotary-base``): 10,000 (megatron-core's default, GPT-NeoX, Llama 2), 500,000
    (Llama 3), 1,000,000 (Mixtral). Read only with rope."""
    rope_scaling: Optional[str] = None
    """null, or ``llama3``: Llama 3.1's frequency scaling (Megatron-LM ``--use-rope-scaling``; megatron-core's
    low/high frequency factors 1 and 4 over an original context of 8,192)."""
    rope_scaling_factor: float = 8.0
    """With rope_scaling=llama3: the scaling factor (Megatron-LM ``--rope-scaling-factor``; Llama 3.1: 8)."""
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    """The norms' epsilon (Megatron-LM ``--norm-epsilon``, megatron-core ``layernorm_epsilon``; Llama 3: 1e-5,
    Llama 2 / Qwen2: 1e-6)."""
    """LayerNorm or RMSNorm."""
    activation: str = "gelu"
    """gelu or swiglu."""
    add_bias_linear: bool = True
    add_qkv_bias: Optional[bool] = None
    """Biases on the Q, K and V projections only (Qwen2); null: as ``add_bias_linear`` (Megatron-LM's
    ``--add-qkv-bias`` / ``--disable-bias-linear``)."""
    untie_embeddings_and_output_weights: bool = False
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this x TP (Megatron's rule)."""
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_method_std: float = 0.02
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2  # experts a token is routed to (MoELayer, alltoall dispatcher; Mixtral: 2 of 8)
    moe_aux_loss_coeff: float = 0.0  # load-balancing loss coefficient (Megatron-LM's Mixtral recipe: 1e-2)
    moe_grouped_gemm: bool = False
    """MoE experts as one grouped GEMM (megatron-core's GroupedMLP / TEGroupedMLP; Megatron-LM ``--moe-grouped-gemm``,
    on in its Mixtral example). GPU only: its kernels (grouped_gemm, Transformer Engine) have no CPU path."""
    vocab_size: Optional[int] = None
    """Published tokenizer vocabulary (Llama-3: 128256), used while the data names none (tokenizer.py)."""
    recompute_granularity: Optional[str] = None
    """null, full or selective activation recomputation."""
    recompute_method: Optional[str] = None
    """uniform or block (with recompute_granularity=full)."""
    recompute_num_layers: Optional[int] = None
    transformer_impl: str = "auto"
    """auto (Transformer Engine on GPU when installed, else local), local or transformer_engine."""
    megatron: Dict[str, Any] = field(default_factory=dict)
    """Any field of megatron-core's TransformerConfig the schema does not name, applied last (:mod:`orchestrator.config.megatron_passthrough`)."""
