"""Plan before you spend: parameters, memory per GPU, pipeline bubble, FLOPs and step time.

Pure Python (no torch, no megatron import), so a login node answers in milliseconds
whether a layout is valid, whether it fits a GPU and what each step costs.
All sizes are bytes, FLOPs are floating-point operations (a multiply-add is 2),
times are seconds. Sources:

* [N21] Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM" (arXiv:2104.04473): pipeline bubble (section 2.2),
  FLOPs per iteration (section 5.1 and its appendix).
* [K22] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models" (arXiv:2205.05198): activation memory per layer (section 4), pipeline
  in-flight factor (section 4.2.3), selective/full recomputation (section 5), model vs
  hardware FLOPs utilisation (section 6).
* [M] Megatron-Core's distributed-optimizer guide: bytes per parameter for weights,
  gradients and optimizer state, with and without sharding over DP.

Entry points: :func:`plan` (a :class:`~orchestrator.spec.schema.JobConfig` in, a :class:`Plan`
out), :func:`plan_layout` (a :class:`~orchestrator.spec.layout.ParallelLayout` + :class:`ModelShape`
+ :class:`Recipe`) and the plain-text :func:`format_plan`. Nearby layouts that fit are found by
:mod:`orchestrator.suggest`. Every function here is a pure function of its arguments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from orchestrator.errors import ConfigError
from orchestrator.spec.layout import ParallelLayout, layout_from_config, padded_vocab_size

GiB = 1024 ** 3
BYTE_TOKENIZER_VOCAB = 258
"""Vocabulary of the byte tokenizer: 256 byte values + ``<eod>`` + ``<pad>`` (runtime/data.py)."""
DEFAULT_MFU = 0.4
"""Assumed MFU of busy time (no bubble, no recomputation) when none is given."""
FRAMEWORK_OVERHEAD_BYTES = 2 * GiB
"""Per-GPU allowance for the CUDA context, NCCL/cuBLAS workspaces and allocator slack."""
LARGE_BUBBLE = 0.2
"""A bubble fraction above this makes :func:`suggest` look for alternatives."""
BUS_EFFICIENCY = 0.7
"""Share of the link bandwidth a ring collective achieves (assumed)."""


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
        GpuPreset("A100-40GB", 40960 * 2 ** 20, 312e12, 19.5e12, 300e9, 25e9),
        GpuPreset("A100-80GB", 81920 * 2 ** 20, 312e12, 19.5e12, 300e9, 25e9),
        # SXM5 80GB / SXM 141GB: NVLink 4 (450 GB/s per direction), NDR 400 Gb/s per GPU
        GpuPreset("H100", 81559 * 2 ** 20, 989e12, 67e12, 450e9, 50e9),
        GpuPreset("H200", 143771 * 2 ** 20, 989e12, 67e12, 450e9, 50e9),
    )
}


def gpu_preset(name: str) -> GpuPreset:
    """The preset called ``name`` (case-insensitive); ConfigError naming ``gpu`` otherwise."""
    for key, preset in GPU_PRESETS.items():
        if key.lower() == str(name).lower():
            return preset
    raise ConfigError(f"gpu={name!r} is not a known GPU preset; fix: gpu= one of {', '.join(GPU_PRESETS)}")


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
    untie_embeddings_and_output_weights: bool = False
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    num_moe_experts: Optional[int] = None
    moe_router_topk: int = 2
    """Megatron's default top-k; only used when ``num_moe_experts`` is set."""

    @classmethod
    def from_model_config(cls, m, vocab_size: int = BYTE_TOKENIZER_VOCAB) -> "ModelShape":
        """From an :class:`orchestrator.spec.schema.ModelConfig`."""
        return cls(
            num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
            seq_length=m.seq_length, vocab_size=vocab_size, num_query_groups=m.num_query_groups,
            ffn_hidden_size=m.ffn_hidden_size, max_position_embeddings=m.max_position_embeddings,
            position_embedding_type=m.position_embedding_type, normalization=m.normalization,
            activation=m.activation, add_bias_linear=m.add_bias_linear,
            untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
            make_vocab_size_divisible_by=m.make_vocab_size_divisible_by, hidden_dropout=m.hidden_dropout,
            attention_dropout=m.attention_dropout, num_moe_experts=m.num_moe_experts,
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
        states = 2 if self.optimizer == "adam" else (1 if self.sgd_momentum else 0)
        master = 0 if self.precision == "fp32" else (4 if self.grad_bytes == 4 else 8)
        return 4 * states + master


@dataclass(frozen=True)
class StageMemory:
    """Memory of one GPU of one pipeline stage, in bytes."""

    stage: int
    params: int
    """Parameters held by this GPU (after TP and EP sharding)."""
    weights: float
    gradients: float
    optimizer: float
    optimizer_unsharded: float
    optimizer_sharded: float
    activations: float
    in_flight: int
    """Micro-batch chunks whose activations are alive at this stage's peak."""
    overhead: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.overhead


@dataclass
class Plan:
    """Everything :func:`format_plan` prints; units in each field's name or docstring."""

    layout: ParallelLayout
    shape: ModelShape
    recipe: Recipe
    gpu: GpuPreset
    mfu_assumed: float
    padded_vocab_size: int
    params_total: int
    params_per_layer: int
    params_embedding: int
    params_per_stage: List[int]
    """Parameters of each pipeline stage before TP sharding (tied output copy included)."""
    stages: List[StageMemory]
    activations_by_recompute: Dict[str, float]
    """Worst-stage activation bytes under no / selective / full recomputation."""
    bubble_overhead: float
    """[N21] 2.2: bubble time / ideal time = (p-1)/(v*m)."""
    bubble_fraction: float
    """Share of the step the pipeline idles: (p-1)/(v*m + p-1)."""
    compute_s: float
    """Busy compute time of the slowest stage at the assumed MFU."""
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    model_flops: float
    """Per optimizer step, without recomputation ([K22] section 6: "model FLOPs")."""
    hardware_flops: float
    """Per optimizer step, with recomputation ('hardware FLOPs')."""
    notes: List[str] = field(default_factory=list)

    @property
    def worst(self) -> StageMemory:
        return max(self.stages, key=lambda st: st.total)

    @property
    def peak_bytes(self) -> float:
        return self.worst.total

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.gpu.memory_bytes

    @property
    def bubble_s(self) -> float:
        return (self.compute_s + self.tp_comm_s + self.pp_comm_s) * self.bubble_overhead

    @property
    def step_time_s(self) -> float:
        """(compute + TP comm + PP comm) x (1 + (p-1)/(v m)) + DP comm, seconds."""
        return self.compute_s + self.tp_comm_s + self.pp_comm_s + self.bubble_s + self.dp_comm_s

    @property
    def mfu_predicted(self) -> float:
        """Model FLOPs / (world size x peak x step time)."""
        return self.model_flops / (self.layout.world_size * self.gpu.peak_flops(self.recipe.precision) * self.step_time_s)

    @property
    def tokens_per_s(self) -> float:
        return self.layout.tokens_per_step / self.step_time_s

    @property
    def reason(self) -> str:
        w, cap = self.worst, self.gpu.memory_bytes
        parts = {"weights": w.weights, "gradients": w.gradients, "optimizer state": w.optimizer,
                 "activations": w.activations}
        biggest = max(parts, key=parts.get)
        verdict = "fits" if self.fits else "does not fit"
        rel = "<=" if self.fits else ">"
        return (f"{verdict}: stage {w.stage} needs {_gib(w.total)} {rel} {_gib(cap)} on {self.gpu.name} "
                f"({100 * w.total / cap:.0f}%); largest part: {biggest} {_gib(parts[biggest])}")

    def as_dict(self) -> dict:
        """Key numbers for results tables (bytes, FLOPs, seconds)."""
        return {"gpu": self.gpu.name, "fits": self.fits, "peak_bytes": self.peak_bytes,
                "params_total": self.params_total, "bubble_fraction": self.bubble_fraction,
                "bubble_overhead": self.bubble_overhead, "model_flops": self.model_flops,
                "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "mfu_predicted": self.mfu_predicted}


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"


# ---- parameters ---------------------------------------------------------------------------

def _layer_params(shape: ModelShape) -> Tuple[int, int, int, int]:
    """(TP-replicated, TP-sharded, expert-replicated, expert-sharded) parameters of one layer.

    Dense GPT layer with h = hidden, f = ffn, q = heads x kv_channels (= h), k = query groups x
    kv_channels: norms 2 x (2h | h), QKV h(q+2k) [+ q+2k bias], projection qh [+ h],
    fc1 h f (x2 gated) [+ f], fc2 f h [+ h]. Standard GPT: 12h^2 + 13h.
    Row-parallel biases and norms are replicated over TP; the rest is split.
    MoE: the MLP becomes ``num_moe_experts`` copies (split over TP x EP) plus an h x E router.
    """
    h, f, b = shape.hidden_size, shape.ffn, int(shape.add_bias_linear)
    d = h // shape.num_attention_heads
    q, k = shape.num_attention_heads * d, (shape.num_query_groups or shape.num_attention_heads) * d
    gate = 2 if shape.activation == "swiglu" else 1
    norm = 2 * h if shape.normalization == "LayerNorm" else h
    replicated = 2 * norm + b * h  # two norms + projection bias
    sharded = h * (q + 2 * k) + b * (q + 2 * k) + q * h
    mlp_rep, mlp_sharded = b * h, h * f * gate + b * f * gate + f * h
    if shape.num_moe_experts:
        e = shape.num_moe_experts
        return replicated + h * e, sharded, e * mlp_rep, e * mlp_sharded
    return replicated + mlp_rep, sharded + mlp_sharded, 0, 0


def _stage_params(shape: ModelShape, layout: ParallelLayout, vp: int) -> List[Tuple[int, int, int, int]]:
    """Per pipeline stage: (unsharded count, per-GPU dense, per-GPU expert, per-GPU count).

    Embedding (vocab split over TP; learned positions replicated) on the first stage; final norm
    and output layer on the last. With tied embeddings and PP > 1 the last stage keeps its own
    copy of the word embeddings, which also has gradients and optimizer state.
    """
    t, p, ep = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size, layout.expert_model_parallel_size
    h = shape.hidden_size
    rep, sh, erep, esh = _layer_params(shape)
    n = layout.layers_per_stage
    pos = (shape.max_position_embeddings or shape.seq_length) if shape.position_embedding_type == "learned_absolute" else 0
    final_norm = 2 * h if shape.normalization == "LayerNorm" else h
    out = []
    for r in range(p):
        full = n * (rep + sh + erep + esh)
        dense = n * (rep + sh // t)
        expert = n * (erep // ep + esh // (t * ep))
        if r == 0:
            full += vp * h + pos * h
            dense += vp * h // t + pos * h
        if r == p - 1:
            full += final_norm
            dense += final_norm
            if shape.untie_embeddings_and_output_weights or p > 1:
                full += vp * h
                dense += vp * h // t
        out.append((full, dense, expert, dense + expert))
    return out


# ---- activations ([K22] section 4) ----------------------------------------------------------

def layer_activation_bytes(shape: ModelShape, layout: ParallelLayout, elem: int, selective: bool = False) -> float:
    """Bytes one transformer layer keeps for backward, per GPU, for one micro-batch.

    Generalises [K22] eq. 1-2: with 2-byte activations, dropout on, f = 4h and GELU it is
    exactly sbh(34 + 5as/h) without parallelism, sbh(10 + 24/t + 5as/(ht)) with TP, and
    sbh/t (34 + 5as/h) with TP + sequence parallel; selective recomputation drops the
    5as^2b attention-score term ([K22] section 5). ``elem`` is 2 (bf16/fp16) or 4 (fp32);
    dropout masks (1 byte per element) only count when the dropout probability is > 0.
    s = seq_length / CP, b = micro_batch_size, a = heads, t = TP.
    """
    s = shape.seq_length / layout.context_parallel_size
    b, h, a, t = layout.micro_batch_size, shape.hidden_size, shape.num_attention_heads, layout.tensor_model_parallel_size
    sbh = s * b * h
    hmask, amask = float(shape.hidden_dropout > 0), float(shape.attention_dropout > 0)
    topk = shape.moe_router_topk if shape.num_moe_experts else 1
    gate = 2 if shape.activation == "swiglu" else 1
    # Kept whole on every TP rank unless sequence parallel: 2 norm inputs, QKV input, fc1 input, 2 masks.
    replicated = 4 * elem * sbh + 2 * hmask * sbh
    # Split over TP: Q, K, V, projection input; MLP activation input and fc2 input (per routed expert).
    sharded = 4 * elem * sbh + topk * elem * s * b * shape.ffn * (gate + 1)
    if not selective:  # softmax output, its dropout mask and dropout output: a s^2 b terms
        sharded += a * s * shape.seq_length * b * (elem + amask * (1 + elem))
    if layout.sequence_parallel:
        return (replicated + sharded) / t
    return replicated + sharded / t


def _in_flight(layout: ParallelLayout, stage: int) -> int:
    """Micro-batch chunks alive at a stage's peak (Megatron's warm-up count + 1, capped at the total).

    1F1B: min(p - r, m) whole micro-batches ([N21] 2.2.1). Interleaved with v chunks:
    min(2(p - r - 1) + (v - 1)p + 1, m v) chunks of L/(p v) layers; on stage 0 that is
    L(1 + (p-1)/(p v)) layers' worth, [K22] section 4.2.3.
    """
    p, m, v = layout.pipeline_model_parallel_size, layout.num_microbatches, layout.vpp
    if p == 1:
        return 1
    if not layout.interleaved:
        return min(p - stage, m)
    return min(2 * (p - stage - 1) + (v - 1) * p + 1, m * v)


def _stage_activations(shape: ModelShape, layout: ParallelLayout, recipe: Recipe, stage: int,
                       vp: int, granularity: Optional[str]) -> Tuple[float, int]:
    """(bytes, in-flight chunks) of activations on one GPU of ``stage`` at its peak.

    Stored activations of the in-flight chunks ([K22]) plus a working set that [K22] does not
    count: while one layer runs backward, gradients of its activations live next to them, taken
    as one layer's full activations (and, with full recomputation, the rebuilt layers on top).
    """
    e, t = recipe.param_bytes, layout.tensor_model_parallel_size
    p, chunk_layers = layout.pipeline_model_parallel_size, layout.layers_per_virtual_stage
    full = layer_activation_bytes(shape, layout, e, selective=False)
    sbh = shape.seq_length / layout.context_parallel_size * layout.micro_batch_size * shape.hidden_size
    sbh_local = sbh / t if layout.sequence_parallel else sbh
    flight = _in_flight(layout, stage)
    transient = full  # backward working set of one layer
    if granularity == "full":
        n = max(1, min(recipe.recompute_num_layers or 1, chunk_layers))
        if recipe.recompute_method == "block":  # first n layers keep only their input
            per_chunk = n * e * sbh_local + (chunk_layers - n) * full
            transient += full
        else:  # uniform: one stored input per group of n layers; a group is rebuilt in backward
            per_chunk = math.ceil(chunk_layers / n) * e * sbh_local
            transient += n * full
    else:
        per_chunk = chunk_layers * layer_activation_bytes(shape, layout, e, selective=granularity == "selective")
    total = flight * per_chunk + transient
    if stage == 0 and shape.hidden_dropout > 0:  # embedding dropout mask
        total += flight * sbh_local
    if stage == p - 1:  # final norm + output-layer inputs; logits and fp32 softmax of one micro-batch
        total += 2 * e * sbh_local + (e + 4) * sbh / shape.hidden_size * vp / t
    return total, flight


# ---- time ---------------------------------------------------------------------------------

def bubble(pp: int, num_microbatches: int, vpp: int = 1) -> Tuple[float, float]:
    """Pipeline bubble of one flush, [N21] section 2.2, as (overhead, fraction).

    overhead = bubble time / ideal time = (p-1)/(v m)  ([N21] 2.2.1 for 1F1B, 2.2.2 interleaved);
    fraction = bubble time / step time = (p-1)/(v m + p - 1)  (step = (v m + p - 1) chunk-times).
    PP=4, m=8: 3/8 and 3/11; with v=2: 3/16 and 3/19.
    """
    idle, work = pp - 1, vpp * num_microbatches
    return idle / work, idle / (work + idle)


def _layer_forward_flops_per_token(shape: ModelShape) -> Tuple[float, float]:
    """(dense matmul FLOPs, attention-core FLOPs) of one layer's forward pass per token.

    Standard GPT: 24h^2 and 4sh, so with the 2hV logit layer and x3 for backward this is
    [N21] eq. (3) without recomputation: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
    """
    h, a = shape.hidden_size, shape.num_attention_heads
    d = h // a
    q, k = a * d, (shape.num_query_groups or a) * d
    gate = 2 if shape.activation == "swiglu" else 1
    topk = shape.moe_router_topk if shape.num_moe_experts else 1
    dense = 2 * h * (q + 2 * k) + 2 * q * h + topk * 2 * h * shape.ffn * (gate + 1)
    if shape.num_moe_experts:
        dense += 2 * h * shape.num_moe_experts
    return dense, 4 * shape.seq_length * q


def flops_per_step(shape: ModelShape, layout: ParallelLayout, recipe: Recipe, vp: int) -> Tuple[float, float, List[float]]:
    """(model FLOPs, hardware FLOPs, hardware FLOPs per pipeline stage) of one optimizer step.

    Model FLOPs = 3 x forward (backward = 2 x forward), [N21] 5.1; for standard GPT this equals
    72 B s l h^2 (1 + s/(6h) + V/(12 l h)). Hardware FLOPs add what recomputation redoes:
    full = one more forward of the recomputed layers ([N21]'s 96 B s l h^2 (1 + s/(6h) + V/(16 l h))
    when every layer is recomputed), selective = the attention core again ([K22] sections 5-6).
    """
    tokens = layout.tokens_per_step
    dense, attn = _layer_forward_flops_per_token(shape)
    layer = dense + attn
    logits = 2 * shape.hidden_size * vp
    model = tokens * (3 * shape.num_layers * layer + 3 * logits)
    if recipe.recompute_granularity == "full":
        chunk = layout.layers_per_virtual_stage
        n = chunk if recipe.recompute_method != "block" else min(recipe.recompute_num_layers or chunk, chunk)
        extra_per_layer = layer * n / chunk
    elif recipe.recompute_granularity == "selective":
        extra_per_layer = attn
    else:
        extra_per_layer = 0.0
    per_layer_hw = tokens * (3 * layer + extra_per_layer)
    p = layout.pipeline_model_parallel_size
    stages = [layout.layers_per_stage * per_layer_hw for _ in range(p)]
    stages[-1] += tokens * 3 * logits
    return model, sum(stages), stages


def comm_seconds(shape: ModelShape, layout: ParallelLayout, recipe: Recipe, gpu: GpuPreset,
                 params_per_gpu: int, gpus_per_node: int = 8) -> Tuple[float, float, float]:
    """(TP, PP, DP) communication seconds per step on one GPU; a rough model, assumed not overlapped.

    TP ([K22] 4.2.2): every layer all-reduces its e s b h output twice forward and twice backward
    (sequence parallel turns each into a reduce-scatter + all-gather of the same volume), twice more
    when a full-recompute forward reruns it; a ring moves 2(t-1)/t of the buffer per GPU.
    DP: the gradients once per step, 2(d-1)/d x gradient bytes (distributed optimizer:
    reduce-scatter of gradients + all-gather of weights, (d-1)/d x both).
    PP: each micro-batch chunk sends its e s b h / (t if SP) output forward and receives its gradient,
    so interleaving multiplies this by v ([N21] 2.2.2). Megatron orders ranks tp-cp-ep-dp-pp, so a
    group uses NVLink while its span of consecutive ranks fits in a node (TP for TP, TP x CP x DP for
    DP, world/PP for PP neighbours), else the network. Links reach ``BUS_EFFICIENCY`` of nominal.
    MoE all-to-all is left out.
    """
    t, cp, dp = layout.tensor_model_parallel_size, layout.context_parallel_size, layout.data_parallel_size
    p = layout.pipeline_model_parallel_size

    def bw(span: int) -> float:
        return BUS_EFFICIENCY * (gpu.intra_node_bw if span <= gpus_per_node else gpu.inter_node_bw)

    buffer = recipe.param_bytes * shape.seq_length / cp * layout.micro_batch_size * shape.hidden_size
    tp_s = pp_s = 0.0
    if p > 1:
        sent = buffer / t if layout.sequence_parallel else buffer
        pp_s = layout.num_microbatches * layout.vpp * 2 * sent / bw(layout.world_size // p + 1)
    if t > 1:
        calls = 6 if recipe.recompute_granularity == "full" else 4
        tp_s = layout.num_microbatches * layout.layers_per_stage * calls * 2 * (t - 1) / t * buffer / bw(t)
    dp_s = 0.0
    if dp > 1:
        if recipe.use_distributed_optimizer:
            volume = (dp - 1) / dp * params_per_gpu * (recipe.grad_bytes + recipe.param_bytes)
        else:
            volume = 2 * (dp - 1) / dp * params_per_gpu * recipe.grad_bytes
        dp_s = volume / bw(t * cp * dp)
    return tp_s, pp_s, dp_s


# ---- the plan -----------------------------------------------------------------------------

def recipe_problems(recipe: Recipe, layout: ParallelLayout) -> List[str]:
    """Megatron's recomputation rules (TransformerConfig.__post_init__), checked before submission."""
    out: List[str] = []
    g, per_rank = recipe.recompute_granularity, layout.layers_per_stage
    if g == "full":
        if recipe.recompute_method not in ("uniform", "block"):
            out.append(f"model.recompute_granularity=full needs model.recompute_method uniform or block "
                       f"(got {recipe.recompute_method!r}); fix: model.recompute_method=uniform")
        n = recipe.recompute_num_layers
        if n is None or not 1 <= n <= per_rank:
            out.append(f"model.recompute_num_layers={n} must be between 1 and the layers per pipeline rank "
                       f"({per_rank}) with recompute_granularity=full; fix: model.recompute_num_layers=1")
    elif g == "selective" and recipe.recompute_num_layers is not None:
        out.append(f"model.recompute_num_layers={recipe.recompute_num_layers} must be null with "
                   "recompute_granularity=selective; fix: model.recompute_num_layers=null")
    return out


def plan_layout(layout: ParallelLayout, shape: ModelShape, recipe: Recipe, gpu: GpuPreset,
                mfu: float = DEFAULT_MFU, validate: bool = True, gpus_per_node: int = 8) -> Plan:
    """Plan one layout. Raises LayoutError / ConfigError when a Megatron rule is broken.

    ``mfu`` is the assumed model-FLOPs utilisation of busy compute time (no bubble, no
    recomputation, no communication). Step time, in seconds:
    compute = max over stages of hardware FLOPs / (GPUs per stage x peak x mfu);
    step = (compute + TP comm + PP comm) x (1 + (p-1)/(v m)) + DP comm  (see :func:`comm_seconds`).
    The predicted MFU is model FLOPs / (world size x peak x step).
    """
    if validate:
        layout.validate()
        problems = recipe_problems(recipe, layout)
        if problems:
            raise ConfigError("invalid recomputation settings: " + "; ".join(problems))
    t, p = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    ep = layout.expert_model_parallel_size
    vp = padded_vocab_size(shape.vocab_size, shape.make_vocab_size_divisible_by, t)
    per_stage = _stage_params(shape, layout, vp)
    dp = layout.data_parallel_size
    edp = max(1, layout.world_size // (t * ep * p))
    ob = recipe.optimizer_bytes
    stages = []
    for r, (_, dense, expert, count) in enumerate(per_stage):
        act, flight = _stage_activations(shape, layout, recipe, r, vp, recipe.recompute_granularity)
        unsharded, sharded = count * ob, dense * ob / dp + expert * ob / edp
        stages.append(StageMemory(
            stage=r, params=count, weights=count * recipe.param_bytes, gradients=count * recipe.grad_bytes,
            optimizer=sharded if recipe.use_distributed_optimizer else unsharded,
            optimizer_unsharded=unsharded, optimizer_sharded=sharded, activations=act, in_flight=flight,
            overhead=FRAMEWORK_OVERHEAD_BYTES))
    alt_full = recipe if recipe.recompute_granularity == "full" else replace(
        recipe, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    ends = {0, p - 1}  # middle stages hold fewer micro-batches and neither embedding nor logits
    by_recompute = {
        name: max(_stage_activations(shape, layout, rec, r, vp, g)[0] for r in ends)
        for name, rec, g in (("none", recipe, None), ("selective", recipe, "selective"), ("full", alt_full, "full"))
    }
    overhead, fraction = bubble(p, layout.num_microbatches, layout.vpp)
    model, hardware, stage_flops = flops_per_step(shape, layout, recipe, vp)
    peak = gpu.peak_flops(recipe.precision)
    compute = max(stage_flops) / (layout.world_size / p * peak * mfu)
    tp_s, pp_s, dp_s = comm_seconds(shape, layout, recipe, gpu, max(st.params for st in stages), gpus_per_node)
    tied_copy = vp * shape.hidden_size if (p > 1 and not shape.untie_embeddings_and_output_weights) else 0
    rep, sh, erep, esh = _layer_params(shape)
    pos = (shape.max_position_embeddings or shape.seq_length) if shape.position_embedding_type == "learned_absolute" else 0
    notes = []
    if recipe.precision == "fp32":
        notes.append(f"fp32: peak is {gpu.peak_flops_fp32 / 1e12:g} TFLOP/s (no TF32); activations 4 bytes/element")
    return Plan(
        layout=layout, shape=shape, recipe=recipe, gpu=gpu, mfu_assumed=mfu, padded_vocab_size=vp,
        params_total=sum(s[0] for s in per_stage) - tied_copy, params_per_layer=rep + sh + erep + esh,
        params_embedding=(vp + pos) * shape.hidden_size, params_per_stage=[s[0] for s in per_stage],
        stages=stages, activations_by_recompute=by_recompute, bubble_overhead=overhead,
        bubble_fraction=fraction, compute_s=compute, tp_comm_s=tp_s, pp_comm_s=pp_s, dp_comm_s=dp_s,
        model_flops=model, hardware_flops=hardware, notes=notes)


def vocab_size_of(cfg, default: int = 50257) -> Tuple[int, Optional[str]]:
    """Tokenizer vocabulary of ``cfg.data.tokenizer`` and a note when it had to be assumed.

    ``byte`` -> 258. A tokenizer.json path -> 1 + the largest id in ``model.vocab`` and
    ``added_tokens`` (read with the json module); unreadable -> ``default`` (GPT-2's 50257).
    """
    tok = cfg.data.tokenizer
    if tok == "byte":
        return BYTE_TOKENIZER_VOCAB, None
    import json
    import os

    try:
        with open(os.path.expanduser(tok), encoding="utf-8") as fh:
            spec = json.load(fh)
        vocab = spec.get("model", {}).get("vocab", {})
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t.get("id", 0) for t in spec.get("added_tokens", [])]
        return max(ids) + 1, None
    except (OSError, ValueError, AttributeError, TypeError):
        return default, f"data.tokenizer={tok!r} could not be read here; assumed a vocabulary of {default}"


def recipe_of(cfg) -> Recipe:
    """The :class:`Recipe` of a :class:`~orchestrator.spec.schema.JobConfig`."""
    m, o = cfg.model, cfg.optimizer
    return Recipe(precision=cfg.training.precision, recompute_granularity=m.recompute_granularity,
                  recompute_method=m.recompute_method, recompute_num_layers=m.recompute_num_layers,
                  use_distributed_optimizer=o.use_distributed_optimizer, optimizer=o.name,
                  sgd_momentum=o.sgd_momentum)


def _gpus_per_node(cfg) -> int:
    return cfg.cluster.gpus_per_node or 8


def plan(cfg, gpu: Optional[str] = None, vocab_size: Optional[int] = None, mfu: Optional[float] = None) -> Plan:
    """Plan a :class:`~orchestrator.spec.schema.JobConfig` on ``gpu`` (default ``cfg.gpu``).

    Raises :class:`~orchestrator.errors.LayoutError` for a broken Megatron rule and
    :class:`~orchestrator.errors.ConfigError` for an unknown GPU preset.
    """
    preset = gpu_preset(gpu if gpu is not None else cfg.gpu)
    note = None
    if vocab_size is None:
        vocab_size, note = vocab_size_of(cfg)
    shape = ModelShape.from_model_config(cfg.model, vocab_size)
    result = plan_layout(layout_from_config(cfg), shape, recipe_of(cfg), preset, mfu or DEFAULT_MFU,
                         gpus_per_node=_gpus_per_node(cfg))
    if note:
        result.notes.append(note)
    if cfg.training.device == "cpu" or (cfg.cluster.kind == "local" and not cfg.cluster.gpus_per_node):
        result.notes.append(f"this config runs on CPU; memory and time are for the {preset.name} preset")
    return result
