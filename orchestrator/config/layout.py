"""The parallel layout: degrees in, derived values out, Megatron's rules checked.

Pure Python (no torch, no megatron import) so it runs on a login node in
milliseconds. :class:`ParallelLayout` is a small frozen value type: the degrees
and batch settings are fields, the derived values are properties, and
:meth:`ParallelLayout.validate` raises one :class:`~orchestrator.errors.LayoutError`
listing every broken rule with the keys, the values and a fix. Where the world size comes from is
:mod:`orchestrator.config.world`; VPP as a config spells it, :mod:`orchestrator.config.vpp`.

Rules (megatron-core 0.16.1, Megatron-LM ``arguments.validate_args``):

* ``world_size % (TP x PP x CP) == 0``; ``DP = world_size / (TP x PP x CP)``.
* ``global_batch_size % (micro_batch_size x DP) == 0``;
  ``num_microbatches = GBS / (MBS x DP)``.
* ``num_layers % PP == 0`` and, with VPP, ``num_layers % (PP x VPP) == 0``.
* interleaved schedule (VPP set): ``PP > 1`` and ``num_microbatches % PP == 0``
  (which implies ``num_microbatches >= PP``).
* ``num_attention_heads % TP == 0``; ``num_query_groups`` a multiple or a divisor of TP
  (megatron-core replicates key/value heads when TP exceeds the groups).
* ``sequence_parallel`` needs ``TP > 1``.
* ``seq_length <= max_position_embeddings`` (learned absolute positions);
  ``seq_length % (2 x CP) == 0`` with CP > 1 (load-balanced causal split).
* MoE: ``num_moe_experts % EP == 0`` and ``world_size % (TP x EP x PP) == 0`` (the expert
  grid: expert TP, which defaults to TP, x EP x PP; CP folds into expert data parallelism in
  ``parallel_state.initialize_model_parallel``); EP > 1 without experts is an error; EP > 1 with
  TP > 1 needs ``sequence_parallel`` (Megatron's MoE guide says it must be on; megatron-core
  0.16.1 only warns, earlier versions raised).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from orchestrator.config.divisors import divisors, nearby_multiples, nearest_divisor, nearest_multiple
from orchestrator.config.vpp import virtual_stages, vpp_no_op
from orchestrator.config.world import world_size_of
from orchestrator.errors import LayoutError

__all__ = [  # virtual_stages, vpp_no_op (config/vpp.py) and world_size_of (config/world.py): read here too
    "ParallelLayout",
    "layout_from_config",
    "padded_vocab_size",
    "virtual_stages",
    "vpp_no_op",
    "world_size_of",
]


def padded_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_model_parallel_size: int = 1
) -> int:
    """Megatron's rule: the embedding has ``vocab_size`` rounded up to a multiple of
    ``make_vocab_size_divisible_by x TP`` rows (so every TP shard gets an equal, aligned slice)."""
    multiple = make_vocab_size_divisible_by * tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel degrees, batch settings and the model facts the rules need.

    All sizes are counts (ranks, layers, sequences, tokens). Build it with
    :func:`layout_from_config` or directly; call :meth:`validate` before use.
    """

    world_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    stated_data_parallel_size: Optional[int] = None
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    global_batch_size: int = 1
    num_layers: int = 1
    num_attention_heads: int = 1
    num_query_groups: Optional[int] = None
    seq_length: int = 1
    max_position_embeddings: int = 1
    position_embedding_type: str = "learned_absolute"
    num_moe_experts: Optional[int] = None
    world_size_source: str = "cluster.nodes x cluster.tasks_per_node"

    # ---- derived values -------------------------------------------------
    @property
    def model_parallel_size(self) -> int:
        """TP x PP x CP: ranks that hold one full replica of the model."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """DP = world_size / (TP x PP x CP) (floor; :meth:`validate` checks divisibility)."""
        return max(1, self.world_size // self.model_parallel_size)

    @property
    def num_microbatches(self) -> int:
        """GBS / (MBS x DP): micro-batches per pipeline flush on each DP replica."""
        return max(1, self.global_batch_size // (self.micro_batch_size * self.data_parallel_size))

    @property
    def vpp(self) -> int:
        """Virtual stages per pipeline rank (1 when not interleaved)."""
        return self.virtual_pipeline_model_parallel_size or 1

    @property
    def layers_per_stage(self) -> int:
        """Transformer layers held by each pipeline rank."""
        return self.num_layers // self.pipeline_model_parallel_size

    @property
    def layers_per_virtual_stage(self) -> int:
        """Transformer layers in each model chunk (= layers_per_stage without VPP)."""
        return self.num_layers // (self.pipeline_model_parallel_size * self.vpp)

    @property
    def tokens_per_step(self) -> int:
        """GBS x seq_length: tokens consumed by one optimizer step."""
        return self.global_batch_size * self.seq_length

    @property
    def interleaved(self) -> bool:
        return self.virtual_pipeline_model_parallel_size is not None and self.vpp > 1

    # ---- validation -----------------------------------------------------
    def problems(self) -> List[str]:
        """Every broken rule as one sentence naming keys, values and a fix (empty = valid)."""
        return [
            *self._world_problems(),
            *self._batch_and_pipeline_problems(),
            *self._model_problems(),
            *self._expert_problems(),
        ]

    def _degrees(self):
        return (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
            self.expert_model_parallel_size,
            self.virtual_pipeline_model_parallel_size,
            [],
        )

    def _world_problems(self) -> List[str]:
        """The world size against TP x PP x CP and a stated DP."""
        tp, pp, cp, ep, vpp, out = self._degrees()
        mp = self.model_parallel_size
        if self.world_size % mp:
            valid = [d for d in divisors(self.world_size)]
            out.append(
                f"world size {self.world_size} ({self.world_size_source}) is not divisible by "
                f"TP x PP x CP = {tp} x {pp} x {cp} = {mp}; fix: choose degrees whose product divides "
                f"{self.world_size} (divisors: {valid}) or change the number of tasks"
            )
        elif self.stated_data_parallel_size is not None and self.stated_data_parallel_size != self.data_parallel_size:
            need = mp * self.stated_data_parallel_size
            out.append(
                f"parallelism.data_parallel_size={self.stated_data_parallel_size} disagrees with the world size: "
                f"DP = world_size / (TP x PP x CP) = {self.world_size} / ({tp} x {pp} x {cp}) = {self.data_parallel_size}; "
                f"fix: set parallelism.data_parallel_size=null (derive it) or {self.data_parallel_size}, "
                f"or run {need} tasks (cluster.nodes x cluster.tasks_per_node = {need})"
            )
        return out

    def _batch_and_pipeline_problems(self) -> List[str]:
        """GBS against MBS x DP; layers per (virtual) stage; the interleaved schedule's rule."""
        tp, pp, cp, ep, vpp, out = self._degrees()
        dp = self.data_parallel_size
        step = self.micro_batch_size * dp
        if self.global_batch_size % step:
            out.append(
                f"training.global_batch_size={self.global_batch_size} is not divisible by "
                f"training.micro_batch_size x DP = {self.micro_batch_size} x {dp} = {step} "
                f"({self.global_batch_size} % {step} = {self.global_batch_size % step}); "
                f"fix: training.global_batch_size one of {nearby_multiples(self.global_batch_size, step)}"
            )
        if self.num_layers % pp:
            out.append(
                f"model.num_layers={self.num_layers} does not split evenly over "
                f"parallelism.pipeline_model_parallel_size={pp} ({self.num_layers} % {pp} = {self.num_layers % pp}); "
                f"fix: parallelism.pipeline_model_parallel_size one of {[d for d in divisors(self.num_layers) if d <= 64]} "
                f"or model.num_layers one of {nearby_multiples(self.num_layers, pp)}"
            )
        elif vpp is not None and vpp > 1 and self.num_layers % (pp * vpp):
            chunks = pp * vpp
            out.append(
                f"model.num_layers={self.num_layers} layers do not split into {chunks} chunks of equal size "
                f"(PP x VPP = {pp} x {vpp}; {self.num_layers} % {chunks} = {self.num_layers % chunks}); "
                f"fix: parallelism.virtual_pipeline_model_parallel_size one of "
                f"{[v for v in divisors(self.num_layers // pp) if v > 1] or ['null']}"
            )
        if vpp is not None:
            if vpp < 1:
                key = "parallelism.virtual_pipeline_model_parallel_size"  # values.py refuses it first: a fallback
                out.append(f"{key}={vpp} must be >= 1 or null; fix: {key}=null")
            elif vpp > 1 and pp == 1:
                out.append(
                    f"parallelism.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
                    f"(got {pp}); fix: parallelism.virtual_pipeline_model_parallel_size=null"
                )
            elif vpp > 1 and self.global_batch_size % step == 0 and self.num_microbatches % pp:
                m = self.num_microbatches
                ok_gbs = [k * pp * step for k in range(1, 4)]
                out.append(
                    f"interleaved schedule (virtual_pipeline_model_parallel_size={vpp}) needs num_microbatches >= {pp} "
                    f"and a multiple of pipeline_model_parallel_size={pp}, but num_microbatches = GBS / (MBS x DP) = "
                    f"{self.global_batch_size} / ({self.micro_batch_size} x {dp}) = {m}; "
                    f"fix: training.global_batch_size one of {ok_gbs}, or parallelism.virtual_pipeline_model_parallel_size=null"
                )
        return out

    def _model_problems(self) -> List[str]:
        """Heads and query groups against TP; sequence parallel; positions; CP's sequence split."""
        tp, pp, cp, ep, vpp, out = self._degrees()
        heads = self.num_attention_heads
        if heads % tp:
            out.append(
                f"model.num_attention_heads={heads} is not divisible by parallelism.tensor_model_parallel_size={tp}; "
                f"fix: parallelism.tensor_model_parallel_size={nearest_divisor(heads, tp)} (one of {[d for d in divisors(heads) if d <= 64]})"
            )
        groups = self.num_query_groups
        if groups is not None:
            if heads % groups:
                ok = [g for g in divisors(heads) if g % tp == 0 or tp % g == 0]  # also fits TP (the rule below)
                out.append(
                    f"model.num_attention_heads={heads} is not divisible by model.num_query_groups={groups}; "
                    f"fix: model.num_query_groups={min(ok, key=lambda g: (abs(g - groups), g))} (one of {ok})"
                )
            if groups % tp and tp % groups:
                out.append(
                    f"model.num_query_groups={groups} is neither a multiple nor a divisor of "
                    f"parallelism.tensor_model_parallel_size={tp}; "
                    f"fix: parallelism.tensor_model_parallel_size one of {divisors(groups)} or a multiple of {groups}"
                )
        if self.sequence_parallel and tp == 1:
            out.append(
                "parallelism.sequence_parallel=true needs tensor_model_parallel_size > 1; fix: parallelism.sequence_parallel=false"
            )
        if self.position_embedding_type == "learned_absolute" and self.seq_length > self.max_position_embeddings:
            out.append(
                f"model.seq_length={self.seq_length} exceeds model.max_position_embeddings={self.max_position_embeddings}; "
                f"fix: model.max_position_embeddings={self.seq_length} (or model.seq_length={self.max_position_embeddings})"
            )
        if cp > 1 and self.seq_length % (2 * cp):
            out.append(
                f"model.seq_length={self.seq_length} is not divisible by 2 x context_parallel_size = {2 * cp}; "
                f"fix: model.seq_length={nearest_multiple(self.seq_length, 2 * cp)} (a multiple of {2 * cp})"
            )
        return out

    def _expert_problems(self) -> List[str]:
        """Expert parallelism: experts, the TP x EP x PP grid, sequence parallel with TP."""
        tp, pp, cp, ep, vpp, out = self._degrees()
        if ep > 1:
            if not self.num_moe_experts:
                out.append(
                    f"parallelism.expert_model_parallel_size={ep} needs a mixture-of-experts model "
                    f"(model.num_moe_experts is null); fix: parallelism.expert_model_parallel_size=1"
                )
            elif self.num_moe_experts % ep:
                out.append(
                    f"model.num_moe_experts={self.num_moe_experts} is not divisible by parallelism.expert_model_parallel_size="
                    f"{ep}; fix: parallelism.expert_model_parallel_size one of {divisors(self.num_moe_experts)}"
                )
            grid = tp * ep * pp
            if self.world_size % grid:
                out.append(
                    f"expert grid TP x EP x PP = {tp} x {ep} x {pp} = {grid} does not divide "
                    f"world size {self.world_size}; fix: parallelism.expert_model_parallel_size one of "
                    f"{[e for e in divisors(self.world_size) if self.world_size % (tp * e * pp) == 0]}"
                )
            if tp > 1 and not self.sequence_parallel:
                out.append(
                    f"parallelism.expert_model_parallel_size={ep} with tensor_model_parallel_size={tp} needs "
                    "sequence parallelism; fix: parallelism.sequence_parallel=true"
                )
        return out

    def validate(self) -> "ParallelLayout":
        """Raise :class:`LayoutError` listing every broken rule; return self when valid."""
        problems = self.problems()
        if problems:
            if len(problems) == 1:
                raise LayoutError(f"invalid parallel layout: {problems[0]}")
            raise LayoutError("invalid parallel layout:\n" + "\n".join(f"  - {p}" for p in problems))
        return self

    def summary(self) -> str:
        """The derived numbers, spelled out (printed before anything expensive)."""
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        lines = [
            f"world size {self.world_size} = TP {tp} x PP {pp} x CP {cp} x DP {self.data_parallel_size}",
            f"num_microbatches = GBS / (MBS x DP) = {self.global_batch_size} / ({self.micro_batch_size} x "
            f"{self.data_parallel_size}) = {self.num_microbatches}",
            f"layers per stage = {self.num_layers} / {pp} = {self.layers_per_stage}"
            + (
                f"; per virtual stage ({self.vpp} chunks/rank) = {self.layers_per_virtual_stage}"
                if self.interleaved
                else ""
            ),
            f"tokens per step = GBS x seq_length = {self.global_batch_size} x {self.seq_length} = {self.tokens_per_step}",
            "schedule: " + ("interleaved 1F1B" if self.interleaved else ("1F1B" if pp > 1 else "no pipelining")),
        ]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """Degrees and derived values, for manifests and results tables."""
        return {
            "world_size": self.world_size,
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "virtual_pipeline_model_parallel_size": self.virtual_pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "data_parallel_size": self.data_parallel_size,
            "sequence_parallel": self.sequence_parallel,
            "micro_batch_size": self.micro_batch_size,
            "global_batch_size": self.global_batch_size,
            "num_microbatches": self.num_microbatches,
            "layers_per_stage": self.layers_per_stage,
            "layers_per_virtual_stage": self.layers_per_virtual_stage,
        }


def layout_from_config(cfg) -> ParallelLayout:
    """Build (not validate) the layout of a :class:`~orchestrator.config.schema.JobConfig`."""
    world, source = world_size_of(cfg)
    p, m, t = cfg.parallelism, cfg.model, cfg.training
    return ParallelLayout(
        world_size=world,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        stated_data_parallel_size=p.data_parallel_size,
        sequence_parallel=p.sequence_parallel,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        num_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        seq_length=m.seq_length,
        max_position_embeddings=m.max_position_embeddings,
        position_embedding_type=m.position_embedding_type,
        num_moe_experts=m.num_moe_experts,
        world_size_source=source,
    )
