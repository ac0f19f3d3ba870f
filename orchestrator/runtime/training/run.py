"""One rank's job, top to bottom: build → resume → data → loop → final save → summary.

stop    = StopRequest(...).install()      first: a USR2 during start-up must not reach submitit
guard   = Guard(cfg, ...)                  runtime.guard: NaN/inf stop or skip, hang watchdog (from here on), save faults
rank    = build_rank(cfg)                  runtime.build: process group, parallel state, model, optimizer
links   = check_links(rank)                runtime.faults.links: cross-node bandwidth (multi-node jobs)
start   = restore(rank, prepared)          runtime.resume: in-job resume check, load (config's lr schedule)
data    = build_data(rank, prepared, ...)  runtime.build: GPTDatasets (train, validation), iterators
outcome = loop.train(...)                  runtime.loop: the iterations, evaluation, saves, stop
summary = summarize(rank, outcome, ...)    runtime.summary: the record every rank returns
"""

from __future__ import annotations

import os
import time
from typing import Dict

from orchestrator.config.layout import ParallelLayout
from orchestrator.config.ramp import samples_after
from orchestrator.config.schema import JobConfig
from orchestrator.config.slowness import LINKS_ONLY


def _stop_request(cfg: JobConfig):
    """The preemption/timeout contract (``orchestrator.runtime.faults.preempt``), installed."""
    from orchestrator.runtime.faults.preempt import StopRequest

    stop = StopRequest(max_requeues=cfg.cluster.max_num_timeout, run_dir=cfg.run.dir)
    stop.install()
    return stop


def write_megatron_config(run_dir: str, mc) -> None:
    """``<run.dir>/megatron_config.json``: the three configs megatron-core received (keys ``transformer``,
    ``ddp``, ``optimizer``; megatron-core's field names), what ``python -m orchestrator megatron-config``
    predicts for the job; the manifest of every checkpoint records it and its sha256."""
    import json
    import os

    from orchestrator.io import write_atomic

    write_atomic(
        os.path.join(run_dir, "megatron_config.json"),
        json.dumps(mc.as_json(), indent=1, sort_keys=True) + "\n",
        fsync=False,
    )


def run(cfg: JobConfig, prepared, layout: ParallelLayout, *, keep_process_group: bool = False) -> Dict[str, object]:
    """Train one rank to ``training.train_iters``; returns this rank's summary dict.

    ``layout``: the launcher's validated layout, carried with the job (a rank never derives it again).

    ``keep_process_group``: a warm rank (:mod:`orchestrator.runtime.start.pool`) keeps the default process
    group for its next trial and tears down only megatron's parallel state; a job's own ranks
    destroy both.

    Raises OrchestratorError subclasses for refusals found in the job (resume mismatch, data);
    a stop request ends in ``Requeued``/``Stopped`` (SystemExit) after a checkpoint.
    """
    # First thing: replace submitit's USR2 handler. A signal that lands during the start-up (the
    # megatron import, model build and checkpoint load take tens of seconds, minutes at scale)
    # would otherwise reach submitit's handler, which fails a non-checkpointable job ("timed-out
    # and not checkpointable") instead of requeueing it. Ours only sets a flag: the first
    # iteration boundary then saves and requeues.
    stop = _stop_request(cfg)
    if cfg.cluster.link_check.action == LINKS_ONLY:  # python -m orchestrator check links
        from orchestrator.runtime.faults.links import links_only

        return links_only(cfg, layout)
    from orchestrator.runtime.faults.diskspace import explain_write_failure
    from orchestrator.runtime.faults.guard import Guard, startup_fault
    from orchestrator.runtime.faults.links import check_links
    from orchestrator.runtime.rank import startup
    from orchestrator.runtime.rank.build import build_data, build_rank
    from orchestrator.runtime.rank.distributed import shutdown, teardown_parallel_state
    from orchestrator.runtime.rank.rendezvous import rendezvous_from_env
    from orchestrator.runtime.training import loop
    from orchestrator.runtime.training.metrics import Trackers
    from orchestrator.runtime.training.resume import Saver, restore
    from orchestrator.runtime.training.summary import summarize

    # The hang watchdog first: a rank that stops during the start-up (model build, link check, the first
    # collective, where its peers would wait for training.distributed_timeout_minutes) is named too
    guard = Guard(cfg, cfg.run.dir, rendezvous_from_env(os.environ).rank, world_size=layout.world_size)
    try:
        startup_fault(guard.rank)
        rank = build_rank(cfg, layout)
        rank.link_check = check_links(rank)  # multi-node: slow links named (or refused) before anything is loaded
        with guard.phase("load"):  # the hang watchdog names a rank that stops here too
            start = restore(rank, prepared)
            data = build_data(rank, prepared, start.consumed_samples)
    except BaseException:
        guard.abandon()  # a refusal or failure before training: recorded where it is reported
        raise
    guard.begin(start.iteration)
    trackers = Trackers(cfg, rank.is_logger)
    saver = Saver(rank, prepared, start.origin, guard, trackers)
    _announce(rank, start, trackers)
    startup.resume_collector()  # off since the job started (TrainJob): start-up's objects frozen
    try:
        outcome = loop.train(rank, data, start, saver, trackers, stop, guard)
        resumed_finished = start.resumed_from is not None and outcome.iteration == start.iteration
        if outcome.status == "completed" and cfg.checkpoint.save_at_end and not resumed_finished:
            saver(outcome.iteration, outcome.consumed_samples)
        saver.finish()  # a pending asynchronous write completes (manifest, retention) before the job ends
        summary = summarize(rank, outcome, start.resumed_from)
        summary["goodput"] = trackers.goodput(cfg.run.dir, outcome.iteration, outcome.consumed_samples)
        trackers.event(summary)
    except OSError as exc:  # a write outside a save (metrics, history) ran out of space: say so, the guard records it
        full = explain_write_failure(exc, cfg.run.dir)
        if full is None:
            raise
        raise full from exc
    finally:
        data.close()  # the DataLoader workers end with training, whatever ended it (a stop's SystemExit too)
        trackers.close()
        guard.close()  # records how this attempt ended (from the exception in flight, if any)
    if keep_process_group:
        rank.say("training done; megatron's parallel state torn down (the warm ranks stay up)")
        teardown_parallel_state()
    else:
        rank.say("training done; shutting down the process group")
        shutdown()
    stop.training_done()  # a late time-limit USR2 must not kill the process during its teardown
    return summary


def _announce(rank, start, trackers) -> None:
    """Say what this job trains (the layout on rank 0, megatron_config.json) and record its ``start`` event (with
    the checkpoint load's seconds) and a multi-node job's measured links."""
    from orchestrator.runtime.rank.model import count_parameters

    cfg = rank.cfg
    if rank.rank0:  # for the job's own log (the launcher printed it before submission)
        print("\n".join(f"  {line}" for line in rank.layout.summary().splitlines()), flush=True)
        write_megatron_config(cfg.run.dir, rank.built.megatron)
    rank.say(
        f"params on rank 0: {count_parameters(rank.built.model):,}; training iterations "
        f"{start.iteration + 1}..{cfg.training.train_iters}"
    )
    t = cfg.training
    trackers.event(
        {
            "event": "start",
            "iteration": start.iteration,
            "train_iters": cfg.training.train_iters,
            # what the ETA counts down: train_iters x GBS, or fewer on a batch ramp (config.ramp.samples_after)
            "train_samples": samples_after(t.rampup_batch_size, t.global_batch_size, t.train_iters),
            "resumed_from": start.resumed_from,
            "load_s": start.load_s,
            "time": time.time(),
        }
    )
    if rank.link_check is not None:
        trackers.event(rank.link_check)
