"""The training loop, run in every rank.

Build sequence (top to bottom, as in :func:`run`): distributed init → CPU backend
(device=cpu) → megatron parallel state + seeds → tokenizer → GPT chunks, DDP,
optimizer, LR schedule → resume (manifest check, then load) or ``init_from`` →
dataset + iterators → loop → final save.

Per iteration: megatron's ``get_forward_backward_func()`` (no pipelining, 1F1B or
interleaved 1F1B, chosen by megatron from the parallel state) → ``optimizer.step()``
→ ``scheduler.step(1)``. The lm loss logged is the mean over the global batch
(micro-batch means averaged, then averaged over DP), in nats per token.
"""

from __future__ import annotations

import json
import os
import resource
import socket
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Dict, List, Optional

import torch

from orchestrator.spec.schema import JobConfig
from orchestrator.errors import OrchestratorError
from orchestrator.ckpt.rundir import METRICS_FILE
from orchestrator.spec.checks import validate
from orchestrator.runtime import checkpoint as ckpt
from orchestrator.runtime import cpu as cpu_backend
from orchestrator.runtime.data import (MicroBatchIterator, PreparedData, build_tokenizer,
                                       build_train_dataset, samples_needed, tokenizer_identity)
from orchestrator.runtime.distributed import init_distributed, shutdown
from orchestrator.runtime.model import (build_model_and_optimizer, count_parameters, initialize_parallel_state,
                                        unwrap)



def _max_rss_mb() -> float:
    """Peak resident set size of this process, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _max_gpu_mb(device: str) -> Optional[float]:
    """Peak CUDA memory allocated by torch on this rank's GPU, MiB (None on CPU)."""
    return torch.cuda.max_memory_allocated() / 2 ** 20 if device == "cuda" else None


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean per-token cross entropy of one micro-batch (nats). Shapes: [b, s] both."""
    losses = output_tensor.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask) / mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    """One micro-batch through one model chunk. Only chunks that embed or compute loss read data."""
    inner = unwrap(model)
    needs_data = getattr(inner, "pre_process", True) or getattr(inner, "post_process", True)
    batch = next(data_iterator) if needs_data else None
    tokens = batch["tokens"] if batch is not None else None
    position_ids = batch["position_ids"] if batch is not None else None
    labels = batch["labels"] if batch is not None else None
    output = model(tokens, position_ids, None, labels=labels)
    loss_mask = batch["loss_mask"] if batch is not None else None
    return output, partial(_loss_func, loss_mask)


class MetricsWriter:
    """Appends one JSON object per line to ``<run.dir>/metrics.jsonl`` (only on the logging rank)."""

    def __init__(self, path: Path, enabled: bool):
        self.enabled = enabled
        self.path = path
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: Dict[str, object]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def _versions() -> Dict[str, str]:
    from importlib.metadata import version

    import orchestrator

    return {"orchestrator": orchestrator.__version__, "megatron-core": version("megatron-core"),
            "torch": torch.__version__, "python": sys.version.split()[0]}


def _stop_request(cfg: JobConfig):
    """The preemption/timeout contract (``orchestrator.runtime.preempt``), when available."""
    from orchestrator.runtime.preempt import StopRequest

    stop = StopRequest(max_requeues=cfg.cluster.max_num_timeout, run_dir=cfg.run.dir)
    stop.install()
    return stop


def run(cfg: JobConfig, prepared: PreparedData) -> Dict[str, object]:
    """Train one rank to ``training.train_iters``; returns this rank's summary dict."""
    # First thing: replace submitit's USR2 handler. A signal that lands during the start-up (the
    # megatron import, model build and checkpoint load take tens of seconds, minutes at scale)
    # would otherwise reach submitit's handler, which fails a non-checkpointable job ("timed-out
    # and not checkpointable") instead of requeueing it. Ours only sets a flag: the first
    # iteration boundary then saves and requeues.
    stop = _stop_request(cfg)
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from orchestrator.ckpt import manifest as mf
    from orchestrator.ckpt import resume

    info = init_distributed(cfg)
    if info.device == "cpu":
        cpu_backend.activate()
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    layout = validate(cfg)
    if info.world_size != layout.world_size:
        raise RuntimeError(f"job has {info.world_size} ranks but the layout needs {layout.world_size}")
    t, s = cfg.training, cfg.model.seq_length
    tensor_device = "cuda" if info.device == "cuda" else "cpu"  # nccl reduces CUDA tensors only
    initialize_parallel_state(cfg, t.seed, info.device)

    tokenizer = build_tokenizer(cfg.data)
    built = build_model_and_optimizer(cfg, tokenizer.vocab_size, info.device)
    model, optimizer, scheduler = built.model, built.optimizer, built.scheduler
    tf = built.tf_config
    tf.no_sync_func = [chunk.no_sync for chunk in model] if len(model) > 1 else model[0].no_sync
    tf.finalize_model_grads_func = finalize_model_grads
    tf.grad_scale_func = optimizer.scale_loss

    is_logger = (ps.is_pipeline_last_stage() and ps.get_data_parallel_rank() == 0
                 and ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0)
    metrics = MetricsWriter(Path(cfg.run.dir) / METRICS_FILE, is_logger)
    rank0 = info.rank == 0

    # ---- resume / init ------------------------------------------------------------------------
    iteration, consumed = 0, 0
    data_identity = prepared.identity(cfg.data)
    tok_identity = tokenizer_identity(cfg.data)
    origin: Optional[Dict[str, object]] = None
    # Same check as the launcher's, again: the config or the directory may have changed since
    # submission. Rank 0 verifies (hashing every checkpoint file once, not once per rank) and
    # tells the others which checkpoint to load, or the error that stops them all.
    verdict: List[object] = [None]
    if rank0:
        try:
            verdict[0] = ("ok", resume.preflight(
                cfg, layout, data_fingerprint=prepared.fingerprint, tokenizer=tok_identity,
                warn=lambda msg: print(f"[orchestrator] warning: {msg}", flush=True)))
        except OrchestratorError as exc:
            verdict[0] = ("error", exc)
    torch.distributed.broadcast_object_list(verdict, src=0)
    outcome, latest = verdict[0]  # type: ignore[misc]
    if outcome == "error":
        raise latest  # type: ignore[misc]
    if latest is not None:
        progress = ckpt.load(Path(latest.path), model, optimizer, scheduler)
        iteration, consumed = progress["iteration"], progress["consumed_samples"]
        origin = resume.origin_of(latest)
        if rank0:
            print(f"[orchestrator] resumed from {latest.path} at iteration {iteration}", flush=True)
    elif cfg.checkpoint.init_from:
        ckpt.load(Path(cfg.checkpoint.init_from), model)
        origin = {"init_from": cfg.checkpoint.init_from}
        if rank0:
            print(f"[orchestrator] model weights initialised from {cfg.checkpoint.init_from}", flush=True)

    def write_manifest(path: Path, it: int, cons: int) -> None:
        manifest = mf.build_manifest(
            cfg, layout, iteration=it, consumed_samples=cons, checkpoint_dir=str(path),
            vocab_size=tokenizer.vocab_size, padded_vocab_size=built.padded_vocab_size,
            tokenizer=tok_identity, data=data_identity, versions=_versions(), origin=origin,
        )
        mf.write_manifest(str(path), manifest)

    def save(it: int, cons: int) -> Path:
        return ckpt.save(cfg, model, optimizer, scheduler, iteration=it, consumed_samples=cons,
                         manifest_fn=lambda p: write_manifest(p, it, cons))

    # ---- data ---------------------------------------------------------------------------------
    dataset = build_train_dataset(cfg, prepared, tokenizer, samples_needed(cfg))
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    iterators = [MicroBatchIterator(dataset, consumed, t.micro_batch_size, dp_rank, dp_size, info.device)
                 for _ in model]
    data_iterator = iterators if len(iterators) > 1 else iterators[0]

    if rank0:
        print(f"[orchestrator] {layout.summary()}".replace("\n", "\n[orchestrator] "), flush=True)
        print(f"[orchestrator] device={info.device} backend={info.backend} "
              f"params on rank 0: {count_parameters(model):,}", flush=True)

    forward_backward = get_forward_backward_func()
    step_times: List[float] = []
    tokens_per_step = layout.tokens_per_step
    start_iteration = iteration
    last_loss = float("nan")
    status = "completed"
    while iteration < t.train_iters:
        t0 = time.perf_counter()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(
            forward_step_func=_forward_step, data_iterator=data_iterator, model=model,
            num_microbatches=layout.num_microbatches, seq_length=s, micro_batch_size=t.micro_batch_size,
            forward_only=False,
        )
        update_ok, grad_norm, _ = optimizer.step()
        scheduler.step(increment=1)
        iteration += 1
        consumed += t.global_batch_size
        # lm loss: mean over micro-batches on the last stage, then over DP.
        loss_tensor = torch.zeros(1, dtype=torch.float64, device=tensor_device)
        if ps.is_pipeline_last_stage(ignore_virtual=True) and losses:
            loss_tensor[0] = sum(float(x["lm loss"]) for x in losses) / len(losses)  # nats/token
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            torch.distributed.all_reduce(loss_tensor, group=ps.get_data_parallel_group())
            loss_tensor /= dp_size
        step_time = time.perf_counter() - t0
        if iteration - start_iteration > t.timing_warmup_iters:
            step_times.append(step_time)
        last_loss = float(loss_tensor[0])
        if iteration % t.log_interval == 0 or iteration == t.train_iters:
            lr = optimizer.param_groups[0]["lr"]
            record = {
                "iteration": iteration, "consumed_samples": consumed, "lm_loss": last_loss, "lr": lr,
                "grad_norm": float(grad_norm) if grad_norm is not None else None,
                "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
                "skipped": not update_ok, "max_rss_mb": _max_rss_mb(),
                "max_gpu_mem_mb": _max_gpu_mb(info.device), "time": time.time(),
            }
            metrics.write(record)
            if is_logger:
                print(f"iteration {iteration:6d}/{t.train_iters} | consumed samples {consumed:8d} | "
                      f"lm loss {last_loss:.6f} | lr {lr:.3e} | grad norm {record['grad_norm']:.3f} | "
                      f"step time {step_time * 1000:.1f} ms | tokens/s {record['tokens_per_s']:.0f}", flush=True)
        save_now = cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0
        if save_now and iteration < t.train_iters:
            save(iteration, consumed)
        # Not after the last iteration: a signal then must not requeue a finished run (the
        # restarted job would only find nothing left to train); the final save follows anyway.
        if stop is not None and iteration < t.train_iters and stop.requested():
            if not save_now:
                save(iteration, consumed)
            status = "stopped"
            metrics.write({"event": "stopped", "iteration": iteration, "time": time.time()})
            stop.requeue_or_exit("signal")
            break
        if t.exit_after_iters and iteration - start_iteration >= t.exit_after_iters and iteration < t.train_iters:
            if not save_now:
                save(iteration, consumed)
            status = "exited"
            break
    already_saved = latest is not None and iteration == start_iteration  # resumed a finished run
    if status == "completed" and cfg.checkpoint.save_at_end and not already_saved:
        save(iteration, consumed)

    # ---- summary ------------------------------------------------------------------------------
    peaks = torch.tensor([_max_rss_mb(), _max_gpu_mb(info.device) or 0.0], dtype=torch.float64, device=tensor_device)
    gathered = [torch.zeros(2, dtype=torch.float64, device=tensor_device) for _ in range(info.world_size)]
    torch.distributed.all_gather(gathered, peaks)
    summary = {
        "event": "summary", "status": status, "iteration": iteration, "lm_loss": last_loss,
        "step_time_median_s": statistics.median(step_times) if step_times else None,
        "timed_iterations": len(step_times),
        "tokens_per_step": tokens_per_step,
        "peak_rss_mb_per_rank": [float(g[0]) for g in gathered],
        "peak_gpu_mem_mb_per_rank": [float(g[1]) for g in gathered] if info.device == "cuda" else None,
        "host": socket.gethostname(), "device": info.device, "time": time.time(),
        "rank": info.rank, "logging_rank": is_logger,
    }
    metrics.write(summary)
    shutdown()
    stop.training_done()  # a late time-limit USR2 must not kill the process during its teardown
    return summary
