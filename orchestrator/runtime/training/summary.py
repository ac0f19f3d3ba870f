"""What a rank reports when its job ends: the ``summary`` record (and its memory/throughput helpers).

The summary is what submitit returns from every rank (the launcher prints the logging rank's) and
the last record the logging rank appends to metrics.jsonl::

    {"event": "summary", "status", "iteration", "lm_loss", "step_time_median_s",
     "step_cpu_time_median_s", "timed_iterations", "train_wall_s",
     "tokens_per_step", "peak_rss_mb_per_rank", "peak_gpu_mem_mb_per_rank", "hosts", "host",
     "device", "rank", "logging_rank", "resumed_from", "schedule_trace", "breakdown", "time"}

``hosts``: the host of every rank, by global rank (a hang or a failure names ranks; this names
their machines).
"""

from __future__ import annotations

import math
import resource
import socket
import statistics
import time
from typing import Dict, Optional

import torch


def max_rss_mb() -> float:
    """Peak resident set size of this process since it started or since :func:`reset_peak_memory`, MiB.

    Linux: ``VmHWM`` of ``/proc/self/status`` (the address space's high-water mark, which
    :func:`reset_peak_memory` can lower); elsewhere ``getrusage``'s ``ru_maxrss`` (KiB on Linux,
    never reset).
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def reset_peak_memory(device: str) -> None:
    """Start a new peak: what a warm rank does before each trial, so a trial's peak is its own.

    Frees what earlier trials left (garbage collection, glibc's ``malloc_trim`` returning free heap
    pages to the kernel), then resets the high-water mark (writing ``5`` to
    ``/proc/self/clear_refs``, Linux >= 4.0; see proc(5)) and torch's CUDA peak. Best effort: where a
    step is unavailable the peak keeps its older value, an over-estimate, never an under-estimate.
    """
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def max_gpu_mb(device: str) -> Optional[float]:
    """Peak CUDA memory allocated by torch on this rank's GPU, MiB (None on CPU)."""
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None


def model_flops_per_step(rank) -> Optional[float]:
    """Model FLOPs of one optimizer step (the planner's count, forward + backward, no recompute);
    None when the planner cannot count this config."""
    from orchestrator.errors import OrchestratorError
    from orchestrator.plan.memory import plan

    try:
        return float(plan(rank.cfg, vocab_size=rank.built.padded_vocab_size, layout=rank.layout).model_flops)
    except (OrchestratorError, ValueError, ZeroDivisionError):
        return None


def summarize(rank, outcome, resumed_from: Optional[str]) -> Dict[str, object]:
    """This rank's summary record (collective: gathers every rank's peak memory and host)."""
    world = rank.info.world_size
    peaks = torch.tensor([max_rss_mb(), max_gpu_mb(rank.device) or 0.0], dtype=torch.float64, device=rank.tensor_device)
    gathered = [torch.zeros(2, dtype=torch.float64, device=rank.tensor_device) for _ in range(world)]
    torch.distributed.all_gather(gathered, peaks)
    times = outcome.step_times
    return {
        "event": "summary",
        "status": outcome.status,
        "iteration": outcome.iteration,
        "lm_loss": outcome.lm_loss if math.isfinite(outcome.lm_loss) else None,  # None: no iteration ran
        "step_time_median_s": statistics.median(times) if times else None,
        "step_cpu_time_median_s": statistics.median(outcome.cpu_times) if outcome.cpu_times else None,
        "timed_iterations": len(times),
        "train_wall_s": outcome.train_wall_s,
        "tokens_per_step": rank.layout.tokens_per_step,
        "peak_rss_mb_per_rank": [float(g[0]) for g in gathered],
        "peak_gpu_mem_mb_per_rank": [float(g[1]) for g in gathered] if rank.device == "cuda" else None,
        "hosts": list(rank.info.hosts),
        "host": socket.gethostname(),
        "device": rank.device,
        "rank": rank.info.rank,
        "logging_rank": rank.is_logger,
        "resumed_from": resumed_from,
        "schedule_trace": outcome.schedule_trace,
        "breakdown": outcome.breakdown,
        "stragglers": outcome.stragglers,  # training.straggler's named ranks and hosts (runtime.faults.straggler)
        "time": time.time(),
    }
