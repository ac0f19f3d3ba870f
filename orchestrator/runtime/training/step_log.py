"""The logging rank's account of each iteration: step times since the last record, tokens/s, FLOPs and memory
(metrics.jsonl, TensorBoard, the printed line), the step breakdown at its interval and evaluation records."""

from __future__ import annotations

import time
from typing import Dict, List, Optional

from orchestrator.plan.step_breakdown import describe as describe_breakdown
from orchestrator.runtime.rank.build import Rank
from orchestrator.runtime.training.metrics import Trackers, perplexity
from orchestrator.runtime.training.summary import max_gpu_mb, max_rss_mb, model_flops_per_step


class StepLog:
    """The logging rank's records: step times since the last record, flops, memory.

    A step time spans the whole iteration (zero grads, forward/backward schedule, optimizer step,
    scheduler, stop poll, loss reduction, guard check) but not what follows it only on some
    iterations (writing the record, evaluation, a save), as Megatron-LM's interval timer does.
    """

    def __init__(self, rank: Rank, trackers: Trackers, start: int, clock=None):
        self.rank, self.trackers, self.start, self.clock = rank, trackers, start, clock
        self.window: List[float] = []
        self.window_samples: List[int] = []  # each iteration's global batch (a batch ramp changes it)
        self.microbatches = 0  # the latest iteration's num_microbatches
        self.timed: List[float] = []
        self.cpu: List[float] = []
        self.flops = model_flops_per_step(rank) if trackers.enabled else None

    def tick(self, step_time: float, cpu_time: float, iteration: int, batch) -> None:
        """One iteration's wall and CPU time (s) and its batch (runtime.training.batch_ramp.Batch)."""
        self.window.append(step_time)
        self.window_samples.append(batch.samples)
        self.microbatches = batch.num_microbatches
        timed = iteration - self.start > self.rank.cfg.training.timing_warmup_iters
        if timed:
            self.timed.append(step_time)
            self.cpu.append(cpu_time)
        if self.clock is not None:
            self.clock.end_step(step_time, timed)

    def breakdown(self, iteration: int, result: Optional[Dict[str, object]]) -> None:
        """A closed breakdown window (runtime.training.breakdown's ``result``, on the logging rank): said and
        recorded."""
        if result is not None and self.trackers.enabled:
            self.trackers.event({"event": "breakdown", "iteration": iteration, **result, "time": time.time()})
            print(describe_breakdown(result, f"iterations {result['iterations'][0]}-{iteration}"), flush=True)

    def record(self, iteration: int, consumed: int, loss: float, lr: float, grad_norm, update_ok: bool) -> None:
        step = sum(self.window) / max(1, len(self.window))  # mean over the iterations since the last record
        # tokens/s over the same iterations, each with its own batch (a ramp's smaller ones included)
        tokens_per_s = sum(self.window_samples) * self.rank.cfg.model.seq_length / max(sum(self.window), 1e-12)
        gbs = self.rank.cfg.training.global_batch_size
        batch = self.window_samples[-1] if self.window_samples else gbs
        share = sum(self.window_samples) / (max(1, len(self.window_samples)) * gbs)  # of a full batch's FLOPs
        self.window, self.window_samples = [], []
        if not self.trackers.enabled:
            return
        r = self.rank
        rec: Dict[str, object] = {
            "iteration": iteration,
            "consumed_samples": consumed,
            "lm_loss": loss,
            "lr": lr,
            "grad_norm": None if grad_norm is None else float(grad_norm),
            "step_time_s": step,
            "tokens_per_s": tokens_per_s,
            "batch_size": batch,
            "num_microbatches": self.microbatches,
            "throughput_tflops": self.flops * share / (step * r.layout.world_size * 1e12) if self.flops else None,
            "skipped": not update_ok,
            "max_rss_mb": max_rss_mb(),
            "max_gpu_mem_mb": max_gpu_mb(r.device),
            "time": time.time(),
        }
        self.trackers.train(rec)
        gn = "n/a" if grad_norm is None else f"{float(grad_norm):.3f}"
        print(
            f"iteration {iteration:6d}/{r.cfg.training.train_iters} | consumed samples {consumed:8d} | "
            f"lm loss {loss:.6f} | lr {lr:.3e} | grad norm {gn} | step time {step * 1000:.1f} ms | "
            f"tokens/s {rec['tokens_per_s']:.0f}",
            flush=True,
        )

    def whole_run(self) -> Optional[Dict[str, object]]:
        """The breakdown over the timed iterations, said on the logging rank (collective); None when off."""
        whole = self.clock.gather() if self.clock is not None else None
        if whole is not None and whole["stages"]:
            print(describe_breakdown(whole, f"over {len(self.timed)} timed iterations"), flush=True)
        return whole

    def eval(self, iteration: int, consumed: int, loss: Optional[float]) -> None:
        if self.trackers.enabled and loss is not None:
            t = self.rank.cfg.training
            self.trackers.eval(
                {
                    "event": "eval",
                    "iteration": iteration,
                    "consumed_samples": consumed,
                    "lm_loss": loss,
                    "ppl": perplexity(loss),
                    "eval_iters": t.eval_iters,
                    "time": time.time(),
                }
            )
            print(f"validation at iteration {iteration} | lm loss {loss:.6f} | ppl {perplexity(loss):.3f}", flush=True)
