"""A rank's guard against bad numbers: a non-finite loss or gradient, a loss spike. Mixed into
:class:`~orchestrator.runtime.faults.guard.Guard`, which owns the attempt's lifecycle (heartbeat, watchdog, records)."""

from __future__ import annotations

import math
import sys
from typing import Any, List, Optional, Tuple

from orchestrator.ckpt import history
from orchestrator.config.spike import longer_warmup, proposed_lr
from orchestrator.errors import NonFiniteLossError
from orchestrator.runtime.faults.diskspace import latest_checkpoint
from orchestrator.runtime.faults.optimizer_step import local_grads_bad, step_unless_nonfinite


class NumericsGuard:
    """The numerics half of :class:`~orchestrator.runtime.faults.guard.Guard`: the optimizer step that never applies a
    non-finite update (``training.nan_policy``), the check before an iteration is saved (NaN, loss spike), and the
    attempt's end when one is found: which ranks saw it, recorded before the job stops."""

    def step(self, optimizer) -> Tuple[bool, Optional[float], Optional[int]]:
        """``optimizer.step()`` for a megatron optimizer, except that a non-finite gradient norm is
        never applied. Returns ``(update_ok, grad_norm, None)`` like megatron; ``grad_norm`` is the
        global norm (also with ``optimizer.clip_grad=0``), None after an fp16 loss-scale overflow."""
        self._optimizer = optimizer
        self._step_state, ok, grad_norm = step_unless_nonfinite(optimizer, self.cfg.optimizer.clip_grad)
        return ok, grad_norm, None

    def check(self, iteration: int, lm_loss: Optional[float], grad_norm: Optional[float]) -> bool:
        """Stop (raise) or skip on a non-finite gradient norm; call BEFORE any save of ``iteration``.

        ``lm_loss``: this rank's view of the loss (None off the last pipeline stage, or on iterations
        the loop does not reduce it); ``grad_norm``: the global norm. Returns True when the step's
        update was applied, False when it was skipped (``nan_policy=skip``, or an fp16 overflow).
        Raises :class:`NonFiniteLossError` on every rank alike.
        """
        state, self._step_state = self._step_state, None
        if grad_norm is None:
            if state == "overflow":
                return False
            bad, value, what = self._any_loss_bad(lm_loss), lm_loss, "lm loss"
        else:
            value, what = float(grad_norm), "gradient norm"
            bad = not math.isfinite(value)
        if not bad:
            self.skipped_in_row = 0
            return True
        if self.policy == "skip" and state == "skipped" and self.skipped_in_row < self.max_skipped:
            self.skipped_in_row += 1
            self.skipped_total += 1
            if self.rank == 0:
                say(
                    f"iteration {iteration}: non-finite {what} {value}: update skipped "
                    f"({self.skipped_in_row} in a row of at most training.max_skipped_steps={self.max_skipped})"
                )
                quietly(
                    lambda: history.record_event(
                        self.run_dir,
                        "nan_skipped",
                        job_id=self.job_id,
                        attempt=self.attempt,
                        iteration=iteration,
                        value=str(value),
                    )
                )
            return False
        self._stop_nan(iteration, what, value, lm_loss, state)
        return False  # not reached

    def _any_loss_bad(self, lm_loss: Optional[float]) -> bool:
        import torch
        import torch.distributed as dist

        local = lm_loss is not None and not math.isfinite(float(lm_loss))
        if not (dist.is_available() and dist.is_initialized()):
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _stop_nan(self, iteration: int, what: str, value: Any, lm_loss: Optional[float], state: Optional[str]) -> None:
        """End the attempt as ``nan`` and raise NonFiniteLossError, whatever the attribution raises."""
        head, loss_ranks, grad_ranks = f"non-finite {what} {value} at iteration {iteration}", [], []
        try:
            loss_ranks, grad_ranks = self._bad_ranks(lm_loss)
            parts = [head] + [
                f"{n} non-finite on rank(s) {rank_list(r)}"
                for n, r in (("lm loss", loss_ranks), ("gradients", grad_ranks))
                if r
            ]
            latest = latest_checkpoint(self.run_dir)
            keep = f"the latest checkpoint stays {latest}" if latest else "no checkpoint was saved before it"
        except Exception as exc:  # noqa: BLE001 - a NaN stays a NaN, never a retried crash (0.19's rename was one)
            parts, keep = [head, f"ranks not attributed ({type(exc).__name__}: {exc})"], "the latest checkpoint stays"
            latest = True
        rerun = "rerun to resume" if latest else "rerun (nothing was saved: it starts again from iteration 0)"
        tail = ""
        if self.policy == "skip":
            tail = (
                f" (training.nan_policy=skip: {self.skipped_in_row} step(s) skipped in a row already)"
                if state == "skipped"
                else " (training.nan_policy=skip needs the loop to step through Guard.step; this update was applied)"
            )
        o = self.cfg.optimizer  # clipping is tightened by a *smaller* clip_grad (0 turns it off)
        spike = self.cfg.training.spike
        lower, why = proposed_lr(o.lr, spike.suggest_lr, spike.suggest_lr_from)
        clip = (
            "turn gradient clipping on with optimizer.clip_grad=1.0"
            if not o.clip_grad
            else f"clip harder with optimizer.clip_grad below {o.clip_grad:g}"
        )
        message = (
            f"{'; '.join(parts)}: stopped before anything of iteration {iteration} was saved, {keep}{tail}; "
            f"fix: lower optimizer.lr={o.lr:g} -> optimizer.lr={lower:g}, {why} (or raise "
            f"optimizer.lr_warmup_iters={o.lr_warmup_iters} -> optimizer.lr_warmup_iters="
            f"{longer_warmup(o.lr_warmup_iters)}, or {clip}) and {rerun}"
        )
        if history.claim_attempt_end(self.run_dir, self.job_id, self.attempt):
            quietly(
                lambda: history.record_event(
                    self.run_dir,
                    "nan",
                    job_id=self.job_id,
                    attempt=self.attempt,
                    iteration=iteration,
                    value=str(value),
                    what=what,
                    loss_ranks=loss_ranks,
                    grad_ranks=grad_ranks,
                )
            )
            quietly(
                lambda: history.record_attempt_ended(
                    self.run_dir, self.job_id, self.attempt, "nan", iteration=iteration, message=message
                )
            )
        raise NonFiniteLossError(message)

    def _bad_ranks(self, lm_loss: Optional[float]) -> Tuple[List[int], List[int]]:
        """(ranks with a non-finite loss, ranks with non-finite local gradients): one all_gather."""
        import torch
        import torch.distributed as dist

        loss_bad = lm_loss is not None and not math.isfinite(float(lm_loss))
        grads_bad = local_grads_bad(self._optimizer)
        mine = torch.tensor([float(loss_bad), float(grads_bad)], device=collective_device())
        if not (dist.is_available() and dist.is_initialized()):
            gathered = [mine]
        else:
            gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, mine)
        return ([r for r, g in enumerate(gathered) if g[0] > 0], [r for r, g in enumerate(gathered) if g[1] > 0])


def say(message: str) -> None:
    print(f"[orchestrator] {message}", file=sys.stderr, flush=True)


def rank_list(ranks: List[int]) -> str:
    return ",".join(str(r) for r in ranks)


def quietly(write) -> bool:
    try:
        write()
        return True
    except Exception as exc:  # bookkeeping must never mask the real outcome (a full disk, say)
        say(f"could not record a job event: {exc!r}")
        return False


def collective_device():
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
