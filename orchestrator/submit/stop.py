"""``python -m orchestrator stop RUN [--now]``: stop a live run, local or SLURM, on purpose.

RUN is a run name under ``--root`` (default ``runs``, the default ``run.root``) or a run directory.
Without ``--now`` the stop is graceful: the request goes to ``<run>/stop.json``
(:mod:`orchestrator.ckpt.stop`), the job's rank 0 sees it within a second, every rank finishes the
iteration, saves (unless that iteration is saved already) and exits, never requeued; the attempt ends
``by request``, which ``status`` shows as ``stopped (by request)`` (``stopping`` meanwhile). A SLURM job
still pending (or waiting after a requeue) has no rank to save: it is cancelled. ``--now`` ends the job
at once, unsaved: ``scancel`` on SLURM, SIGKILL of the local job's processes. This command waits until
the job has ended and exits 0; it exits 2 with one ``error:`` line, changing nothing, when the run is
unknown, not live (finished, failed, stopped) or already stopping (``--now`` still ends it at once).
Rerunning the run's command (``config.yaml`` names it) resumes from its latest checkpoint. No torch.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from orchestrator.ckpt import history, stop
from orchestrator.ckpt.rundir import CONFIG_FILE, JOBS_FILE
from orchestrator.errors import ConfigError, OneLineArgumentParser
from orchestrator.submit.jobs import JobStatus, job_status

LIVE = ("pending", "running", "requeued")
"""Job states ``stop`` acts on."""


def run_dir_of(run: str, root: str) -> Path:
    """The run directory RUN names: a directory holding ``jobs.jsonl``, else ``<root>/<RUN>``; ConfigError
    (one line) when neither is a run."""
    for candidate in (Path(run), Path(root) / run):
        if (candidate / JOBS_FILE).is_file():
            return candidate.absolute()
    raise ConfigError(
        f"RUN={run}: no run directory {run} or {Path(root) / run} (none holds {JOBS_FILE}); "
        f"fix: `python -m orchestrator status {root}` lists the runs (--root DIR for another run.root)"
    )


def latest_job(run_dir: Path) -> Tuple[Dict[str, Any], JobStatus, List[Dict[str, Any]]]:
    """(the latest submission record, its job's status, every record of the run)."""
    records = history.read_records(run_dir)
    submissions = [r for r in records if r.get("event") == "submitted"]
    if not submissions:
        raise ConfigError(f"RUN={run_dir}: no job was ever submitted for this run; fix: nothing to stop")
    last = submissions[-1]
    st = job_status(
        str(last["job_id"]),
        str(last.get("cluster", "slurm")),
        last.get("folder"),
        last.get("num_tasks"),
        events=records,
    )
    return last, st, records


def kill_local(job_id: str, controller_too: bool = True) -> None:
    """SIGKILL a local job: every descendant of its submitit controller (process id ``job_id``: the
    task, the ranks it forked, their checkpoint writers) and (``controller_too``) the controller."""
    import psutil

    try:
        controller = psutil.Process(int(job_id))
        if "submitit" not in " ".join(controller.cmdline()):
            return  # the id is another process's now: the job is gone
        tree = [*controller.children(recursive=True), *([controller] if controller_too else [])]
    except (psutil.Error, ValueError):
        return
    for p in tree:
        try:
            p.kill()
        except psutil.Error:
            pass


def scancel(job_id: str) -> None:
    subprocess.run(["scancel", str(job_id)], capture_output=True, text=True, timeout=30)


def cancel(job, cfg) -> None:
    """End every task of the submitit ``job`` now, unsaved. Local: SIGKILL the rank processes (the
    controller then exits on its own); SLURM: scancel (the launcher does it only when the job failed,
    hung or outran its bound, never for a signal to the launcher: :mod:`orchestrator.submit.signals`)."""
    if cfg.cluster.kind != "local":
        try:
            job.cancel(check=False)
        except Exception:  # noqa: BLE001 - already gone
            pass
        return
    process = getattr(job, "_process", None)
    if process is None:
        return
    kill_local(str(process.pid), controller_too=False)
    try:
        process.wait(timeout=30)
    except Exception:  # noqa: BLE001
        process.kill()


def command_of(run_dir: Path) -> str:
    """The command that started the run (``config.yaml``'s header), to resume it."""
    try:
        for line in (run_dir / CONFIG_FILE).read_text().splitlines()[:3]:
            if line.startswith("# command: "):
                return line[len("# command: ") :]
    except OSError:
        pass
    return "the run's command"


def wait_ended(run_dir: Path, timeout_s: float) -> Optional[JobStatus]:
    """The job's status once it is no longer live; None if it still is after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = latest_job(run_dir)[1]
        if st.state not in LIVE:
            return st
        if time.monotonic() > deadline:
            return None
        time.sleep(1.0)


def _stop(run_dir: Path, last: Dict[str, Any], st: JobStatus, now: bool) -> str:
    """Ask or force the stop; return how it was done, in words."""
    from orchestrator.submit import outcome

    job_id, slurm = str(last["job_id"]), st.cluster == "slurm"
    if not now and not (slurm and st.state != "running"):
        stop.request(run_dir, job_id, by="orchestrator stop", cause=stop.BY_REQUEST)
        return "the ranks save at their next iteration and exit"
    stop.request(
        run_dir, job_id, by="orchestrator stop --now" if now else "orchestrator stop", cause=stop.BY_REQUEST, now=True
    )
    scancel(job_id) if slurm else kill_local(job_id)
    outcome.record_end(
        str(run_dir),
        job_id,
        stop.BY_REQUEST,
        "stopped at once by orchestrator stop --now, unsaved"
        if now
        else f"cancelled by orchestrator stop while {st.state} (no rank had started)",
    )
    return ("scancel" if slurm else "SIGKILL") + (", unsaved" if now else f" (it was {st.state})")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineArgumentParser(
        prog="python -m orchestrator stop",
        description="Stop a live run (local or SLURM): its ranks save at their next iteration and exit, not "
        "requeued; rerunning the run's command resumes. Exit 0 once stopped, 2 when the run is "
        "not live.",
    )
    parser.add_argument("run", metavar="RUN", help="a run name under --root, or a run directory")
    parser.add_argument("--now", action="store_true", help="end it at once, unsaved (scancel / SIGKILL)")
    parser.add_argument("--root", default="runs", help="the runs root RUN is under (run.root; default: runs)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds to wait for the ranks to save and exit (default 900); exit 1 after it",
    )
    args = parser.parse_args(argv)
    try:
        run_dir = run_dir_of(args.run, args.root)
        last, st, _ = latest_job(run_dir)
        job_id = str(last["job_id"])
        if last.get("warm_pool"):
            raise ConfigError(
                f"RUN={args.run}: {run_dir} is a sweep point or tune trial on warm ranks (job {job_id}), "
                "which `stop` does not reach; fix: Ctrl-C the sweep's launcher"
            )
        if st.state not in LIVE:
            raise ConfigError(
                f"RUN={args.run}: run {run_dir} is not live: its latest job {job_id} is "
                f"{st.describe()}; fix: nothing to stop (rerun its command to resume it)"
            )
        asked = stop.read(run_dir, job_id)
        if asked is not None and not args.now:
            raise ConfigError(
                f"RUN={args.run}: job {job_id} is stopping already (asked by {asked.get('by')} at "
                f"{time.strftime('%H:%M:%S', time.localtime(asked.get('time', 0)))}); fix: "
                f"`python -m orchestrator stop {args.run} --now` ends it at once, unsaved"
            )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    how = _stop(run_dir, last, st, args.now)
    print(f"[orchestrator] stopping job {job_id} ({st.cluster}) of {run_dir}: {how}", flush=True)
    end = wait_ended(run_dir, args.timeout)
    if end is None:
        print(
            f"error: job {job_id} is still live after {args.timeout:.0f} s; fix: wait, or "
            f"`python -m orchestrator stop {args.run} --now`",
            file=sys.stderr,
            flush=True,
        )
        return 1
    from orchestrator.runtime.faults.diskspace import latest_checkpoint

    ckpt = latest_checkpoint(run_dir)
    where = f"resumes from {run_dir}/checkpoints/{ckpt}" if ckpt else "starts from scratch (no checkpoint)"
    print(f"[orchestrator] job {job_id}: {end.describe()}; rerunning `{command_of(run_dir)}` {where}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
