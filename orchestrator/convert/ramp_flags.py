"""Megatron-LM's ``--rampup-batch-size`` both ways, and the sample-based lengths it needs on export. Pure Python.

Import: ``--rampup-batch-size START INCREMENT SAMPLES`` -> ``training.rampup_batch_size`` (:func:`rampup`; the
``--train-samples`` it comes with in Megatron-LM -> the iterations that consume them on the ramp, in
:func:`orchestrator.convert.rules.batches_and_schedule`). Export: the flag back, and because Megatron-LM allows a
ramp only with sample-based training (``validate_args``: "expected no batch-size rampup for iteration-based
training"), ``--train-samples`` / ``--lr-decay-samples`` / ``--lr-warmup-samples`` in place of the ``--*-iters``
flags: the samples our iteration-based run consumes, and the LR lengths ``iters x GBS`` our schedule runs in.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from orchestrator.convert.conversion import Conversion, fail
from orchestrator.convert.sources import Arg


def rampup(conv: Conversion, given: Dict[str, Arg]) -> Optional[List[int]]:
    """``--rampup-batch-size START INCREMENT SAMPLES`` -> ``training.rampup_batch_size`` (None when not given).

    Megatron-LM refuses it with ``--train-iters`` (its ramp needs ``--train-samples``); here training stays
    iteration-based, so the pair converts, and the conversion says so among its assumptions."""
    arg = given.get("--rampup-batch-size")
    if arg is None:
        return None
    if len(arg.values) != 3 or not all(v.isdigit() for v in arg.values):
        raise fail(
            arg.flag,
            f"expects three integers <start> <increment> <samples>, got {' '.join(arg.values) or 'none'}",
            f"write `{arg.flag} START INCREMENT SAMPLES`",
        )
    ramp = [int(v) for v in arg.values]
    conv.set("training.rampup_batch_size", ramp, arg.text)
    if "--train-iters" in given:
        conv.assumed.append(
            f"{arg.text} with --train-iters: Megatron-LM refuses the pair (its ramp needs --train-samples); here "
            "training stays iteration-based, each of training.train_iters iterations on the ramp's batch"
        )
    return ramp


def export_rampup(cfg) -> List[List[str]]:
    """``training.rampup_batch_size`` as ``--rampup-batch-size START INCREMENT SAMPLES`` (nothing when null)."""
    ramp = cfg.training.rampup_batch_size
    return [] if ramp is None else [["--rampup-batch-size", *map(str, ramp)]]


def in_samples(flag: str, samples_flag: str, key: str) -> Callable[[Any], List[List[str]]]:
    """``--train-iters`` / ``--lr-decay-iters`` / ``--lr-warmup-iters``, or with a ramp their ``--*-samples``
    (Megatron-LM allows a ramp only with sample-based training): the samples our iteration-based run consumes
    (:func:`orchestrator.config.ramp.samples_after`), and the LR schedule's lengths in samples (iters x GBS)."""

    def exporter(cfg) -> List[List[str]]:
        from orchestrator.config.ramp import samples_after

        t = cfg.training
        iters = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
        if key == "optimizer.lr_decay_iters" and t.rampup_batch_size is not None:
            iters = iters or t.train_iters  # Megatron-LM's null decays over --train-samples, not train_iters x GBS
        if t.rampup_batch_size is None:
            default = 0 if key == "optimizer.lr_warmup_iters" else None
            return [] if iters is None or iters == default else [[flag, str(iters)]]
        if key == "training.train_iters":
            return [[samples_flag, str(samples_after(t.rampup_batch_size, t.global_batch_size, iters))]]
        return [[samples_flag, str(iters * t.global_batch_size)]] if iters else []

    return exporter


def newer_megatron_comment(cfg) -> str:
    """The export's note for Megatron-LM on megatron-core 0.19 and later, which accepts ``--rampup-batch-size`` but
    ignores it (deprecated for ``--step-batch-size-schedule``, which replaces ``--global-batch-size``; Megatron-LM
    d98e8a6 ``training_config.py``): the same ramp as that schedule (:func:`orchestrator.config.ramp.step_schedule`),
    its thresholds in tokens (samples x ``model.seq_length``): Megatron-LM's ``set_global_variables`` passes
    ``seq_length`` to megatron-core's calculator, which then reads thresholds as tokens (``threshold //
    seq_length`` samples; golden ``tests/golden/megatron/gpt_125m_rampup_dp8.json``)."""
    from orchestrator.config.ramp import step_schedule

    t, seq = cfg.training, cfg.model.seq_length
    steps = (e.split(":") for e in step_schedule(t.rampup_batch_size, t.global_batch_size).split())
    schedule = " ".join(f"{int(samples) * seq}:{batch}" for samples, batch in steps)
    return (
        "# --rampup-batch-size: Megatron-LM up to megatron-core 0.16; from 0.19 on it is ignored there: replace it and "
        f"--global-batch-size with --step-batch-size-schedule '{schedule}' (the same ramp; thresholds in tokens, "
        f"samples x --seq-length {seq})."
    )
