"""The ``cluster`` group's schema: where a job runs (local, SLURM, a host list over SSH, or a platform's torchrun).

Part of the typed configuration (:mod:`orchestrator.config.schema` composes it into ``JobConfig``); the
SSH options and the host list's parsing live in :mod:`orchestrator.config.hosts`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from orchestrator.config.hosts import SshConfig
from orchestrator.config.slowness import LinkCheckConfig


@dataclass
class ClusterConfig:
    """Where the job runs: local (submitit LocalExecutor), slurm, hosts or torchrun (orchestrator.config.hosts)."""

    name: str = "local"
    kind: str = "local"
    """local, slurm, hosts or torchrun."""
    hosts: List[str] = field(default_factory=list)
    """cluster=hosts: the hosts (the first hosts the rendezvous); or ``hostfile``: one host a line, ``slots=N``."""
    hostfile: Optional[str] = None
    ssh: SshConfig = field(default_factory=SshConfig)
    nodes: int = 1
    tasks_per_node: Optional[int] = None
    """Null: local = the layout's world size; slurm = gpus_per_node."""
    gpus_per_node: int = 0
    cpus_per_task: Optional[int] = None
    mem: Optional[str] = None
    """SLURM --mem, e.g. 64G."""
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    exclude: Optional[str] = None
    timeout_min: int = 60
    """Wall-clock limit of the job in minutes (SLURM --time; local processes are killed after it)."""
    signal_delay_s: int = 90
    """USR2 is sent this long before the time limit: save, then requeue."""
    max_num_timeout: int = 3
    """How many times a timed-out or preempted job is requeued."""
    max_failures: int = 0
    """SLURM: how many times a failed attempt (hang, node failure, crash) is requeued; a NaN never is."""
    max_restarts: int = 0
    """local and slurm: how many times a failed attempt restarts all its ranks in place (same allocation, a
    fresh rendezvous, from the last complete checkpoint) before ``max_failures`` applies; 0 = never (one
    task per rank, no per-node agent). See runtime/start/inplace.py."""
    mtbf_hours: Optional[float] = None
    """The job's mean time between failures, hours (``checkpoint.save_interval=auto`` and the plan's goodput
    forecast); null: estimated from the run's own history once it has failures, else a node's MTBF from
    Llama 3's published fleet data / ``nodes`` (orchestrator.plan.goodput.job_mtbf)."""
    spare_nodes: int = 0
    """slurm with ``max_restarts`` > 0: extra nodes allocated that idle until a node fails its health check
    before a restart, then take its place."""
    additional_parameters: Dict[str, Any] = field(default_factory=dict)
    """Extra sbatch parameters, e.g. {reservation: foo}."""
    setup: List[str] = field(default_factory=list)
    """Shell lines run in the sbatch script before srun (module load, venv activation)."""
    srun_args: List[str] = field(default_factory=list)
    env: Dict[str, str] = field(default_factory=dict)
    """Environment variables for every rank (NCCL_SOCKET_IFNAME, NCCL_IB_DISABLE, ...)."""
    python: Optional[str] = None
    """Python executable on the compute nodes; null = the submitting interpreter."""
    wait: bool = True
    """Block until the job ends, streaming progress."""
    poll_interval_s: float = 2.0
    link_check: LinkCheckConfig = field(default_factory=LinkCheckConfig)
    """Cross-node link bandwidth before training (orchestrator/runtime/faults/links.py)."""

    def __post_init__(self) -> None:
        if isinstance(self.ssh, dict):  # from_dict / a pickled job: plain dicts travel
            self.ssh = SshConfig(**self.ssh)
        if isinstance(self.link_check, dict):
            self.link_check = LinkCheckConfig(**self.link_check)
