"""What a plan is computed from: GPU presets, the model shape, the training recipe, constants.

Pure Python. Units: bytes, FLOP/s, bytes/s. Sources as in :mod:`orchestrator.plan.memory`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

from orchestrator.config.tokenizer import BYTE_VOCAB
from orchestrator.errors import ConfigError

BYTE_TOKENIZER_VOCAB = BYTE_VOCAB + 2
"""Vocabulary of the byte tokenizer: 256 byte values + ``<eod>`` + ``<pad>`` (config/tokenizer.py)."""

GiB = 1024**3
DEFAULT_MFU = 0.4
"""Assumed MFU of busy time (no bubble, no recomputation) when none is given."""
FRAMEWORK_OVERHEAD_BYTES = 2 * GiB
"""Per-GPU allowance for the CUDA context, NCCL/cuBLAS workspaces and allocator slack."""
LARGE_BUBBLE = 0.2
"""A bubble fraction above this makes :func:`suggest` look for alternatives."""
BUS_EFFICIENCY = 0.7
"""Share of the link bandwidth a ring collective achieves (assumed)."""


ATTENTION_KERNELS = ("unfused", "flash")
"""``unfused``: megatron-core's local ``DotProductAttention`` (a s^2 b scores stored); ``flash``:
Transformer Engine's flash / cuDNN fused attention (only the softmax's log-sum-exp stored)."""


def attention_kernel(transformer_impl: str, on_gpu: bool) -> str:
    """The attention kernel a job with ``model.transformer_impl`` runs: ``flash`` for Transformer Engine
    on GPU (``auto`` assumes the GPU nodes have it, as Megatron-LM's default layer spec does), ``unfused``
    for the local spec and on CPU (Transformer Engine runs on GPUs only)."""
    return "flash" if on_gpu and transformer_impl in ("auto", "transformer_engine") else "unfused"


@dataclass(frozen=True)
class GpuPreset:
    """One accelerator: total memory (bytes, as nvidia-smi reports it) and dense peak FLOP/s."""

    name: str
    memory_bytes: int
    peak_flops_16bit: float
    """Dense bf16/fp16 tensor-core peak (no sparsity)."""
    peak_flops_fp32: float
    """Dense FP32 peak without TF32 (PyTorch's default for matmuls)."""
    intra_node_bw: float
    """NVLink bandwidth per GPU and direction, bytes/s."""
    inter_node_bw: float
    """Network bandwidth per GPU (one NIC per GPU), bytes/s."""

    def peak_flops(self, precision: str) -> float:
        return self.peak_flops_fp32 if precision == "fp32" else self.peak_flops_16bit


GPU_PRESETS: Dict[str, GpuPreset] = {
    p.name: p
    for p in (
        # NVLink 3 (300 GB/s per direction), HDR InfiniBand 200 Gb/s per GPU
        GpuPreset("A100-40GB", 40960 * 2**20, 312e12, 19.5e12, 300e9, 25e9),
        GpuPreset("A100-80GB", 81920 * 2**20, 312e12, 19.5e12, 300e9, 25e9),
        # SXM5 80GB / SXM 141GB: NVLink 4 (450 GB/s per direction), NDR 400 Gb/s per GPU
        GpuPreset("H100", 81559 * 2**20, 989e12, 67e12, 450e9, 50e9),
        GpuPreset("H200", 143771 * 2**20, 989e12, 67e12, 450e9, 50e9),
    )
}


CPU_PRESET = "cpu"
"""``gpu=cpu``: plan for this machine's CPU, one rank's share of it (see :func:`cpu_preset`)."""


def host_memory_bytes() -> int:
    """This machine's total memory (``/proc/meminfo`` MemTotal; ``sysconf`` elsewhere), bytes."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_preset(ranks_on_host: int = 1) -> GpuPreset:
    """This machine's CPU as a device: its memory shared by ``ranks_on_host`` ranks.

    FLOP/s and bandwidths are nominal placeholders (a core's fp32 FLOP/s, a memory copy); a
    calibrated :class:`orchestrator.plan.profile.DeviceProfile` replaces them.
    """
    return GpuPreset(CPU_PRESET, host_memory_bytes() // max(1, ranks_on_host), 3e10, 3e10, 1e9, 1e8)


def gpu_preset(name: str, ranks_on_host: int = 1) -> GpuPreset:
    """The preset called ``name`` (case-insensitive; ``cpu``: :func:`cpu_preset`); ConfigError naming ``gpu`` otherwise."""
    if str(name).lower() == CPU_PRESET:
        return cpu_preset(ranks_on_host)
    for key, preset in GPU_PRESETS.items():
        if key.lower() == str(name).lower():
            return preset
    raise ConfigError(
        f"gpu={name!r} is not a known GPU preset; fix: gpu= one of {', '.join(GPU_PRESETS)} "
        f"or {CPU_PRESET} (this machine's CPU)"
    )


@dataclass(frozen=True)
class ModelShape:
    """The GPT shape facts the estimates need (Megatron TransformerConfig names)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int = BYTE_TOKENIZER_VOCAB
    """Tokenizer vocabulary before padding."""
    num_query_groups: Optional[int] = None
    ffn_hidden_size: Optional[int] = None
    max_position_embeddings: Optional[int] = None
    position_embedding_type: str = "learned_absolute"
    normalization: str = "LayerNorm"
    activation: str = "gelu"
    add_bias_linear: bool = True
    add_qkv_bias: Optional[bool] = None
    untie_embeddings_and_output_weights: bool = False
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    """Experts per token (``model.moe_router_topk``); only used when ``num_moe_experts`` is set."""

    @classmethod
    def from_model_config(cls, m, vocab_size: int = BYTE_TOKENIZER_VOCAB) -> "ModelShape":
        """From an :class:`orchestrator.config.schema.ModelConfig`."""
        return cls(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            seq_length=m.seq_length,
            vocab_size=vocab_size,
            num_query_groups=m.num_query_groups,
            ffn_hidden_size=m.ffn_hidden_size,
            max_position_embeddings=m.max_position_embeddings,
            position_embedding_type=m.position_embedding_type,
            normalization=m.normalization,
            activation=m.activation,
            add_bias_linear=m.add_bias_linear,
            add_qkv_bias=m.add_qkv_bias,
            untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
            make_vocab_size_divisible_by=m.make_vocab_size_divisible_by,
            hidden_dropout=m.hidden_dropout,
            attention_dropout=m.attention_dropout,
            num_moe_experts=m.num_moe_experts,
            moe_router_topk=m.moe_router_topk,
        )

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size


@dataclass(frozen=True)
class Recipe:
    """Training choices that change memory or FLOPs but not the layout."""

    precision: str = "bf16"
    """fp32, bf16 or fp16: weights and activations are 4 or 2 bytes per element."""
    recompute_granularity: Optional[str] = None
    """None, "selective" (core attention recomputed) or "full" (layer inputs only)."""
    recompute_method: Optional[str] = None
    """With full: "uniform" (groups of recompute_num_layers) or "block" (first N layers per chunk)."""
    recompute_num_layers: Optional[int] = None
    use_distributed_optimizer: bool = False
    optimizer: str = "adam"
    sgd_momentum: float = 0.9
    grad_reduce_in_fp32: bool = True
    """Megatron-LM accumulates bf16 gradients in fp32 (``--accumulate-allreduce-grads-in-fp32``)."""
    attention: str = "unfused"
    """The attention kernel (:data:`ATTENTION_KERNELS`): ``unfused`` stores the a s^2 scores (megatron-core's
    local spec), ``flash`` does not (Transformer Engine on GPU)."""
    fp8: Optional[str] = None
    """``training.fp8`` (hybrid / e4m3): FP8 weight copies and amax buffers (:mod:`orchestrator.plan.fp8`)."""
    fp8_recipe: str = "delayed"
    fp8_amax_history_len: int = 1

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        return 4 if self.precision == "fp32" or self.grad_reduce_in_fp32 else 2

    @property
    def optimizer_bytes(self) -> int:
        """Bytes of optimizer state per parameter before DP sharding ([M]'s table minus weights and grads).

        Adam keeps two fp32 moments (8); mixed precision adds fp32 master weights (4) and, with
        16-bit gradients, an fp32 master gradient (4): 8 / 12 / 16 for fp32 / bf16+fp32 grads /
        16-bit grads, i.e. totals of 16 / 18 / 20 bytes per parameter with weights and gradients.
        SGD keeps one momentum buffer (none when momentum is 0).
        """
        master = 0 if self.precision == "fp32" else (4 if self.grad_bytes == 4 else 8)
        return 4 * self.optimizer_states + master

    @property
    def optimizer_states(self) -> int:
        """fp32 tensors the optimizer keeps per parameter: Adam's two moments, SGD's momentum (or none)."""
        return 2 if self.optimizer == "adam" else (1 if self.sgd_momentum else 0)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes per parameter in a checkpoint: the weights (in their precision), the optimizer's fp32
        states and, in mixed precision, its fp32 master weights (gradients are not saved)."""
        return self.param_bytes + 4 * self.optimizer_states + (0 if self.precision == "fp32" else 4)


def gib(n: float) -> str:
    """``n`` bytes, said: ``"1.5 GiB"`` (from 1 GiB), else ``"12.0 MiB"``."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


# ---- from a JobConfig -------------------------------------------------------------------------
def vocab_size_of(cfg, default: int = 50257) -> Tuple[int, Optional[str]]:
    """The model's vocabulary (:func:`~orchestrator.config.tokenizer.model_vocab_size`) and a note saying
    where it came from when the model preset carries one, or that it had to be assumed.

    The vocabulary the job builds the model with: :func:`orchestrator.config.tokenizer.tokenizer_facts`
    (the one function deciding it). When the tokenizer's files are not here (planning a converted
    run elsewhere): ``data.vocab_size`` if stated, else ``default`` (GPT-2's 50257), with a note.
    """
    from orchestrator.config.tokenizer import model_vocab_size, tokenizer_facts

    try:
        vocab, source = model_vocab_size(cfg, tokenizer_facts(cfg.data).vocab_size)
    except ConfigError as exc:
        if cfg.data.vocab_size is not None:
            return cfg.data.vocab_size, None
        if cfg.model.vocab_size is not None:
            return cfg.model.vocab_size, f"vocabulary {cfg.model.vocab_size}: model.vocab_size ({exc})"
        return default, f"{exc}; assumed a vocabulary of {default}"
    return vocab, (f"vocabulary {vocab}: {source}" if cfg.model.vocab_size is not None else None)


def vocab_source(cfg, vocab_size: int) -> str:
    """Where the plan's vocabulary of ``vocab_size`` ids came from, in words (the plan prints it)."""
    from orchestrator.config.tokenizer import tokenizer_facts

    d = cfg.data
    try:
        facts = tokenizer_facts(d)
    except ConfigError:
        facts = None
    if facts is not None and facts.vocab_size == vocab_size:
        if facts.kind == "byte":
            return (
                f"data.tokenizer=byte of data={d.name}: 256 byte ids + eod + pad, not a model's tokenizer "
                "(set data.tokenizer for one)"
            )
        read = ", ".join(f"{role} {path}" for role, path in facts.files)
        return f"data.tokenizer={d.tokenizer}" + (
            f", read from {read}" if read else f", data.vocab_size={d.vocab_size}"
        )
    if d.vocab_size == vocab_size:
        return f"data.vocab_size={vocab_size} (data.tokenizer={d.tokenizer}'s files are not on this machine)"
    return f"{vocab_size} ids as given to the planner (data.tokenizer={d.tokenizer} not read here)"


def recipe_of(cfg, on_gpu: Optional[bool] = None) -> Recipe:
    """The :class:`Recipe` of a :class:`~orchestrator.config.schema.JobConfig` planned on a GPU (``on_gpu``;
    None: where the job runs, :func:`~orchestrator.config.machine.runs_on_cpu`), which decides the
    attention kernel (:func:`attention_kernel`)."""
    from orchestrator.config.machine import runs_on_cpu

    m, o = cfg.model, cfg.optimizer
    gpu = not runs_on_cpu(cfg) if on_gpu is None else on_gpu
    return Recipe(
        attention=attention_kernel(m.transformer_impl, gpu),
        precision=cfg.training.precision,
        recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers,
        use_distributed_optimizer=o.use_distributed_optimizer,
        optimizer=o.name,
        sgd_momentum=o.sgd_momentum,
        fp8=cfg.training.fp8,
        fp8_recipe=cfg.training.fp8_recipe,
        fp8_amax_history_len=cfg.training.fp8_amax_history_len,
    )


def gpus_per_node(cfg) -> int:
    """GPUs per node of ``cfg.cluster`` for the planner (8 when the cluster does not say)."""
    return cfg.cluster.gpus_per_node or 8
