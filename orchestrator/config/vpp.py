"""VPP as a config spells it: ``parallelism.virtual_pipeline_model_parallel_size`` or Megatron-LM's
``num_layers_per_virtual_pipeline_stage`` (layers per model chunk), resolved to one VPP; and the line
that says when the keys leave VPP = 1 (a no-op). The layout rules themselves are in
:mod:`orchestrator.config.layout`.
"""

from __future__ import annotations

from typing import Optional

from orchestrator.config.divisors import divisors
from orchestrator.errors import LayoutError


def virtual_stages(
    num_layers: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: Optional[int],
    num_layers_per_virtual_pipeline_stage: Optional[int],
) -> Optional[int]:
    """VPP, also from Megatron-LM's ``--num-layers-per-virtual-pipeline-stage`` (n layers per chunk).

    n null: VPP as given. Else VPP = num_layers / (PP x n) (layer counts), which must divide and
    agree with a stated VPP; otherwise :class:`LayoutError` naming the keys, the arithmetic and a fix.
    """
    n, pp = num_layers_per_virtual_pipeline_stage, pipeline_model_parallel_size
    if n is None:
        return virtual_pipeline_model_parallel_size
    per_stage = num_layers // pp if isinstance(pp, int) and pp > 0 and num_layers % pp == 0 else None
    if per_stage is None or not isinstance(n, int) or n < 1 or per_stage % n:
        ok = divisors(per_stage) if per_stage else ["null"]
        raise LayoutError(
            f"parallelism.num_layers_per_virtual_pipeline_stage={n}: does not divide the layers of a pipeline stage "
            f"(model.num_layers / PP = {num_layers} / {pp}); fix: one of {ok}"
        )
    vpp = per_stage // n
    if virtual_pipeline_model_parallel_size not in (None, vpp):
        raise LayoutError(
            f"parallelism.virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}: disagrees with "
            f"parallelism.num_layers_per_virtual_pipeline_stage={n} (VPP = {num_layers} / ({pp} x {n}) = {vpp}); "
            "fix: set one of them and the other to null"
        )
    return vpp


def vpp_no_op(cfg) -> Optional[str]:
    """A line saying that the VPP keys of ``cfg`` (a composed JobConfig) leave VPP = 1: one model chunk per
    pipeline rank, the plain 1F1B schedule, as if neither key were set; None when they do not."""
    p, layers = cfg.parallelism, cfg.model.num_layers
    if p.virtual_pipeline_model_parallel_size != 1:
        return None
    pp = p.pipeline_model_parallel_size
    if p.num_layers_per_virtual_pipeline_stage is not None:
        n = p.num_layers_per_virtual_pipeline_stage
        said = (
            f"parallelism.num_layers_per_virtual_pipeline_stage={n} leaves VPP = num_layers / (PP x {n}) = "
            f"{layers} / ({pp} x {n}) = 1"
        )
        fix = f"one of {[d for d in divisors(layers // pp) if d < n]} for VPP > 1" if pp > 1 else "PP > 1 first"
    else:
        said, fix = "parallelism.virtual_pipeline_model_parallel_size=1", "2 or more chunks per rank"
    return f"{said}: one model chunk per rank, no interleaving (a no-op; fix: {fix}, or null)"
