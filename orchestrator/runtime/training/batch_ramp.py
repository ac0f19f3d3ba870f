"""Each iteration's global batch and micro-batch count, from megatron-core's own num-microbatches calculator.

Megatron-LM's ``train_step`` loop calls ``update_num_microbatches(consumed_samples)`` before every iteration and
reads ``get_num_microbatches()`` (for the schedule) and ``get_current_global_batch_size()`` (consumed samples, the
LR scheduler's increment); so does :class:`BatchRamp`. Without ``training.rampup_batch_size`` the calculator is
megatron-core's constant one (``GBS / (MBS x DP)`` micro-batches, the layout's ``num_microbatches``). With it:
megatron-core 0.16.1's ``RampupBatchsizeNumMicroBatchesCalculator`` (``rampup_batch_size=[start, increment,
samples]``); megatron-core 0.19, which ignores ``rampup_batch_size`` (deprecated) and has no ramp calculator, gets
the same ramp as its ``step_batch_size_schedule`` (:func:`orchestrator.config.ramp.step_schedule`, equal to
0.16.1's at every consumed-sample count). Every rank holds the calculator (megatron-core's module-level global).
"""

from __future__ import annotations

from typing import NamedTuple

from orchestrator.config.ramp import step_schedule


class Batch(NamedTuple):
    """One iteration's batch: what the schedule runs, what it consumes, what the LR scheduler advances by."""

    num_microbatches: int
    samples: int
    """The global batch (samples, all DP ranks together)."""
    scheduler_increment: int
    """``OptimizerParamScheduler.step(increment=...)``: the samples with a ramp (Megatron-LM's
    ``increment = get_current_global_batch_size()``), else 1 iteration."""


class BatchRamp:
    """megatron-core's num-microbatches calculator for one job (rebuilt when the process builds a job again)."""

    def __init__(self, cfg, data_parallel_size: int, rank: int):
        from megatron.core import num_microbatches_calculator as nmc

        t = cfg.training
        self.ramp = list(t.rampup_batch_size) if t.rampup_batch_size is not None else None
        options = dict(
            rank=rank,
            global_batch_size=t.global_batch_size,
            micro_batch_size=t.micro_batch_size,
            data_parallel_size=data_parallel_size,
            decrease_batch_size_if_needed=False,
        )
        if hasattr(nmc, "RampupBatchsizeNumMicroBatchesCalculator"):  # megatron-core 0.16.1: a required argument
            options["rampup_batch_size"] = self.ramp
        elif self.ramp is not None:  # 0.19: rampup_batch_size ignored (deprecated), the ramp as its step schedule
            options["step_batch_size_schedule"] = step_schedule(self.ramp, t.global_batch_size)
        nmc.destroy_num_microbatches_calculator()  # a process that builds a job again (in-place restart, a trial)
        nmc.init_num_microbatches_calculator(**options)
        self._nmc = nmc

    @property
    def in_samples(self) -> bool:
        """True when the LR schedule counts samples (with a ramp, as Megatron-LM's), False when iterations."""
        return self.ramp is not None

    def at(self, consumed_samples: int) -> Batch:
        """The :class:`Batch` of the iteration that starts after ``consumed_samples``.

        megatron-core's ``update_num_microbatches(consistency_check=True)`` asserts the batch is whole micro-batches
        on every DP rank (the pre-queue validation already refused a ramp where it is not)."""
        self._nmc.update_num_microbatches(consumed_samples=consumed_samples, consistency_check=True)
        samples = self._nmc.get_current_global_batch_size()
        return Batch(self._nmc.get_num_microbatches(), samples, samples if self.in_samples else 1)
