"""``cluster=torchrun`` (a platform runs the launcher once per node) and the checks both agent-started kinds make.

:func:`check_nodes` runs before anything is prepared: ``cluster=hosts`` asks every host over SSH
(:func:`orchestrator.submit.hosts.check_hosts`); ``cluster=torchrun`` reads the platform's variables
(:func:`orchestrator.config.hosts.node_env`) and checks they agree with the layout. :func:`launch_node`
then runs this node's torchrun agent (static rendezvous: ``MASTER_ADDR:MASTER_PORT``, ``NODE_RANK``) in the
foreground and waits; node 0 records the submission, and the job's ranks write the run's records as in any
job (rank 0, on node 0).
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any, Dict

from orchestrator.config.hosts import NodeEnv, cluster_hosts, node_env, procs_per_node
from orchestrator.config.layout import ParallelLayout
from orchestrator.config.schema import JobConfig
from orchestrator.errors import ConfigError
from orchestrator.slurm import JOB_ID_VAR


def this_node(cfg: JobConfig, layout: ParallelLayout) -> NodeEnv:
    """The platform's variables, checked against the layout (ConfigError, one line)."""
    procs = procs_per_node(cfg.cluster)
    env = node_env(os.environ, procs)
    if env.nnodes * procs != layout.world_size:
        raise ConfigError(
            f"{env.nnodes_source}={env.nnodes} nodes x {procs} processes per node = "
            f"{env.nnodes * procs} ranks, but the layout has world size {layout.world_size} "
            f"({layout.world_size_source}); fix: run on {layout.world_size // procs} nodes or change "
            "the layout (parallelism.*)"
        )
    return env


def check_nodes(cfg: JobConfig) -> str:
    """The pre-start check of ``cluster=hosts`` / ``cluster=torchrun``; one line saying what passed."""
    from orchestrator.config.checks import validate

    if cfg.cluster.kind == "hosts":
        from orchestrator.submit.hosts import check_hosts

        hosts = check_hosts(cfg)
        return f"hosts {', '.join(h.name for h in hosts)}: reachable by SSH, each sees {Path(cfg.run.root).absolute()}"
    env = this_node(cfg, validate(cfg))
    return (
        f"node {env.node_rank} of {env.nnodes} (from {env.source}); rendezvous {env.master_addr}:{env.master_port}"
        + ("; this node writes the records" if env.node_rank == 0 else "")
    )


def describe(cfg: JobConfig, layout: ParallelLayout) -> str:
    """What a dry run of ``cluster=hosts`` / ``cluster=torchrun`` would start."""
    procs = procs_per_node(cfg.cluster, cluster_hosts(cfg.cluster) if cfg.cluster.kind == "hosts" else ())
    if cfg.cluster.kind == "hosts":
        names = ", ".join(h.name for h in cluster_hosts(cfg.cluster))
        return (
            f"would start torchrun's agent on {names} over SSH ({procs} ranks each, c10d rendezvous on the "
            f"first), world size {layout.world_size}, in {cfg.run.dir}"
        )
    return f"would start this node's {procs} ranks under torchrun's agent (world size {layout.world_size})"


def _job_id(cfg: JobConfig, env: NodeEnv) -> str:
    """The same on every node without talking: ``ORCHESTRATOR_JOB_ID`` if exported, else derived from the
    rendezvous, the run directory and the checkpoints there (a rerun after a save gets a new id)."""
    if os.environ.get(JOB_ID_VAR):
        return os.environ[JOB_ID_VAR]
    from orchestrator.ckpt.manifest import save_dir_of

    save_dir = save_dir_of(cfg)
    ckpts = sorted(p.name for p in save_dir.iterdir()) if save_dir.is_dir() else []
    key = f"{env.master_addr}:{env.master_port}:{Path(cfg.run.dir).absolute()}:{ckpts}"
    return "torchrun-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def stopped_by_request(cfg: JobConfig, job_id: str):
    """The JobStopped of a job whose ranks saved and stopped together (``orchestrator stop``, a signal to them): the
    line says who asked and where a rerun resumes; the launcher exits as a local one does (143)."""
    from orchestrator.ckpt import stop
    from orchestrator.submit.signals import STOPPED_BY_REQUEST_EXIT, JobStopped, checkpoint_words

    who = (stop.read(cfg.run.dir, job_id) or {}).get("by", "a stop request")
    return JobStopped(f"stopped after saving ({who}); {checkpoint_words(cfg)}", STOPPED_BY_REQUEST_EXIT)


def launch_node(cfg: JobConfig, layout: ParallelLayout, prepared, *, show_progress: bool = True) -> Dict[str, Any]:
    """Run this node's agent and wait; the summary of this node's logging rank (or of its first rank)."""
    from orchestrator.ckpt.history import record_submission
    from orchestrator.runtime.start.agent import agent_command
    from orchestrator.submit.hosts import AGENTS_DIR, python_of, rank_env, write_job_file
    from orchestrator.submit.sessions import failure, results

    env = this_node(cfg, layout)
    procs = procs_per_node(cfg.cluster)
    job_id = _job_id(cfg, env)
    job_dir = Path(cfg.run.dir).absolute() / AGENTS_DIR / job_id / f"node{env.node_rank}"
    env_of_ranks = rank_env(cfg, job_id)
    job_file = write_job_file(cfg, layout, prepared, job_dir, env_of_ranks)
    if env.node_rank == 0:
        record_submission(
            cfg.run.dir,
            job_id,
            cfg.cluster,
            {"stdout": str(job_dir / "agent.log")},
            num_tasks=layout.world_size,
            rendezvous=f"{env.master_addr}:{env.master_port}",
            launcher={"pid": os.getpid(), "host": socket.gethostname()},  # status/stop: alive while it waits
        )
    argv = agent_command(
        python_of(cfg),
        str(job_file),
        nnodes=env.nnodes,
        nproc_per_node=procs,
        rdzv_endpoint=f"{env.master_addr}:{env.master_port}",
        rdzv_id=job_id,
        node_rank=env.node_rank,
    )
    print(
        f"[orchestrator] job {job_id} (torchrun): node {env.node_rank} of {env.nnodes}, ranks "
        f"{env.node_rank * procs}..{(env.node_rank + 1) * procs - 1}",
        flush=True,
    )
    agent = subprocess.Popen(argv, env={**os.environ, **env_of_ranks}, start_new_session=True)
    try:
        rc = agent.wait()
    except KeyboardInterrupt:
        agent.send_signal(signal.SIGTERM)  # torchrun's shutdown: SIGTERM to the ranks, SIGKILL after 30 s
        try:
            agent.wait(timeout=40)
        except subprocess.TimeoutExpired:
            agent.kill()
        raise
    ranks = range(env.node_rank * procs, (env.node_rank + 1) * procs)
    found = {r: o for r, o in results(job_file, layout.world_size).items() if r in ranks}
    from orchestrator.runtime.faults.requeue import STOP_EXIT_CODE
    from orchestrator.runtime.start.agent import decided_exit

    if len(found) == procs and decided_exit(found) == STOP_EXIT_CODE:  # `orchestrator stop`: saved, not failed
        raise stopped_by_request(cfg, job_id)
    if rc != 0 or len(found) != procs or any(o[0] != "success" for o in found.values()):
        raise failure(job_file, found, f"node {env.node_rank}: torchrun's agent exited {rc}")
    summaries = [found[r][1] for r in ranks]
    best = next((s for s in summaries if isinstance(s, dict) and s.get("logging_rank")), None)
    if best is None:  # the loss lives on the logging rank, on another node
        best = {k: v for k, v in summaries[0].items() if k != "lm_loss"}
    return {**best, "job_id": job_id}
