"""The parallel layout: degrees in, derived values out, Megatron's rules checked.

Pure Python (no torch, no megatron import) so it runs on a login node in
milliseconds. :class:`ParallelLayout` is a small frozen value type: the degrees
and batch settings are fields, the derived values are properties, and
:meth:`ParallelLayout.validate` raises one :class:`~orchestrator.errors.LayoutError`
listing every broken rule with the keys, the values and a fix. The rules themselves (Megatron's, each with
its sentence and fix) are :mod:`orchestrator.config.layout_rules`. Where the world size comes from is
:mod:`orchestrator.config.world`; VPP as a config spells it, :mod:`orchestrator.config.vpp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from orchestrator.config.layout_rules import layout_problems
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
        """Every broken rule as one sentence naming keys, values and a fix (empty = valid); the rules are
        :func:`orchestrator.config.layout_rules.layout_problems`."""
        return layout_problems(self)

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
