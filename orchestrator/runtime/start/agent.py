"""The per-node agent: PyTorch's elastic agent (torchrun) running one node's ranks of a job.

One command, whoever starts it on a node: the ``cluster=hosts`` launcher over SSH, a platform for
``cluster=torchrun`` (Kubernetes, SkyPilot), or ``srun`` (one agent per node of a SLURM allocation)::

    python -m orchestrator.runtime.start.agent node --nnodes N --nproc-per-node P \\
        --rdzv-endpoint HOST:PORT --rdzv-id ID [--node-rank I] [--max-restarts R] [--watch-stdin] JOB_FILE

It runs :func:`torch.distributed.launcher.api.elastic_launch` (what ``torchrun`` runs): without
``--node-rank`` a c10d rendezvous hosted by the agent on ``HOST`` (node ranks follow the sorted host
names), with it torchrun's static rendezvous (``--master-addr``/``--node-rank``). Each worker runs
``... agent rank JOB_FILE``: the pickled :class:`~orchestrator.runtime.start.job.TrainJob` of the job
with torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``; it writes its
outcome beside ``JOB_FILE`` (``result_<rank>.pkl``, as submitit writes a task's). ``--watch-stdin``:
the agent stops its ranks (SIGTERM, as torchrun on a signal: SIGKILL 30 s later) when its standard
input closes, i.e. when the SSH session that started it died.

:func:`agent_command` (no torch) builds the command line; the rest imports torch when run.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import threading
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence


def agent_command(
    python: str,
    job_file: str,
    *,
    nnodes: int,
    nproc_per_node: int,
    rdzv_endpoint: str,
    rdzv_id: str,
    node_rank: Optional[int] = None,
    max_restarts: int = 0,
    watch_stdin: bool = False,
) -> List[str]:
    """The argv of the per-node agent (see the module docstring); pure."""
    argv = [
        python,
        "-m",
        "orchestrator.runtime.start.agent",
        "node",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-endpoint",
        rdzv_endpoint,
        "--rdzv-id",
        rdzv_id,
        "--max-restarts",
        str(max_restarts),
    ]
    if node_rank is not None:
        argv += ["--node-rank", str(node_rank)]
    if watch_stdin:
        argv.append("--watch-stdin")
    return argv + [job_file]


def result_path(job_file: "str | os.PathLike", rank: int) -> Path:
    """Where rank ``rank`` of the job described by ``job_file`` writes ``("success", summary)`` or
    ``("error", traceback)``."""
    return Path(job_file).with_name(f"result_{rank}.pkl")


def exit_code_of(outcome: Any) -> Optional[int]:
    """The exit status of an outcome file's ``("error", "SystemExit(N)")``: a stop or requeue the job decided
    (:mod:`orchestrator.runtime.faults.preempt`), not a failure; None for any other outcome."""
    text = str(outcome[1]) if isinstance(outcome, tuple) and len(outcome) == 2 and outcome[0] == "error" else ""
    if not (text.startswith("SystemExit(") and text.endswith(")")):
        return None
    value = text[len("SystemExit(") : -1]
    return int(value) if value.lstrip("-").isdigit() else 1


def decided_exit(found: Dict[int, Any]) -> Optional[int]:
    """The exit the ranks decided together — a stop (76) or a requeue (75) of runtime.faults.preempt, every rank that
    did not succeed ended so — from their outcome files ``{rank: outcome}``; None when one of them failed, or none
    stopped. The one reading of a stop that the in-place agent, cluster=torchrun and cluster=hosts share."""
    codes = [exit_code_of(o) for o in found.values() if not (isinstance(o, tuple) and o and o[0] == "success")]
    if not codes or None in codes:
        return None
    return codes[0]


def write_job(path: "str | os.PathLike", job: Any) -> None:
    """Pickle the job (a TrainJob of plain dicts) for the agents' ranks, atomically."""
    from orchestrator.io import write_atomic

    write_atomic(Path(path), pickle.dumps(job), fsync=True)


def _watch_stdin() -> None:
    """SIGTERM this agent once stdin reaches end of file (the SSH session that started it is gone)."""
    import signal

    def watch() -> None:
        try:  # the raw descriptor: a buffered reader's lock would stop the interpreter's shutdown
            while os.read(0, 65536):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


def run_node(args: argparse.Namespace) -> int:
    """Run this node's ranks under torch's elastic agent; 0 when they all succeeded, 1 otherwise. ``args.on_death``
    (optional): called ``(rank, "exit by signal 9, SIGKILL")`` the moment a signal ends a worker
    (:mod:`~orchestrator.runtime.start.worker_deaths`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    static = args.node_rank is not None
    config = LaunchConfig(
        min_nodes=args.nnodes,
        max_nodes=args.nnodes,
        nproc_per_node=args.nproc_per_node,
        run_id=args.rdzv_id,
        role="orchestrator",
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_backend="static" if static else getattr(args, "rdzv_backend", "c10d"),
        rdzv_configs={"rank": args.node_rank} if static else {"join_timeout": 300},
        max_restarts=args.max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
    )
    if args.watch_stdin:
        _watch_stdin()
    if getattr(args, "on_death", None) is not None:  # which worker a signal ended (its peers only see the break)
        from orchestrator.runtime.start.worker_deaths import watch

        watch(Path(args.job_file).absolute().parent, args.on_death)
    try:
        elastic_launch(config, sys.executable)("-m", "orchestrator.runtime.start.agent", "rank", args.job_file)
    except ChildFailedError as exc:
        failures = ", ".join(
            f"rank {rank} ({'signal ' + f.signal_name() if f.signal_name() else 'exit'} {f.exitcode})"
            for rank, f in exc.failures.items()
        )
        print(f"[orchestrator] agent on {os.uname().nodename}: {failures}", file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:
        print(
            f"[orchestrator] agent on {os.uname().nodename}: stopped by signal {exc.sigval.name}; ranks ended",
            file=sys.stderr,
            flush=True,
        )
        return 128 + int(exc.sigval)
    return 0


def run_rank(job_file: str) -> int:
    """A worker of the agent: train this rank of the pickled job, write its outcome file."""
    import traceback

    from orchestrator.io import write_atomic
    from orchestrator.runtime.start.worker_deaths import note_worker

    rank = int(os.environ.get("RANK", "0"))
    note_worker(job_file, rank)
    job = pickle.loads(Path(job_file).read_bytes())
    try:
        outcome: Any = ("success", job())
    except SystemExit as exc:  # a stop or requeue decided by the job: its records say why
        outcome = ("error", f"SystemExit({exc.code})")
        code = exc.code if isinstance(exc.code, int) else 1
        final = True
    except Exception as exc:
        traceback.print_exc()
        outcome, code = ("error", traceback.format_exc()), 1
        final = not restartable(exc)
    else:
        code, final = 0, True
    write_atomic(result_path(job_file, rank), pickle.dumps(outcome), fsync=False)
    sys.stdout.flush()
    if final and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        return 0  # an end the job decided: the agent must not restart it (runtime.start.inplace reads the outcome)
    return code


def restartable(exc: BaseException) -> bool:
    """Whether a rank's exception is a failure an in-place restart may cure: not a NaN stop (it would recur),
    not an orchestrator error (the user's to fix), not a failure after which the job decided not to restart."""
    from orchestrator.errors import OrchestratorError
    from orchestrator.runtime.faults import inplace

    return not isinstance(exc, OrchestratorError) and inplace.restart_decided() is not False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.runtime.start.agent")
    sub = parser.add_subparsers(dest="what", required=True)
    node = sub.add_parser("node", help="one node's agent: torchrun's elastic agent for this node's ranks")
    node.add_argument("--nnodes", type=int, required=True)
    node.add_argument("--nproc-per-node", type=int, required=True)
    node.add_argument("--rdzv-endpoint", required=True, help="HOST:PORT of node 0 (c10d store / master)")
    node.add_argument("--rdzv-id", required=True)
    node.add_argument("--node-rank", type=int, default=None, help="static rendezvous (platforms that say it)")
    node.add_argument("--max-restarts", type=int, default=0)
    node.add_argument("--watch-stdin", action="store_true", help="stop the ranks when stdin closes")
    node.add_argument("job_file")
    rank = sub.add_parser("rank", help="one rank (started by the agent)")
    rank.add_argument("job_file")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    return run_node(args) if args.what == "node" else run_rank(args.job_file)


if __name__ == "__main__":
    sys.exit(main())
