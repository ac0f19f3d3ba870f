"""``cluster=hosts``: PyTorch's elastic agent on every host of a list, started over SSH, and waited on.

Before anything is prepared (:func:`check_hosts`, one SSH round to all hosts at once): every host answers
SSH, sees the run root (a probe file the launcher writes is found there) and has the Python the job runs;
a refusal is one line naming the host, exit 2, nothing left behind. Then :func:`launch_hosts` writes the
job (``<run.dir>/agents/<job id>/job.pkl``) and starts, on each host, ``ssh HOST 'setup...; cd CWD; exec env
... python -m orchestrator.runtime.start.agent node ... --watch-stdin job.pkl'``
(:func:`orchestrator.runtime.start.agent.agent_command`): c10d rendezvous on the first host, node ranks in
sorted host-name order. Each session's output goes to ``agents/<job id>/<host>.log``; progress is shown
from ``metrics.jsonl`` as for local jobs.

Stops: a session that ends while the others run (its ranks failed, the SSH client was killed, the host
or its network went away: ``ServerAliveInterval`` 5 s x 3) is named with its host within a few seconds;
then every other session's stdin is closed, which makes its agent stop its ranks (SIGTERM, then SIGKILL
after 30 s: torchrun's own shutdown); after :data:`STOP_WAIT_S` the SSH clients are killed, and a last
``pkill -f <job file>`` on every host removes whatever is left. A signal to the launcher (Ctrl-C,
SIGTERM, SIGHUP) stops the job as a local job's (:mod:`orchestrator.submit.signals`): the ranks save at the
next iteration and exit, the launcher exits 128 + the signal; a second signal stops them at once. The
launcher dying outright closes the pipes: the agents stop their ranks.
"""

from __future__ import annotations

import concurrent.futures
import os
import shlex
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from orchestrator.config.hosts import Host, cluster_hosts, procs_per_node
from orchestrator.config.layout import ParallelLayout
from orchestrator.config.schema import JobConfig, to_dict
from orchestrator.errors import ConfigError
from orchestrator.slurm import JOB_ID_VAR
from orchestrator.submit.sessions import Sessions

AGENTS_DIR = "agents"


def ssh_base(cluster) -> List[str]:
    """``ssh`` with the cluster's options (batch mode, keep-alives that notice a dead peer in ~15 s)."""
    s = cluster.ssh
    argv = [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        f"ConnectTimeout={s.connect_timeout_s}",
        "-o",
        "ServerAliveInterval=5",
        "-o",
        "ServerAliveCountMax=3",
    ]
    if s.user:
        argv += ["-l", s.user]
    if s.port:
        argv += ["-p", str(s.port)]
    if s.identity:
        argv += ["-i", os.path.expanduser(s.identity)]
    for option in s.options:
        argv += ["-o", str(option)]
    return argv


def python_of(cfg: JobConfig) -> str:
    return cfg.cluster.python or sys.executable


def remote_script(cfg: JobConfig, argv: Sequence[str], env: Dict[str, str]) -> str:
    """The shell line run on a host: ``cluster.setup`` lines, then the agent in this directory with ``env``."""
    assigns = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
    return "; ".join([*cfg.cluster.setup, f"cd {shlex.quote(os.getcwd())}", f"exec env {assigns} {shlex.join(argv)}"])


def _probe_dir(run_dir: str) -> Path:
    """The run directory, or its nearest existing parent (a fresh run's directory does not exist yet)."""
    path = Path(run_dir).absolute()
    while not path.is_dir():
        path = path.parent
    return path


def check_hosts(cfg: JobConfig) -> List[Host]:
    """Every host answers SSH, sees the run root and has the job's Python; ConfigError (one line) naming the
    first host that does not. Leaves nothing on disk."""
    hosts = cluster_hosts(cfg.cluster)
    probe = _probe_dir(cfg.run.dir) / f".orchestrator-probe-{uuid.uuid4().hex}"
    python = python_of(cfg)
    script = f"test -e {shlex.quote(str(probe))} || exit 3; test -x {shlex.quote(python)} || exit 4"
    timeout = cfg.cluster.ssh.connect_timeout_s + 20

    def one(host: Host) -> Tuple[int, str]:
        try:
            r = subprocess.run(
                ssh_base(cfg.cluster) + [host.name, script],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            return 255, f"no answer within {timeout} s"
        return r.returncode, (r.stderr.strip().splitlines() or [""])[-1]

    probe.write_text("orchestrator: can every host see the run root?\n")
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
            answers = list(pool.map(one, hosts))
    finally:
        probe.unlink(missing_ok=True)
    for host, (rc, said) in zip(hosts, answers):
        if rc == 3:
            raise ConfigError(
                f"run.root={cfg.run.root}: host {host.name} cannot see {probe.parent} (the run directory "
                "must be on a file system every host shares); fix: run.root=<a shared directory>"
            )
        if rc == 4:
            raise ConfigError(
                f"cluster.python={cfg.cluster.python}: host {host.name} has no {python}; fix: "
                "cluster.python=<the interpreter on the hosts> (or install the same path there)"
            )
        if rc != 0:
            raise ConfigError(
                f"cluster.hosts: host {host.name} is not reachable by SSH ({said or f'ssh exit {rc}'}); "
                "fix: check the host name and cluster.ssh (user, port, identity, options)"
            )
    return hosts


def rank_env(cfg: JobConfig, job_id: str) -> Dict[str, str]:
    """What every rank of an agent-started job gets: ``cluster.env``, the job id, this ``PYTHONPATH``."""
    env = {k: str(v) for k, v in cfg.cluster.env.items()}
    env[JOB_ID_VAR] = job_id
    if os.environ.get("PYTHONPATH"):  # the same code on every host (a shared file system)
        env.setdefault("PYTHONPATH", os.environ["PYTHONPATH"])
    return env


def rendezvous_port(cfg: JobConfig, job_id: str) -> int:
    """``cluster.env.MASTER_PORT`` if set, else derived from the job id as SLURM jobs' are."""
    from orchestrator.runtime.rank.rendezvous import derived_port

    return int(cfg.cluster.env.get("MASTER_PORT") or derived_port(job_id))


def resolved_hosts(cfg: JobConfig) -> Tuple[JobConfig, List[Host]]:
    """``cfg`` with its hosts resolved once, here on the launcher (``cluster.hostfile`` may exist only on this
    machine): the list in ``cluster.hosts``, no hostfile, the processes per node in ``cluster.tasks_per_node``. Every
    rank gets this config with the job and never reads the hostfile (its layout's world size is the same)."""
    import dataclasses

    hosts = cluster_hosts(cfg.cluster)
    cluster = dataclasses.replace(
        cfg.cluster, hosts=[h.name for h in hosts], hostfile=None, tasks_per_node=procs_per_node(cfg.cluster, hosts)
    )
    return dataclasses.replace(cfg, cluster=cluster), hosts


def write_job_file(cfg: JobConfig, layout: ParallelLayout, prepared, job_dir: Path, env: Dict[str, str]) -> Path:
    """The pickled TrainJob every rank of every agent runs."""
    from orchestrator.runtime.start.agent import write_job
    from orchestrator.runtime.start.job import TrainJob

    job_file = job_dir / "job.pkl"
    write_job(job_file, TrainJob(to_dict(cfg), asdict(prepared), asdict(layout), env=env))
    return job_file


def launch_hosts(cfg: JobConfig, layout: ParallelLayout, prepared, *, show_progress: bool = True) -> Dict[str, Any]:
    """Start the agents on every host, wait, return the logging rank's summary; JobFailedError naming the host
    whose session or ranks failed."""
    from orchestrator.ckpt import stop
    from orchestrator.ckpt.history import record_submission
    from orchestrator.runtime.start.agent import agent_command

    cfg, hosts = resolved_hosts(cfg)
    procs = cfg.cluster.tasks_per_node
    job_id = f"hosts-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    job_dir = Path(cfg.run.dir).absolute() / AGENTS_DIR / job_id
    env = rank_env(cfg, job_id)
    job_file = write_job_file(cfg, layout, prepared, job_dir, env)
    endpoint = f"{hosts[0].name}:{rendezvous_port(cfg, job_id)}"
    argv = agent_command(
        python_of(cfg),
        str(job_file),
        nnodes=len(hosts),
        nproc_per_node=procs,
        rdzv_endpoint=endpoint,
        rdzv_id=job_id,
        watch_stdin=True,
    )
    stop.clear(cfg.run.dir)  # a stop asked of an earlier job of this run
    record_submission(
        cfg.run.dir,
        job_id,
        cfg.cluster,
        {"stdout": str(job_dir / f"{hosts[0].name}.log")},
        num_tasks=layout.world_size,
        hosts=[h.name for h in hosts],
        rendezvous=endpoint,
        launcher={"pid": os.getpid(), "host": socket.gethostname()},
    )
    print(
        f"[orchestrator] job {job_id} (hosts): torchrun on {len(hosts)} hosts x {procs} ranks, rendezvous {endpoint}\n"
        f"[orchestrator]   run dir: {cfg.run.dir}\n[orchestrator]   logs:    {job_dir}/<host>.log",
        flush=True,
    )
    sessions = Sessions(ssh_base(cfg.cluster), [h.name for h in hosts], job_dir, job_file)
    sessions.start(remote_script(cfg, argv, env))
    summaries = sessions.wait(cfg, layout.world_size, job_id, show_progress=show_progress)
    best = next((s for s in summaries if isinstance(s, dict) and s.get("logging_rank")), None)
    summary = dict(best or summaries[-1])
    summary["job_id"] = job_id
    if show_progress:
        from orchestrator.submit.progress import final_lines

        print(final_lines(cfg), flush=True)
    return summary
