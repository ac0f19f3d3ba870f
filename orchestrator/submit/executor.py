"""Submission through submitit: ``cluster.kind=local`` (LocalExecutor) or ``slurm``.

:func:`launch` submits one job whose tasks are the ranks, then (``cluster.wait``)
watches it: it streams progress from ``<run.dir>/metrics.jsonl``, reads each
task's submitit result file, cancels the whole job as soon as one rank fails
(the others would otherwise block in a collective until the process-group
timeout), and bounds every wait by the job's time limit plus a margin. On SLURM
the job's state comes from ``squeue``/``scontrol`` (accounting may be absent, and
submitit polls sacct rarely), so a job cancelled outside our control is
reported, not waited on forever.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.spec.schema import JobConfig, to_dict
from orchestrator.errors import JobFailedError, SubmissionError
from orchestrator.spec.layout import ParallelLayout
from orchestrator.ckpt.rundir import METRICS_FILE, SUBMITIT_DIR
from orchestrator.submit.progress import Progress, final_lines



def make_executor(cfg: JobConfig, world_size: int):
    """A configured submitit executor writing its files under ``<run.dir>/submitit``."""
    import submitit

    folder = Path(cfg.run.dir) / SUBMITIT_DIR
    c = cfg.cluster
    if c.kind == "local":
        executor = submitit.LocalExecutor(folder=str(folder), max_num_timeout=c.max_num_timeout,
                                          python=c.python)
        params: Dict[str, Any] = dict(nodes=1, tasks_per_node=world_size, timeout_min=c.timeout_min,
                                      signal_delay_s=c.signal_delay_s)
        if c.gpus_per_node:
            params["gpus_per_node"] = c.gpus_per_node
        executor.update_parameters(**params)
        return executor
    from orchestrator.submit.sbatch import python_command, slurm_executor_parameters

    # python_command quotes the interpreter path (submitit would put cluster.python in unquoted).
    executor = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=c.max_num_timeout,
                                      python=python_command(cfg))
    executor.update_parameters(**slurm_executor_parameters(cfg, world_size))
    return executor


def job_environment(cfg: JobConfig, world_size: int) -> Dict[str, str]:
    """Environment every rank gets: ``cluster.env`` plus CPU thread defaults for local CPU runs."""
    env = {k: str(v) for k, v in cfg.cluster.env.items()}
    if cfg.cluster.kind == "local" and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world_size))
    if cfg.cluster.kind == "local":  # a free rendezvous port, reserved now (never the caller's MASTER_PORT)
        from orchestrator.runtime.distributed import local_rendezvous_env

        env.update(local_rendezvous_env())
    return env


# ------------------------------------------------------------------ state of a submitted job
def _read_result(path: Path) -> Optional[Tuple[str, Any]]:
    if not path.exists():
        return None
    from submitit.core.utils import pickle_load

    try:
        return pickle_load(path)
    except Exception:  # being written
        return None


def _slurm_state(job_id: str) -> Tuple[str, int]:
    """(SLURM state, requeues so far) of ``job_id`` from ``scontrol show job``, else the state from
    squeue (('UNKNOWN', 0) when neither knows it)."""
    from orchestrator.submit.jobs import parse_scontrol_job

    try:
        out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30)
        fields = parse_scontrol_job(out.stdout) if out.returncode == 0 else {}
        if fields.get("JobState"):
            restarts = fields.get("Restarts", "0")
            return fields["JobState"], int(restarts) if restarts.isdigit() else 0
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
        state = out.stdout.strip().splitlines()
        if out.returncode == 0 and state:
            return state[0].strip(), 0
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "UNKNOWN", 0


_SLURM_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED", "UNKNOWN"}


def _srun_errors(job, lines: int = 6) -> str:
    """srun's own error lines from the batch log (e.g. ``srun: error: node: task 1: Killed``): the
    rank that died first, which its peers' broken-collective errors do not name."""
    try:
        path = Path(job.paths.stderr)  # the batch script's stderr (task 0's log) holds srun's messages
        found = [line for line in path.read_text(errors="replace").splitlines()
                 if line.startswith("srun: error:") and "task" in line]
        return "\n".join(found[-lines:])
    except Exception:  # pragma: no cover - diagnostics only
        return ""


def _stderr_tail(job, task: int, lines: int = 25) -> str:
    try:
        paths = job.task(task).paths
        text = ""
        for p in (paths.stderr, paths.stdout):
            if Path(p).exists():
                text = Path(p).read_text(errors="replace")
                if "Traceback" in text or "Error" in text:
                    break
        return "\n".join(text.rstrip().splitlines()[-lines:])
    except Exception:  # pragma: no cover - diagnostics only
        return ""


def cancel(job, cfg: JobConfig) -> None:
    """Stop every task of ``job`` now. Local: SIGKILL the rank processes (the controller then
    exits on its own); SLURM: scancel."""
    if cfg.cluster.kind != "local":
        try:
            job.cancel(check=False)
        except Exception:
            pass
        return
    import psutil

    process = getattr(job, "_process", None)
    if process is None:
        return
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    try:
        process.wait(timeout=30)
    except Exception:
        process.kill()


def _local_alive_ranks(job) -> Optional[set]:
    """Ranks whose local task process is alive (None when the controller is gone or unreadable).

    Tasks are the controller's direct children; each carries its rank in SUBMITIT_LOCAL_GLOBALID
    (the checkpoint writer's forked helpers are grandchildren and are not counted).
    """
    import psutil

    process = getattr(job, "_process", None)
    if process is None or process.poll() is not None:
        return None
    try:
        controller = psutil.Process(process.pid)
        if "submitit.local._local" not in " ".join(controller.cmdline()):  # started through a shell
            controller = next((c for c in controller.children()
                               if "submitit.local._local" in " ".join(c.cmdline())), None)
            if controller is None:
                return None
        alive = set()
        for child in controller.children():
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                rank = child.environ().get("SUBMITIT_LOCAL_GLOBALID")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if rank is not None:
                alive.add(int(rank))
        return alive
    except psutil.NoSuchProcess:
        return None


def _dead_ranks(job, world_size: int, results: Dict[int, Any]) -> List[int]:
    """Local ranks that exited without writing a result (SIGKILL, OOM killer); re-checked after 1 s."""
    for attempt in range(2):
        alive = _local_alive_ranks(job)
        if alive is None or len(alive) == 0 and not results:
            return []  # not started yet, or the controller is gone (handled by the state check)
        for i in range(world_size):
            if i not in results:
                r = _read_result(Path(job.task(i).paths.result_pickle))
                if r is not None:
                    results[i] = r
        dead = [i for i in range(world_size) if i not in results and i not in alive]
        if not dead:
            return []
        if attempt == 0:
            time.sleep(1.0)  # a rank may have been between writing its result and exiting
    return dead


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _is_stale(rank: int, path: Path, stale: Dict[int, float]) -> bool:
    """Rank ``rank``'s result file still holds what a failed, requeued attempt wrote."""
    return rank in stale and _mtime(path) == stale[rank]


def _pause(job, cfg: JobConfig) -> None:
    """One poll interval; for a local job, less when its controller exits meanwhile (the ranks' results
    are then all written: the launcher returns at once instead of up to ``cluster.poll_interval_s`` late)."""
    process = getattr(job, "_process", None) if cfg.cluster.kind == "local" else None
    if process is None or process.poll() is not None:
        time.sleep(cfg.cluster.poll_interval_s)
        return
    try:
        process.wait(timeout=cfg.cluster.poll_interval_s)
    except subprocess.TimeoutExpired:
        pass


def wait(job, cfg: JobConfig, world_size: int, progress: Optional[Progress] = None) -> List[Dict[str, Any]]:
    """Block until every task of ``job`` ends; return the per-rank summaries.

    Raises :class:`JobFailedError` (with the failing rank's last lines) when a rank fails, the
    job is cancelled, or it runs longer than ``cluster.timeout_min`` x (requeues + 1) plus 5
    minutes. On SLURM, time spent PENDING (in the queue, before the start or after a requeue)
    does not count towards that bound, and a requeue is reported and waited through: the requeued
    job writes its results into the same files when it finishes.

    A failure the job explained (a NaN stop, a declared hang, an orchestrator error such as a full
    disk: :mod:`orchestrator.submit.outcome`) is reported in one line. Every rank silent (no
    heartbeat) for ``training.hang_timeout_s`` + 60 s: the job is cancelled as hung. An end the job
    could not record (killed ranks, a lost node, Ctrl-C) is recorded in the run's history.
    """
    from orchestrator.runtime.watchdog import JobWatch
    from orchestrator.submit import outcome

    c = cfg.cluster
    run_dir, job_id = cfg.run.dir, str(job.job_id)
    hang_s = cfg.training.hang_timeout_s
    watch = JobWatch(run_dir, job_id, world_size, hang_s) if hang_s else None
    stale: Dict[int, float] = {}  # result files of an attempt that failed and was requeued (by mtime)
    bound_s = 60 * c.timeout_min * (c.max_num_timeout + 1) + 300
    counted_s = 0.0  # time the job has been running (not pending) while we waited
    last_poll = time.time()
    results: Dict[int, Tuple[str, Any]] = {}
    started = time.time()
    ended_since: Optional[float] = None
    requeues = 0
    state = ""
    try:
        while True:
            now = time.time()
            if c.kind == "local" or state != "PENDING":
                counted_s += now - last_poll
            last_poll = now
            if progress is not None:
                progress.poll()
            for i in range(world_size):
                if i not in results and not _is_stale(i, Path(job.task(i).paths.result_pickle), stale):
                    r = _read_result(Path(job.task(i).paths.result_pickle))
                    if r is not None:
                        results[i] = r
            failed = [i for i, r in results.items() if r[0] != "success"]
            if failed and c.kind != "local" and outcome.requeued_after_failure(run_dir, job_id):
                stale.update({i: _mtime(Path(job.task(i).paths.result_pickle)) for i in results})
                results.clear()  # the requeued attempt writes its own results
                failed = []
            if failed:
                known = outcome.known_failure(run_dir, job_id, [results[i][1] for i in sorted(failed)])
                if known:
                    cancel(job, cfg)
                    raise JobFailedError(f"job {job_id}: {known} (logs: {Path(job.task(failed[0]).paths.stderr).parent}/)")
                # Often the root cause is a rank that died silently (SIGKILL, OOM killer) and the
                # error above is its peers' broken collective: say so.
                dead = _dead_ranks(job, world_size, results) if c.kind == "local" else []
                cancel(job, cfg)
                rank = failed[0]
                detail = results[rank][1]
                tail = str(detail).strip().splitlines()[-15:] if detail else []
                cause = (f"rank(s) {dead} died without a result (killed? out of memory?); then " if dead else "")
                srun = _srun_errors(job) if c.kind != "local" else ""
                outcome.record_end(run_dir, job_id, "crashed", f"rank {rank} failed: {tail[-1] if tail else ''}")
                raise JobFailedError(
                    f"job {job.job_id}: {cause}rank {rank} failed:\n" + "\n".join(tail) +
                    (f"\n{srun}" if srun else "") + f"\nlogs: {job.task(rank).paths.stderr}")
            if len(results) == world_size:
                return [results[i][1] for i in range(world_size)]
            if c.kind == "local" and time.time() - started > 5:
                dead = _dead_ranks(job, world_size, results)
                if dead:
                    cancel(job, cfg)
                    known = outcome.known_failure(run_dir, job_id)
                    if known:
                        raise JobFailedError(f"job {job_id}: {known} (logs: {Path(job.task(dead[0]).paths.stderr).parent}/)")
                    outcome.record_end(run_dir, job_id, "crashed", f"rank(s) {dead} died without a result")
                    raise JobFailedError(
                        f"job {job.job_id}: rank(s) {dead} died without a result (killed? out of memory?); "
                        f"the other ranks were stopped.\nlogs: {Path(job.task(dead[0]).paths.stderr).parent}/")
            if c.kind == "local":
                ended = job.state != "RUNNING"
                state = job.state
            else:
                state, restarts = _slurm_state(str(job.job_id))
                ended = state in _SLURM_ENDED
                if restarts > requeues:  # PENDING/REQUEUED after a requeue: not an end, keep waiting
                    requeues = restarts
                    failure = outcome.failed_attempt_message(run_dir, job_id)
                    if failure is not None:  # srun's lines name the node and the tasks that died
                        srun = _srun_errors(job)
                        print(f"[orchestrator] job {job.job_id} failed: {failure}" + (f"\n{srun}" if srun else "") +
                              f"\n[orchestrator] job {job.job_id} requeued after a failure (cluster.max_failures="
                              f"{c.max_failures}); it resumes from its latest checkpoint", flush=True)
                    else:
                        print(f"[orchestrator] job {job.job_id} requeued ({requeues} of at most {c.max_num_timeout}); "
                              f"it resumes from its latest checkpoint when SLURM restarts it", flush=True)
            cancelled = c.kind != "local" and state.startswith("CANCELLED")
            if ended:
                # Allow result files a moment to land after the processes exit (the state is
                # re-read every poll, so a transient answer does not end the wait).
                ended_since = ended_since or time.time()
                if time.time() - ended_since > (3 if cancelled else 15):
                    missing = [i for i in range(world_size) if i not in results]
                    known = outcome.known_failure(run_dir, job_id)
                    if known and not cancelled:
                        raise JobFailedError(f"job {job_id} ({state}): {known} (logs: {Path(job.paths.stderr).parent}/)")
                    outcome.record_end(run_dir, job_id, outcome.slurm_cause(state) if c.kind != "local" else "crashed",
                                       f"job ended ({state}) without results from rank(s) {missing}")
                    if cancelled:
                        raise JobFailedError(
                            f"job {job.job_id} was cancelled (scancel or the scheduler) before it finished; "
                            f"rerunning the same command resumes from its latest checkpoint, if it saved one.\n"
                            f"logs: {Path(job.paths.stderr).parent}/")
                    srun = _srun_errors(job) if c.kind != "local" else ""
                    raise JobFailedError(
                        f"job {job.job_id} ended ({state}) without results from rank(s) {missing}:\n"
                        + (f"{srun}\n" if srun else "") +
                        f"{_stderr_tail(job, missing[0])}\nlogs: {job.task(missing[0]).paths.stderr}")
            else:
                ended_since = None
            if watch is not None and not ended:
                if c.kind != "local" and state != "RUNNING":
                    watch.pause()  # pending or requeued: silence does not count
                elif (hung := watch.hung()) is not None:
                    cancel(job, cfg)
                    outcome.record_end(run_dir, job_id, "hang", hung)
                    raise JobFailedError(f"job {job_id}: {hung}")
            if counted_s > bound_s:
                outcome.record_end(run_dir, job_id, "interrupted", "the launcher's time bound ran out")
                cancel(job, cfg)
                raise JobFailedError(f"job {job.job_id} did not finish before the launcher's bound "
                                     f"(cluster.timeout_min={c.timeout_min} x {c.max_num_timeout + 1} + 5 min "
                                     f"of running time); cancelled")
            _pause(job, cfg)
    except KeyboardInterrupt:
        cancel(job, cfg)
        outcome.record_end(run_dir, job_id, "interrupted", "the launcher was interrupted (Ctrl-C or a signal)")
        raise
    finally:
        if progress is not None:
            progress.poll()
            progress.close()


@contextlib.contextmanager
def _children_ignore_sigint():
    """Spawn with SIGINT ignored, which child processes inherit: a terminal's Ctrl-C then reaches
    only the launcher, which stops the ranks itself (:func:`cancel`); submitit's local controller
    would otherwise print its own KeyboardInterrupt traceback on our terminal."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def submit(cfg: JobConfig, layout: ParallelLayout, prepared) -> Any:
    """Submit the training job (one task per rank); returns the submitit job."""
    from orchestrator.runtime.job import TrainJob

    executor = make_executor(cfg, layout.world_size)
    payload = TrainJob(to_dict(cfg), asdict(prepared), env=job_environment(cfg, layout.world_size))
    try:
        with _children_ignore_sigint():
            job = executor.submit(payload)
    except Exception as exc:
        raise SubmissionError(f"submission to cluster.kind={cfg.cluster.kind} failed: {exc}") from None
    _record(cfg, job, layout.world_size)
    return job


def _record(cfg: JobConfig, job, world_size: int) -> None:
    from orchestrator.ckpt.history import record_submission

    record_submission(cfg.run.dir, str(job.job_id), cfg.cluster,
                      {"stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr)}, num_tasks=world_size)


def launch(cfg: JobConfig, layout: ParallelLayout, prepared, *, show_progress: bool = True) -> Dict[str, Any]:
    """Submit and (with ``cluster.wait``) wait; returns the logging rank's summary (or ``{job_id}``)."""
    job = submit(cfg, layout, prepared)
    print(f"[orchestrator] submitted job {job.job_id} ({cfg.cluster.kind}): starting {layout.world_size} ranks\n"
          f"[orchestrator]   run dir: {cfg.run.dir}\n"
          f"[orchestrator]   logs:    {Path(job.paths.stdout).parent}/", flush=True)
    if not cfg.cluster.wait:
        return {"job_id": str(job.job_id), "status": "submitted"}
    progress = Progress(Path(cfg.run.dir) / METRICS_FILE, cfg.training.train_iters, enabled=show_progress,
                         log=Path(job.task(0).paths.stdout))
    summaries = wait(job, cfg, layout.world_size, progress)
    best = next((s for s in summaries if isinstance(s, dict) and s.get("logging_rank")), None)
    summary = dict(best or (summaries[-1] if summaries and isinstance(summaries[-1], dict) else {}))
    summary["job_id"] = str(job.job_id)
    if show_progress:
        print(final_lines(cfg), flush=True)
    return summary
