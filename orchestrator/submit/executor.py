"""Submission through submitit: ``cluster.kind=local`` (LocalExecutor) or ``slurm``.

:func:`launch` submits one job whose tasks are the ranks, then (``cluster.wait``)
watches it with :func:`orchestrator.submit.wait.wait`, streaming progress from
``<run.dir>/metrics.jsonl``.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict

from orchestrator.ckpt.rundir import METRICS_FILE, SUBMITIT_DIR
from orchestrator.config.layout import ParallelLayout
from orchestrator.config.schema import JobConfig, to_dict
from orchestrator.errors import SubmissionError
from orchestrator.meter import HEARTBEAT_S
from orchestrator.submit.progress import Progress, final_lines, ranks_up
from orchestrator.submit.wait import wait


def make_executor(cfg: JobConfig, world_size: int):
    """A configured submitit executor writing its files under ``<run.dir>/submitit``."""
    import submitit

    folder = Path(cfg.run.dir) / SUBMITIT_DIR
    c = cfg.cluster
    if c.kind == "local":
        executor = submitit.LocalExecutor(folder=str(folder), max_num_timeout=c.max_num_timeout, python=c.python)
        params: Dict[str, Any] = dict(
            nodes=1, tasks_per_node=world_size, timeout_min=c.timeout_min, signal_delay_s=c.signal_delay_s
        )
        if c.gpus_per_node:
            params["gpus_per_node"] = c.gpus_per_node
        executor.update_parameters(**params)
        return executor
    from orchestrator.submit.sbatch import python_command, slurm_executor_parameters

    # python_command quotes the interpreter path (submitit would put cluster.python in unquoted).
    executor = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=c.max_num_timeout, python=python_command(cfg))
    executor.update_parameters(**slurm_executor_parameters(cfg, world_size))
    return executor


def forks_ranks(cfg: JobConfig, world_size: int) -> bool:
    """Whether the job runs as one task that forks its other ranks (:mod:`orchestrator.runtime.start.forked`):
    local multi-rank jobs on CPU. A job that may use a GPU (``training.device=cuda``, ``cluster.gpus_per_node``,
    or ``auto`` on a machine with an NVIDIA driver) starts one process per rank instead: a device context
    must not exist before a fork, and megatron-core's imports may create one."""
    c = cfg.cluster
    if c.kind != "local" or world_size <= 1 or c.gpus_per_node:
        return False
    device = cfg.training.device
    return device == "cpu" or (device == "auto" and not os.path.exists("/dev/nvidiactl"))


def one_task(cfg: JobConfig, world_size: int) -> bool:
    """Whether the job runs as one process that imports megatron-core before any rank trains (a local
    job of one rank, or one that forks its ranks): that task then builds the sample indices, and the
    launcher, which would pay the torch and megatron-core import for them (~6 s), does not."""
    return (
        cfg.cluster.kind == "local"
        and not cfg.cluster.max_restarts
        and (world_size == 1 or forks_ranks(cfg, world_size))
    )


def agent_tasks(cfg: JobConfig) -> int:
    """How many tasks a job restarted in place (``cluster.max_restarts`` > 0) has: one torch elastic agent a node
    (:mod:`orchestrator.runtime.start.inplace`); 0 for a job of one task per rank."""
    c = cfg.cluster
    return (c.nodes + c.spare_nodes if c.kind == "slurm" else 1) if c.max_restarts else 0


def job_environment(cfg: JobConfig, world_size: int) -> Dict[str, str]:
    """Environment every rank gets: ``cluster.env`` plus CPU thread defaults for local CPU runs
    (``OMP_NUM_THREADS`` = cores // ranks unless ``cluster.env`` or the launcher's own environment sets
    it, as torchrun leaves a user's OMP_NUM_THREADS alone)."""
    env = {k: str(v) for k, v in cfg.cluster.env.items()}
    if cfg.cluster.kind == "local" and "OMP_NUM_THREADS" not in env and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
    if cfg.cluster.kind == "local":  # a free rendezvous port, reserved now (never the caller's MASTER_PORT)
        from orchestrator.runtime.rank.distributed import local_rendezvous_env

        env.update(local_rendezvous_env())
    return env


# ------------------------------------------------------------------ state of a submitted job
@contextlib.contextmanager
def children_ignore_sigint():
    """Spawn with SIGINT and SIGHUP ignored, which child processes inherit: a terminal's Ctrl-C (or its
    hang-up, sent to the whole foreground process group) then reaches only the launcher, which asks the
    ranks to save and stop (:mod:`orchestrator.submit.signals`); submitit's local controller would
    otherwise print its own KeyboardInterrupt traceback on our terminal, or die with the ranks unsaved."""
    import signal

    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def submit(cfg: JobConfig, layout: ParallelLayout, prepared) -> Any:
    """Submit the training job (one task per rank); returns the submitit job."""
    from orchestrator.runtime.faults.launcher import launcher_identity
    from orchestrator.runtime.start.job import TrainJob

    if agent_tasks(cfg):
        return _submit_agents(cfg, layout, prepared)
    forks = forks_ranks(cfg, layout.world_size)
    executor = make_executor(cfg, 1 if forks else layout.world_size)
    waited = cfg.cluster.kind == "local" and cfg.cluster.wait  # such a job ends with this launcher
    payload = TrainJob(
        to_dict(cfg),
        asdict(prepared),
        asdict(layout),
        env=job_environment(cfg, layout.world_size),
        fork_ranks=layout.world_size if forks else 0,
        build_indices=one_task(cfg, layout.world_size),
        launcher=launcher_identity() if waited else None,
    )
    from orchestrator.ckpt import stop

    stop.clear(cfg.run.dir)  # a stop asked of an earlier job of this run
    try:
        with children_ignore_sigint():
            job = executor.submit(payload)
    except Exception as exc:
        raise SubmissionError(f"submission to cluster.kind={cfg.cluster.kind} failed: {exc}") from None
    if forks:
        job = as_rank_tasks(job, layout.world_size)
    _record(cfg, job, layout.world_size)
    return job


def _submit_agents(cfg: JobConfig, layout: ParallelLayout, prepared) -> Any:
    """Submit one task a node, each running its node's torch elastic agent (``cluster.max_restarts`` > 0)."""
    from orchestrator.runtime.faults.launcher import launcher_identity
    from orchestrator.runtime.start.inplace import NodeAgent
    from orchestrator.runtime.start.job import TrainJob

    nodes = cfg.cluster.nodes if cfg.cluster.kind == "slurm" else 1
    per_node = layout.world_size // nodes
    executor = make_executor(cfg, 1 if cfg.cluster.kind == "local" else layout.world_size)  # (sbatch: one a node)
    waited = cfg.cluster.kind == "local" and cfg.cluster.wait
    env = job_environment(cfg, layout.world_size)
    train = TrainJob(
        to_dict(cfg), asdict(prepared), asdict(layout), env=env, launcher=launcher_identity() if waited else None
    )
    payload = NodeAgent(
        train,
        str(Path(cfg.run.dir).absolute()),
        per_node,
        nodes,
        cfg.cluster.max_restarts,
        cfg.cluster.spare_nodes if cfg.cluster.kind == "slurm" else 0,
    )
    from orchestrator.ckpt import stop

    stop.clear(cfg.run.dir)
    try:
        with children_ignore_sigint():
            job = executor.submit(payload)
    except Exception as exc:
        raise SubmissionError(f"submission to cluster.kind={cfg.cluster.kind} failed: {exc}") from None
    _record(cfg, job, agent_tasks(cfg))  # status counts the tasks' result files: one a node
    return job


def as_rank_tasks(job, world_size: int):
    """The local job of one task that forks ``world_size`` ranks, seen as ``world_size`` tasks: ``job.task(r)``
    names rank r's result and log files (the forked ranks write them), all watching the task's process."""
    from submitit.local.local import LocalJob

    ranks = LocalJob(job.paths.folder, job.job_id, tasks=range(world_size), process=job._process)
    ranks.forks_ranks = True  # read by submit.wait: no rank is missing before the task has forked them
    return ranks


def _record(cfg: JobConfig, job, world_size: int) -> None:
    """The submission record, with the job's claim on the run directory until its rank 0 takes the run lock
    (:func:`orchestrator.ckpt.lock.submission_claim`: a second launcher's probe refuses meanwhile)."""
    from orchestrator.ckpt.history import record_submission
    from orchestrator.ckpt.lock import submission_claim

    record_submission(
        cfg.run.dir,
        str(job.job_id),
        cfg.cluster,
        {"stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr)},
        num_tasks=world_size,
        claim=submission_claim(cfg.cluster.kind, str(job.job_id)),
    )


def launch(cfg: JobConfig, layout: ParallelLayout, prepared, *, show_progress: bool = True) -> Dict[str, Any]:
    """Submit and (with ``cluster.wait``) wait; returns the logging rank's summary (or ``{job_id}``)."""
    if cfg.cluster.kind in ("hosts", "torchrun"):  # torchrun's agents, over SSH or on this node
        from orchestrator.submit.hosts import launch_hosts
        from orchestrator.submit.platform import launch_node

        return (launch_hosts if cfg.cluster.kind == "hosts" else launch_node)(
            cfg, layout, prepared, show_progress=show_progress
        )
    job = submit(cfg, layout, prepared)
    try:
        print(
            f"[orchestrator] submitted job {job.job_id} ({cfg.cluster.kind}): starting {layout.world_size} ranks\n"
            f"[orchestrator]   run dir: {cfg.run.dir}\n"
            f"[orchestrator]   logs:    {Path(job.paths.stdout).parent}/",
            flush=True,
        )
        if not cfg.cluster.wait:
            return {"job_id": str(job.job_id), "status": "submitted"}
        progress = Progress(
            Path(cfg.run.dir) / METRICS_FILE,
            cfg.training.train_iters,
            enabled=show_progress,
            log=Path(job.task(0).paths.stdout),
            world_size=layout.world_size,
            ranks_up=ranks_up(Path(cfg.run.dir), str(job.job_id)),
            every=max(0.5, HEARTBEAT_S - cfg.cluster.poll_interval_s / 2),
        )
    except KeyboardInterrupt:  # a signal before the wait's handlers: a SLURM job runs on (signals.py), detached
        from orchestrator.submit.signals import HELD, WaitSignals

        if cfg.cluster.kind in HELD:
            raise
        raise WaitSignals(cfg, str(job.job_id)).detached_late(True) from None
    summaries = wait(job, cfg, layout.world_size, progress, tasks=agent_tasks(cfg) or None)
    if agent_tasks(cfg):  # one summary a node: the ranks' summaries each agent found
        ranks = {r: s for node in summaries if isinstance(node, dict) for r, s in node.get("ranks", {}).items()}
        summaries = [ranks[r] for r in sorted(ranks)]
    best = next((s for s in summaries if isinstance(s, dict) and s.get("logging_rank")), None)
    summary = dict(best or (summaries[-1] if summaries and isinstance(summaries[-1], dict) else {}))
    summary["job_id"] = str(job.job_id)
    if show_progress:
        print(final_lines(cfg), flush=True)
    return summary
