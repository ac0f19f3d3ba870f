"""Megatron-LM's derivation rules for the parallel layout, applied to a
:class:`~orchestrator.convert.to_config.Conversion`: VPP from layers per virtual stage (and the interleaved schedule's
rules), a stated DP against the world size. Pure Python."""

from __future__ import annotations

from typing import Dict

from orchestrator.convert.conversion import Conversion, fail, number
from orchestrator.convert.sources import Arg

VPP_KEY = "parallelism.virtual_pipeline_model_parallel_size"


def virtual_pipeline(conv: Conversion, given: Dict[str, Arg]) -> None:
    """VPP = num_layers / (PP x --num-layers-per-virtual-pipeline-stage), refused unless it divides."""
    arg = given.get("--num-layers-per-virtual-pipeline-stage")
    if arg is None:
        stages = given.get("--num-virtual-stages-per-pipeline-rank")
        layers, pp = conv.get("model.num_layers"), conv.get("parallelism.pipeline_model_parallel_size", 1)
        vpp = conv.get(VPP_KEY)
        if stages is not None and layers and vpp:
            per_chunk, rest = divmod(layers, pp * vpp)
            shown = f"num_layers / (PP x VPP) = {layers} / ({pp} x {vpp})"
            conv.derived.append(
                f"{VPP_KEY}: {stages.text} -> layers per virtual stage = {shown} = "
                + (
                    f"{per_chunk}"
                    if not rest
                    else f"{layers / (pp * vpp):g}: does not divide (the validation below refuses it)"
                )
            )
        return
    if "--num-virtual-stages-per-pipeline-rank" in given:
        raise fail(
            VPP_KEY,
            f"{arg.text} and {given['--num-virtual-stages-per-pipeline-rank'].text} both say VPP "
            "(Megatron-LM refuses both)",
            "keep one of them",
        )
    per_chunk = number(arg, "int")
    layers, pp = conv.get("model.num_layers"), conv.get("parallelism.pipeline_model_parallel_size", 1)
    if not layers:
        raise fail(VPP_KEY, f"{arg.text} needs --num-layers to derive VPP", "give --num-layers")
    per_stage, rest = divmod(layers, pp)
    if rest:
        raise fail(
            "model.num_layers",
            f"{layers} layers do not split over PP {pp} ({layers} % {pp} = {rest})",
            f"--pipeline-model-parallel-size one of {[d for d in range(1, layers + 1) if layers % d == 0]}",
        )
    vpp, rest = divmod(per_stage, per_chunk) if per_chunk > 0 else (0, 1)
    if rest:
        ok = [d for d in range(1, per_stage + 1) if per_stage % d == 0]
        raise fail(
            VPP_KEY,
            f"{arg.text} does not divide the {per_stage} layers of each pipeline stage "
            f"({layers} / {pp}); VPP would be {per_stage} / {per_chunk}",
            f"--num-layers-per-virtual-pipeline-stage one of {ok}",
        )
    text = f"VPP = num_layers / (PP x layers per virtual stage) = {layers} / ({pp} x {per_chunk}) = {vpp}"
    conv.set(VPP_KEY, vpp, f"{arg.text}: {text}")
    conv.derived.append(f"{VPP_KEY}: {arg.text} -> {text}")
    if vpp == 1:
        conv.flagged.append(
            f"{arg.text}: VPP = 1, one model chunk per rank: the plain 1F1B schedule, as without "
            "the flag (Megatron-LM interleaves only from 2 chunks per rank)"
        )


def sequence_parallel(conv: Conversion, given: Dict[str, Arg]) -> None:
    """``--sequence-parallel`` at TP 1: Megatron-LM's ``validate_args`` warns ("Disabling sequence parallelism
    because tensor model parallelism is disabled") and turns it off; so does the conversion, and says so."""
    arg = given.get("--sequence-parallel")
    if arg is None or conv.get("parallelism.tensor_model_parallel_size", 1) != 1:
        return
    conv.set("parallelism.sequence_parallel", False, f"{arg.text} at TP 1: off, as Megatron-LM turns it off")
    conv.flagged.append(
        f"{arg.text} with --tensor-model-parallel-size 1: Megatron-LM warns and turns sequence parallelism off "
        "(validate_args); the experiment has parallelism.sequence_parallel=false"
    )


def data_parallel(conv: Conversion) -> None:
    """A stated DP (not a Megatron-LM flag) checked against world / (TP x PP x CP), with the arithmetic."""
    dp, world = conv.get("parallelism.data_parallel_size"), conv.world_size
    if world is None:
        return
    tp, pp, cp = (conv.get(f"parallelism.{k}_parallel_size", 1) for k in ("tensor_model", "pipeline_model", "context"))
    mp = tp * pp * cp
    shown = f"({tp} × {pp}{f' × {cp}' if cp > 1 else ''})"
    per_node = conv.get("cluster.tasks_per_node") or conv.get("cluster.gpus_per_node")
    if world % mp and per_node and mp % per_node == 0:
        conv.flagged.append(
            f"world size {world} holds no TP × PP{' × CP' if cp > 1 else ''} = {shown} = {mp} grid "
            f"(Megatron-LM refuses it); fix: --nodes {mp // per_node} ({mp // per_node} × {per_node} "
            f"= {mp} GPUs, DP 1), or the script's node count set with --var"
        )
    if dp is None:
        return
    if world % mp:
        return  # the layout validation says what is wrong (data_parallel_size is not stated)
    derived = world // mp
    if derived != dp:
        conv.flagged.append(
            f"--data-parallel-size {dp}: on {world} GPUs DP = world size / (TP × PP"
            f"{' × CP' if cp > 1 else ''}) = {world} / {shown} = {derived}, not {dp}; fix: drop "
            f"--data-parallel-size (DP {derived}) or run on {mp} × {dp} = {mp * dp} GPUs"
        )
    else:
        conv.derived.append(f"--data-parallel-size {dp} agrees: DP = {world} / {shown} = {derived}")
