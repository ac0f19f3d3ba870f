"""The learning-rate schedule a config asks for, as megatron's ``OptimizerParamScheduler`` runs it.

Pure Python (no torch): the runtime builds the scheduler from :func:`lr_schedule`, the resume
preflight describes it (:meth:`LRSchedule.describe`), and both agree on one rule:

* on resume the **config wins**: the schedule is the one the current config describes, evaluated
  from the checkpoint's step count on (megatron's ``override_opt_param_scheduler=True``), not the
  checkpoint's saved schedule. ``training.train_iters=80 optimizer.lr=5e-4`` after 40 iterations
  trains iterations 41..80 on the cosine from 5e-4 over 80 iterations, at the point 40 steps in.

With ``training.rampup_batch_size`` the schedule counts samples, as Megatron-LM's always does (its
``get_optimizer_param_scheduler`` for iteration-based runs: warm-up ``lr_warmup_iters x GBS`` and decay
``lr_decay_iters x GBS`` samples, stepped by each iteration's ``get_current_global_batch_size()``), so the
ramp's small batches move the LR less; without a ramp it counts iterations, the same curve.
"""

from __future__ import annotations

from dataclasses import dataclass

from orchestrator.config.schema import JobConfig


@dataclass(frozen=True)
class LRSchedule:
    """Megatron's schedule parameters (``OptimizerParamScheduler`` argument names)."""

    init_lr: float
    max_lr: float
    min_lr: float
    lr_warmup_steps: int
    lr_decay_steps: int
    lr_decay_style: str
    unit: str = "its"
    """What a step is: ``its`` (iterations) or ``samples`` (with a batch ramp)."""

    def describe(self, from_iteration: int) -> str:
        """One line: ``lr schedule: cosine over 80 its, max 0.0005, min 0.0001, from iteration 41``."""
        u = self.unit
        warmup = f", warmup {self.lr_warmup_steps} {u}" if self.lr_warmup_steps else ""
        shape = (
            "constant" if self.lr_decay_style == "constant" else f"{self.lr_decay_style} over {self.lr_decay_steps} {u}"
        )
        return (
            f"lr schedule: {shape}{warmup}, max {self.max_lr:g}, min {self.min_lr:g}, from iteration {from_iteration}"
        )


def lr_schedule(cfg: JobConfig) -> LRSchedule:
    """The schedule of ``cfg``: decay over ``optimizer.lr_decay_iters`` (null = ``training.train_iters``),
    at least one step past the warm-up (megatron asserts warmup < decay steps); warm-up from 0. With a batch
    ramp both lengths are in samples (x ``training.global_batch_size``, Megatron-LM's rule)."""
    o, t = cfg.optimizer, cfg.training
    decay_iters = max(o.lr_decay_iters or t.train_iters, o.lr_warmup_iters + 1)
    per = t.global_batch_size if t.rampup_batch_size is not None else 1
    return LRSchedule(
        init_lr=0.0 if o.lr_warmup_iters > 0 else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=o.lr_warmup_iters * per,
        lr_decay_steps=decay_iters * per,
        lr_decay_style=o.lr_decay_style,
        unit="samples" if t.rampup_batch_size is not None else "its",
    )
