"""Real training on the real SLURM dev cluster through the real CLI (issues 4 and 10's acceptance).

`python -m orchestrator +experiment=gpt_pp2_dp2 cluster=slurm_dev ...` submits through submitit's
sbatch to the dev cluster of launch/ (`launch/slurm-dev-up.sh`, as root: two nodes, node1 and
node2, each slurmd in its own network + UTS namespace) and waits; no mocks. Skipped, with the
reason, when `sinfo` does not answer; the tests that span nodes also when it has fewer than two
nodes (`slurm-dev-up.sh --single`). Every wait is bounded.

* PP=2 x DP=2 across two nodes (`cluster.nodes=2 cluster.tasks_per_node=2`): 4 tasks through
  sbatch/srun train, checkpoint, report success with the job id; the recorded hosts put pipeline
  stage 0 (ranks 0,1) on one node and stage 1 (ranks 2,3) on the other. The same run is preempted
  while it trains (`scontrol requeue`, what SLURM's PreemptMode=REQUEUE does): SIGTERM -> save ->
  SLURM requeues and restarts the job -> it resumes through the manifest check -> finishes; the
  launcher waits through the requeue and reports success; every loss, before and after the resume
  point, equals an uninterrupted local run of the same config (1e-5 relative).
* SLURM's time limit, on one rank, twice (`--signal=USR2@110`, `cluster.max_num_timeout=1`): USR2 ->
  save -> the job requeues itself -> SLURM restarts it -> it resumes; the second attempt's limit
  finds the one requeue used up: it saves and stops, ``timeout``, and the launcher exits 1.
* A node lost mid-run (every process of the job on the node of stage 1 killed): the attempt ends
  within 60 s, the launcher names the node and the ranks (cause ``node failure``), the job requeues itself
  (`cluster.max_failures`), resumes from the last complete checkpoint and finishes with the losses
  of an uninterrupted run (1e-5 relative); both nodes are usable afterwards.
* scancel while the launcher waits: reported as cancelled (non-zero exit) within 60 s.
* SIGHUP / SIGINT to a waiting launcher: it detaches (exit 0, one line), the job runs on and completes;
  `orchestrator stop` ends a running job after saving its stop iteration, not requeued.
* A rank killed with SIGKILL (`cluster.max_failures=0`): the launcher reports it and the job ends
  instead of hanging; the attempt is ``crashed`` (one rank, not a node) and not requeued.
* `optimizer.lr=1000` with `cluster.max_failures=1`: ``nan``, never requeued.
* `python -m orchestrator status` lists each run with its state, requeues, last iteration and loss.

Time (2 cores; alone on a quiet machine): the run across nodes 73 s, its 30-iteration reference
running alongside (a requeued job restarts ~15 s after the requeue here: `KillWait=10`,
`cred_expire=10`); the time-limit run 61 s: each attempt gets its limit once it trains (its run time,
rounded up, + 1 minute, USR2@110: the signal at SLURM's next limit check, every 30 s), so it never
waits for a limit set before start-up, however long start-up takes on a loaded machine. A job that
only trains while it waits for a timer costs the CPU of that wait, so the timer waits run on one
rank. The node-loss run: the launcher names the lost node 4-5 s after the kill (3 s of it the
survivors' wait for each other, runtime/faults/lost.py); the requeued attempt finishes ~35 s after
the kill alone, 65-120 s at load 13-25.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from conftest import REFERENCE_ITERS, REPO, SharedReference, losses_by_iteration, read_metrics, slurm_unavailable_reason

from orchestrator.ckpt import attempts, history
from orchestrator.submit import jobs, sbatch, status

_REASON = slurm_unavailable_reason()


def _dev_nodes() -> List[str]:
    """The nodes of partition ``dev`` (none when SLURM does not answer)."""
    if _REASON:
        return []
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "dev", "-o", "%N"], capture_output=True, text=True, timeout=30)
    return sorted(set(out.stdout.split())) if out.returncode == 0 else []


_NODES = _dev_nodes()


def needs_slurm(test):
    """Marks ``slurm`` and ``slow``; skipped, with the reason, without the dev cluster."""
    test = pytest.mark.skipif(bool(_REASON), reason=f"SLURM dev cluster not reachable: {_REASON}")(test)
    return pytest.mark.slurm(pytest.mark.slow(test))


def needs_two_nodes(test):
    """:func:`needs_slurm`, and skipped, with the reason, on a dev cluster of one node."""
    test = pytest.mark.skipif(
        not _REASON and len(_NODES) < 2,
        reason=f"the dev cluster has {len(_NODES)} node(s) {_NODES}; a job across nodes "
        "needs 2 (launch/slurm-dev-up.sh without --single)",
    )(test)
    return needs_slurm(test)


SMALL = ["+experiment=gpt_pp2_dp2", "data.stdlib_max_mb=2", "training.log_interval=1", "training.eval_iters=0"]
ACROSS_NODES = ["cluster.nodes=2", "cluster.tasks_per_node=2"]
"""PP=2 x DP=2 on two nodes of the dev cluster, two tasks on each."""
REL = 1e-5


# ---- helpers -----------------------------------------------------------------------------------


def _sigint_default() -> None:
    """In the child before exec: SIGINT's default disposition, so that a test's SIGINT reaches the
    launcher even when pytest itself was started as a shell's background job (SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Cli:
    """`python -m orchestrator ARGS` in the background, output to files (no pipe to fill up)."""

    def __init__(self, args: List[str], cache: Path, logs: Path):
        logs.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = logs / "stdout.txt", logs / "stderr.txt"
        keys = dict(a.split("=", 1) for a in args if a.startswith(("run.root=", "run.name=")))
        self.run_dir = Path(keys["run.root"]) / keys["run.name"] if len(keys) == 2 else None
        env = dict(os.environ, ORCHESTRATOR_CACHE=str(cache), PYTHONUNBUFFERED="1")
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", *args],
                cwd=REPO,
                env=env,
                stdout=out,
                stderr=err,
                text=True,
                preexec_fn=_sigint_default,
            )

    @property
    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def describe(self) -> str:
        return f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-4000:]}"

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the launcher did not end within {timeout:.0f} s\n{self.describe()}") from None

    def kill(self) -> None:
        """End the launcher (Ctrl-C: it detaches from a SLURM job), then scancel its job if it still runs
        (a signal to a launcher never cancels a cluster job: the test does, so nothing outlives it). A
        launcher that already exited 0 saw its job complete: the batch script is ending on its own, and a
        scancel in that moment would turn the completed job CANCELLED."""
        if self.proc.poll() == 0:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        job_id = submitted_job(self.run_dir) if self.run_dir is not None and self.run_dir.exists() else None
        if job_id is not None and (jobs.slurm_job_status(job_id) or jobs.JobStatus("unknown", job_id)).state in (
            "pending",
            "running",
            "requeued",
        ):
            subprocess.run(["scancel", job_id], capture_output=True, timeout=30)


def wait_until(predicate, timeout_s: float, what: str, cli: Optional[Cli] = None, poll_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if cli is not None and cli.proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({cli.proc.returncode}) before {what}\n{cli.describe()}")
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}" + (f"\n{cli.describe()}" if cli else ""))


def submitted_job(run_dir: Path) -> Optional[str]:
    """The job id of the run's (latest) submission record, once the launcher has submitted."""
    jobs = [r for r in history.read_records(run_dir) if r.get("event") == "submitted"]
    return str(jobs[-1]["job_id"]) if jobs else None


def iterations_done(run_dir: Path) -> int:
    if not (run_dir / "metrics.jsonl").exists():
        return 0
    try:
        return max((r["iteration"] for r in read_metrics(run_dir)), default=0)
    except json.JSONDecodeError:  # a line being written
        return 0


def events(run_dir: Path, name: str) -> List[dict]:
    path = run_dir / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == name]


def assert_losses_match(slurm: Dict[int, float], local: Dict[int, float], iterations) -> None:
    for it in iterations:
        assert it in slurm and it in local, (it, sorted(slurm)[-3:], sorted(local)[-3:])
        assert abs(slurm[it] - local[it]) <= REL * abs(local[it]), (it, slurm[it], local[it])


def status_rows(root: Path) -> Dict[str, dict]:
    """`python -m orchestrator status ROOT --json`, keyed by run directory name; the table too."""
    cmd = [sys.executable, "-m", "orchestrator", "status", str(root)]
    table = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr
    out = subprocess.run(cmd + ["--json"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = {Path(d["run_dir"]).name: d for d in map(json.loads, out.stdout.splitlines())}
    for name in rows:
        assert any(line.split()[:1] == [name] for line in table.stdout.splitlines()), table.stdout
    rows["_table"] = {"text": table.stdout}
    return rows


def table_line(rows: Dict[str, dict], name: str) -> str:
    return next(line for line in rows["_table"]["text"].splitlines() if line.split()[:1] == [name])


def rank_process(run_dir: Path, rank: int):
    """The python process of SLURM task ``rank`` of this run (srun's children on this node)."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            if (
                "submitit.core._submit" in cmd
                and str(run_dir) in cmd
                and not cmd.startswith("srun")
                and p.environ().get("SLURM_PROCID") == str(rank)
                and "submitit.core._submit" not in " ".join(p.parent().cmdline())  # not its checkpoint writer's
            ):  # helper, which inherits its command line and environment (and may have a lower pid: pids wrap)
                return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def job_nodes(job_id: str) -> List[str]:
    """The hosts SLURM allocated to ``job_id``, in node-list order (``scontrol show hostnames``)."""
    fields = jobs.parse_scontrol_job(
        subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30).stdout
    )
    out = subprocess.run(
        ["scontrol", "show", "hostnames", fields["NodeList"]], capture_output=True, text=True, timeout=30
    )
    return out.stdout.split()


def job_processes(job_id: str, node: Optional[str] = None) -> list:
    """Every process of SLURM job ``job_id`` (its tasks and their children: the environment names the
    job), on ``node`` only when given. SLURM's own daemons (slurmstepd) do not carry it."""
    import psutil

    found = []
    for p in psutil.process_iter(["name"]):
        try:
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if (
            env.get("SLURM_JOB_ID") == job_id
            and (node is None or env.get("SLURMD_NODENAME") == node)
            and not (p.info["name"] or "").startswith("slurmstepd")
        ):
            found.append(p)
    return found


def pipeline_stages(tp: int, pp: int, dp: int) -> Dict[int, int]:
    """Global rank -> pipeline stage, from megatron-core's own rank generator (default order
    ``tp-cp-ep-dp-pp``, as ``initialize_model_parallel`` uses it)."""
    from megatron.core.parallel_state import RankGenerator

    groups = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp").get_ranks("pp")
    return {rank: stage for group in groups for stage, rank in enumerate(group)}


def last_summary(run_dir: Path) -> dict:
    return events(run_dir, "summary")[-1]


def assert_stages_on_two_nodes(run_dir: Path, job_id: str, iteration: int) -> List[str]:
    """Stage 0 (ranks 0,1) on one node, stage 1 (ranks 2,3) on the other, read from the hosts the job
    recorded (summary, manifest) and checked against SLURM's allocation; returns the hosts by rank."""
    summary = last_summary(run_dir)
    hosts = summary["hosts"]
    assert len(hosts) == 4, summary
    manifest = json.loads((run_dir / "checkpoints" / f"iter_{iteration:07d}" / "manifest.json").read_text())
    assert manifest["hosts"] == hosts and manifest["host"] == hosts[0], (manifest.get("hosts"), hosts)
    stages = pipeline_stages(tp=1, pp=2, dp=2)
    by_stage = {s: {hosts[r] for r in range(4) if stages[r] == s} for s in (0, 1)}
    assert [r for r in range(4) if stages[r] == 0] == [0, 1], stages
    assert len(by_stage[0]) == len(by_stage[1]) == 1 and by_stage[0] != by_stage[1], (hosts, stages)
    assert hosts == [job_nodes(job_id)[0]] * 2 + [job_nodes(job_id)[1]] * 2, (hosts, job_nodes(job_id))
    # The rank that logs the loss sits on the last stage, and recorded its own host.
    assert summary["logging_rank"] and stages[summary["rank"]] == 1 and summary["host"] == hosts[summary["rank"]]
    return hosts


def nodes_not_up() -> List[str]:
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "dev", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    return [
        line.split()[0]
        for line in out.stdout.splitlines()
        if line.split()[1].rstrip("*~#!%$@^-") not in ("idle", "mix", "alloc", "comp")
    ]


@pytest.fixture
def nodes_back():
    """After the test: every node of the dev cluster usable again (a node set down or drained is
    resumed; a dead slurmd is restarted by launch/slurm-dev-up.sh, which is idempotent)."""
    yield
    down = nodes_not_up()
    if down:
        subprocess.run(["scontrol", "update", f"NodeName={','.join(down)}", "State=RESUME"], timeout=30)
        if not wait_until_quiet(lambda: not nodes_not_up(), 20):
            subprocess.run(["bash", str(REPO / "launch" / "slurm-dev-up.sh")], timeout=120)
    assert not nodes_not_up(), subprocess.run(["sinfo", "-N"], capture_output=True, text=True).stdout


def wait_until_quiet(predicate, timeout_s: float, poll_s: float = 0.5):
    """``predicate()``'s first true value within ``timeout_s``, else its last (false) value; no error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    return predicate()


# ---- the srun line (no cluster needed) ---------------------------------------------------------


def test_srun_line_kills_the_step_when_a_rank_dies(tmp_path):
    """`--kill-on-bad-exit=1` on every srun line unless cluster.srun_args says otherwise."""
    from hydra import compose, initialize_config_dir

    from orchestrator.config.schema import register_configs, to_job_config

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = to_job_config(
            compose("config", overrides=["+experiment=gpt_pp2_dp2", "cluster=slurm_dev", f"run.dir={tmp_path}"])
        )
    line = sbatch.srun_line(sbatch.render_sbatch(cfg, 4, tmp_path))
    assert " --kill-on-bad-exit=1 " in line
    cfg.cluster.srun_args = ["--cpu-bind=none", "--kill-on-bad-exit=0"]
    line = sbatch.srun_line(sbatch.render_sbatch(cfg, 4, tmp_path))
    assert "--kill-on-bad-exit=1" not in line and " --cpu-bind=none --kill-on-bad-exit=0 " in line


# ---- end to end on SLURM -----------------------------------------------------------------------

# Iterations of the run across nodes: a few before the preemption, the rest after the requeue.
ACROSS_ITERS = REFERENCE_ITERS


@needs_two_nodes
def test_slurm_run_across_nodes_preempted_requeues_resumes_and_matches_local(tmp_path, cache_dir):
    """The acceptance run on the dev cluster: PP=2 x DP=2 as 4 tasks on 2 nodes through sbatch/srun,
    stage 0 and stage 1 on different nodes (recorded hosts), checkpoints, success with the job id,
    and a preemption while it trains (``scontrol requeue``: what SLURM's PreemptMode=REQUEUE does):
    SIGTERM -> save -> SLURM requeues -> resume (manifest check in the job) -> finish; the launcher
    waits through the requeue and reports success; every loss, before and after the resume point,
    equals an uninterrupted local run of the same config. (Issue 4's and issue 10's checks; the
    time-limit requeue, the job requeueing itself on USR2, is the one-rank test below.)"""
    n = ACROSS_ITERS
    common = SMALL + [f"run.root={tmp_path}", f"training.train_iters={n}", "checkpoint.save_interval=null"]
    run_dir = tmp_path / "slurm"
    # The uninterrupted reference (shared with the node-loss and hosts tests) runs while the SLURM job starts.
    ref = SharedReference(SMALL + [f"training.train_iters={n}"], cache_dir)
    cli = Cli(
        common + ["cluster=slurm_dev", *ACROSS_NODES, "run.name=slurm", "cluster.max_num_timeout=3"],
        cache_dir,
        tmp_path / "logs",
    )
    try:
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        wait_until(lambda: iterations_done(run_dir) >= 3, 400, "training on SLURM", cli)
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)  # the preemption
        wait_until(lambda: f"job {job_id} requeued (1 of at most 3)" in cli.stdout, 120, "the requeue", cli)
        local = ref.losses(400)
        assert cli.wait(420) == 0, cli.describe()
    finally:
        cli.kill()
    out = cli.stdout
    stops = [e["iteration"] for e in events(run_dir, "stopped")]
    assert len(stops) == 1 and 3 <= stops[0] < n, (stops, out[-2000:])

    # The launcher: waited through the requeue, then success with the job id.
    assert f"completed: iteration {n} |" in out and out.rstrip().endswith(f"| job {job_id}"), out

    # SLURM requeued and restarted it, then it completed (the batch script ends a moment after the
    # ranks have written their results).
    st = wait_until(lambda: (s := jobs.slurm_job_status(job_id)) and s.ended and s, 60, "SLURM to end the job")
    assert st.state == "completed" and st.restarts == 1, st

    # SLURM ran it as 4 tasks of one job on 2 nodes (sbatch + srun), each rank leaving a success result.
    folder = run_dir / "submitit"
    for rank in range(4):
        assert (folder / f"{job_id}_{rank}_result.pkl").exists()
        assert f"global_rank={rank}(4)" in (folder / f"{job_id}_{rank}_log.out").read_text()
    script = (folder / f"{job_id}_submission.sh").read_text()
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=2" in script
    assert "#SBATCH --partition=dev" in script
    assert "SOCKET_IFNAME" not in script  # gloo binds to the address of the node's hostname
    hosts = assert_stages_on_two_nodes(run_dir, job_id, n)
    print(f"hosts by rank: {hosts}")
    # Issue 29: before each attempt's training, the link check measured both directions of the one
    # cross-node pipeline link (ranks 0 <-> 2) and, unshaped, named nothing; the manifest has it too.
    checks = events(run_dir, "link_check")
    assert len(checks) == 2 and all(c["slow"] == [] and c["seconds"] < 2 for c in checks), checks
    assert {(x["src"], x["dst"], x["kind"]) for x in checks[0]["links"]} == {
        (hosts[0], hosts[2], "p2p"),
        (hosts[2], hosts[0], "p2p"),
    }, checks[0]
    assert "slow link:" not in out and "; no slow link" in out, out
    final_links = json.loads((run_dir / "checkpoints" / f"iter_{n:07d}" / "manifest.json").read_text())["link_check"]
    assert final_links["links"] == checks[1]["links"], final_links
    assert sbatch.srun_line(script).startswith("srun ")
    assert f"submitted job {job_id} (slurm): starting 4 ranks" in out, out
    assert json.loads((run_dir / "checkpoints" / f"iter_{n:07d}" / "manifest.json").read_text())["iteration"] == n

    # The stop saved a checkpoint (manifest last) and the next allocation resumed from it.
    ckpt = run_dir / "checkpoints" / f"iter_{stops[0]:07d}"
    assert json.loads((ckpt / "manifest.json").read_text())["iteration"] == stops[0]
    log = (folder / f"{job_id}_0_log.out").read_text()
    assert f"resumed from {ckpt} at iteration {stops[0]}" in log, log[-3000:]
    err = (folder / f"{job_id}_0_log.err").read_text()
    assert f"SLURM requeued job {job_id} itself (preemption)" in err, err[-3000:]

    # No iteration trained twice; the losses equal the uninterrupted run's, around the resume too.
    records = read_metrics(run_dir)
    assert [r["iteration"] for r in records] == list(range(1, n + 1))
    slurm = losses_by_iteration(run_dir)
    assert_losses_match(slurm, local, range(1, n + 1))

    rows = status_rows(tmp_path)
    row = rows["slurm"]
    assert row["state"] == "completed" and row["job"]["restarts"] == 1, row
    assert row["iteration"] == n and abs(row["lm_loss"] - local[n]) <= REL * local[n], row
    line = table_line(rows, "slurm")
    assert "completed after 1 requeue" in line and line.split()[-4:-2] == [f"{n}/{n}", f"{local[n]:.4f}"], line

    # The attempt history (issue 11): one attempt per allocation with its cause and the iteration it
    # reached, in `status` (--json and --history) and in the final checkpoint's manifest.
    expected = [(job_id, 0, "preempted", stops[0]), (job_id, 1, "completed", n)]
    attempts = row["attempts"]
    assert [(a["job_id"], a["attempt"], a["cause"], a["iteration"]) for a in attempts] == expected, attempts
    assert all(a["start"] and a["end"] and a["start"] < a["end"] for a in attempts), attempts
    final = json.loads((run_dir / "checkpoints" / f"iter_{n:07d}" / "manifest.json").read_text())
    assert [(h["attempt"], h["cause"], h["iteration"]) for h in final["history"]] == [e[1:] for e in expected]
    listing = subprocess.run(
        [sys.executable, "-m", "orchestrator", "status", str(tmp_path), "--history"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert f"job {job_id} attempt 0 " in listing and f"preempted (requeued)  iteration {stops[0]}" in listing, listing
    assert f"job {job_id} attempt 1 " in listing and f"completed  iteration {n}" in listing, listing


def run_time_min(job_id: str) -> int:
    """The job's run time so far, in whole minutes rounded up (``scontrol show job``'s RunTime)."""
    from orchestrator.slurm import parse_scontrol_job

    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=30, check=True)
    days, _, clock = parse_scontrol_job(out.stdout)["RunTime"].rpartition("-")
    h, m, sec = (int(x) for x in clock.split(":"))
    return int(days or 0) * 1440 + h * 60 + m + (1 if sec else 0)


def set_time_limit(job_id: str, minutes: int) -> None:
    subprocess.run(["scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}"], check=True, timeout=30)


# The node-loss run: short (gpt_tiny, 20 iterations) with a checkpoint every 5; the node goes after
# the first checkpoint, so the requeued attempt resumes from a checkpoint and retrains a few iterations.
NODE_LOSS_ITERS, NODE_LOSS_SAVE = REFERENCE_ITERS, 5


def complete_checkpoints(run_dir: Path) -> List[int]:
    """Iterations of the run's complete checkpoints (the manifest is written last)."""
    return sorted(int(p.parent.name[len("iter_") :]) for p in (run_dir / "checkpoints").glob("iter_*/manifest.json"))


def _is_task(proc) -> bool:
    """A SLURM task of ours (not one of its children, which share its environment)."""
    try:
        return "submitit.core._submit" in " ".join(proc.cmdline())
    except Exception:  # gone
        return False


def srun_killed(text: str, node: str) -> List[int]:
    """The tasks srun reported killed on ``node`` (``srun: error: node2: tasks 2-3: Killed``, or one
    line per task)."""
    killed: List[int] = []
    for spec in re.findall(rf"^srun: error: {re.escape(node)}: tasks? ([0-9,-]+): Killed$", text, re.M):
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            killed += range(int(lo), int(hi or lo) + 1)
    return sorted(killed)


@needs_two_nodes
def test_node_loss_ends_the_attempt_names_node_and_ranks_and_the_requeue_resumes(tmp_path, cache_dir, nodes_back):
    """Issue 10 item 3. PP=2 x DP=2 on two nodes; after the first checkpoint, every process of the job
    on the node of pipeline stage 1 dies at once (its ranks and their children are frozen, then
    SIGKILLed: what a node crash does to the job; SLURM's own daemons stay, so the node is usable
    afterwards and srun can report the tasks). The attempt ends within 60 s with a launcher message naming that node and
    those ranks; the job requeues itself (cluster.max_failures=1 of slurm_dev), resumes from the last
    complete checkpoint and finishes; every loss, of both attempts, equals an uninterrupted local run."""
    n = NODE_LOSS_ITERS
    common = SMALL + [f"run.root={tmp_path}", f"training.train_iters={n}", f"checkpoint.save_interval={NODE_LOSS_SAVE}"]
    run_dir = tmp_path / "slurm"
    # The uninterrupted reference (shared: the run across nodes usually made it already) while the job starts.
    ref = SharedReference(SMALL + [f"training.train_iters={n}"], cache_dir)
    cli = Cli(common + ["cluster=slurm_dev", *ACROSS_NODES, "run.name=slurm"], cache_dir, tmp_path / "logs")
    job_id = None
    try:
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        wait_until(lambda: iterations_done(run_dir) >= 1, 300, "training on SLURM", cli)
        tasks = {int(p.environ()["SLURM_PROCID"]): p for p in job_processes(job_id) if _is_task(p)}
        node = tasks[2].environ()["SLURMD_NODENAME"]  # where rank 2 (pipeline stage 1) runs
        ranks = sorted(r for r, p in tasks.items() if p.environ()["SLURMD_NODENAME"] == node)
        wait_until(
            lambda: NODE_LOSS_SAVE in complete_checkpoints(run_dir) and iterations_done(run_dir) > NODE_LOSS_SAVE,
            300,
            f"the checkpoint at iteration {NODE_LOSS_SAVE}",
            cli,
            poll_s=0.1,
        )
        # The tasks and their children (megatron's checkpoint writer starts a process per rank).
        victims = [q for r in ranks for q in [tasks[r], *tasks[r].children(recursive=True)]]
        reached = iterations_done(run_dir)
        t0 = time.monotonic()
        # All at once, as when a node dies: frozen first (a rank killed a moment before its peer on the
        # same node would let that peer see the broken connection and act on it), then killed.
        for p in victims:
            p.suspend()
        for p in victims:
            p.kill()
        said = wait_until(
            lambda: "requeued after a failure" in cli.stdout and cli.stdout,
            60,
            f"the launcher to report the loss of {node}",
            cli,
            poll_s=0.2,
        )
        elapsed = time.monotonic() - t0
        complete_at_loss = complete_checkpoints(run_dir)
        print(
            f"killed ranks {ranks} on {node} at iteration >= {reached}; the launcher reported it after "
            f"{elapsed:.1f} s; complete checkpoints then: {complete_at_loss}"
        )
        local = ref.losses(400)
        assert cli.wait(400) == 0, cli.describe()
        print(f"requeued attempt finished {time.monotonic() - t0:.1f} s after the kill")
    finally:
        cli.kill()  # cancels the job if it still runs
        if job_id is not None:
            end = wait_until_quiet(lambda: (s := jobs.slurm_job_status(job_id)) and s.ended and s, 60)
            leftovers = job_processes(job_id)
            for p in leftovers:  # nothing of the job may outlive the test (pids of this job only)
                p.kill()
    out = cli.stdout
    assert ranks == [2, 3], (ranks, node)
    assert "slow link:" not in out and len(events(run_dir, "link_check")) == 2  # issue 29: unshaped, both attempts
    assert not leftovers, leftovers

    # The message: the node and the ranks that died (srun's line), and the requeue.
    assert f"[orchestrator] job {job_id} failed: node {node} lost (ranks 2,3): " in said, said
    assert srun_killed(said, node) == ranks, said
    assert f"job {job_id} requeued after a failure (cluster.max_failures=1)" in said, said
    assert elapsed < 60, elapsed

    # The next attempt resumed from the last complete checkpoint and finished.
    resume_at = max(complete_at_loss)
    assert NODE_LOSS_SAVE <= resume_at <= reached, (complete_at_loss, reached)
    ckpt = run_dir / "checkpoints" / f"iter_{resume_at:07d}"
    log = (run_dir / "submitit" / f"{job_id}_0_log.out").read_text()
    assert f"resumed from {ckpt} at iteration {resume_at}" in log, log[-3000:]
    assert f"completed: iteration {n} |" in out and out.rstrip().endswith(f"| job {job_id}"), out
    assert end and end.state == "completed" and end.restarts == 1, end
    items = [a for a in attempts.attempts(history.read_records(run_dir)) if a.job_id == job_id]
    assert [(a.attempt, a.cause) for a in items] == [(0, "node failure"), (1, "completed")], items
    assert items[0].message.startswith(f"node {node} lost (ranks 2,3)"), items[0]
    assert items[1].start_iteration == resume_at and items[1].iteration == n, items

    # Every loss of both attempts (the retrained iterations too) equals the uninterrupted run's.
    records = read_metrics(run_dir)
    its = [r["iteration"] for r in records]
    cut = next((i for i in range(1, len(its)) if its[i] <= its[i - 1]), resume_at)  # where attempt 1 starts
    assert its[:cut] == list(range(1, cut + 1)) and cut >= resume_at, its
    assert its[cut:] == list(range(resume_at + 1, n + 1)), its
    for rec in records:
        it = rec["iteration"]
        assert abs(rec["lm_loss"] - local[it]) <= REL * abs(local[it]), (it, rec["lm_loss"], local[it])
    hosts = assert_stages_on_two_nodes(run_dir, job_id, n)
    assert hosts[2] == hosts[3] == node, (hosts, node)


ONE_RANK = ["parallelism=none", "cluster=slurm_dev", "cluster.tasks_per_node=1"]
"""The smallest SLURM job: one rank (what scancel and the requeue limits need; the layouts are tested above)."""
TWO_RANKS = ["parallelism=none", "parallelism.data_parallel_size=2", "cluster=slurm_dev", "cluster.tasks_per_node=2"]
"""Two ranks (DP=2) on one node: a rank killed while its peer waits on it in a collective."""


@needs_slurm
def test_scancel_is_reported_as_cancelled_within_60_s_and_not_requeued(tmp_path, cache_dir):
    """scancel while the launcher waits: reported as cancelled (exit 1, the production wait's
    message) within 60 s. scancel's SIGTERM also means "stop" to the job, and scontrol would requeue
    even a cancelled job, so the requeue contract (cluster.max_num_timeout=3 of slurm_dev) must
    check the state first: still cancelled, never restarted, some seconds later; no result file."""
    run_dir = tmp_path / "slurm"
    cli = Cli(
        SMALL
        + ONE_RANK
        + [f"run.root={tmp_path}", "training.train_iters=5000", "cluster.max_num_timeout=3", "run.name=slurm"],
        cache_dir,
        tmp_path / "logs",
    )
    try:
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        wait_until(lambda: iterations_done(run_dir) >= 2, 180, "training on SLURM", cli)
        t0 = time.monotonic()
        subprocess.run(["scancel", job_id], check=True, timeout=30)
        code = cli.wait(60)
        elapsed = time.monotonic() - t0
        print(f"launcher ended {elapsed:.1f} s after the scancel")
    finally:
        cli.kill()
    assert code == 1 and elapsed < 60, (code, elapsed, cli.describe())
    assert f"job {job_id} was cancelled" in cli.stderr, cli.describe()
    assert "Traceback" not in cli.stderr
    time.sleep(5)  # a wrong requeue would show by now
    st = jobs.slurm_job_status(job_id)
    assert st.state == "cancelled" and st.restarts == 0, st  # SIGTERM of scancel: stopped, not requeued
    assert not list((run_dir / "submitit").glob("*_result.pkl"))
    assert status.run_status(run_dir).state == "cancelled"
    rows = status_rows(tmp_path)
    assert rows["slurm"]["state"] == "cancelled" and rows["slurm"]["iteration"] >= 2, rows["slurm"]
    assert table_line(rows, "slurm").split()[1:3] == ["cancelled", job_id]


def run_files(run_dir: Path) -> Dict[str, tuple]:
    """Every file of a run directory with its size and mtime (to show that nothing changed)."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(run_dir.rglob("*"))
        if p.is_file()
    }


def stop_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "stop", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )


@needs_slurm
def test_signals_to_a_slurm_launcher_detach_and_stop_saves(tmp_path, cache_dir):
    """Two one-rank jobs at once. SIGHUP to the launcher waiting on the first (a dropped SSH session),
    SIGINT (Ctrl-C) to the one waiting on the second: each launcher exits 0 with one line (the job id,
    `status` to follow it, `stop` to stop it) and both jobs are still RUNNING (squeue): never cancelled.
    The second completes on its own. `orchestrator stop` ends the first: exit 0 once it stopped, its rank
    saved the iteration it stopped at (complete, with its manifest, though checkpoint.save_interval=1000)
    and left without a requeue; `status` says `stopped (by request)`. Stop again, or stop the completed
    one: exit 2, one line each, nothing changed on disk."""
    hup, ctrl_c = tmp_path / "hup", tmp_path / "int"  # 5000 iterations: the scancel test's sample indices
    common = SMALL + ONE_RANK + [f"run.root={tmp_path}", "checkpoint.save_interval=1000"]
    a = Cli(common + ["run.name=hup", "training.train_iters=5000"], cache_dir, tmp_path / "logs_hup")
    b = Cli(common + ["run.name=int", "training.train_iters=20"], cache_dir, tmp_path / "logs_int")
    codes, states = [], []
    try:
        ids = [wait_until(lambda d=d: submitted_job(d), 180, "the submission", c) for d, c in ((hup, a), (ctrl_c, b))]
        for d, c, job_id, sig in ((ctrl_c, b, ids[1], signal.SIGINT), (hup, a, ids[0], signal.SIGHUP)):
            wait_until(lambda d=d: iterations_done(d) >= 2, 240, "training on SLURM", c)
            c.proc.send_signal(sig)
            codes.append(c.wait(30))
            states += subprocess.run(
                ["squeue", "-h", "-j", job_id, "-o", "%i %T"], capture_output=True, text=True, timeout=30
            ).stdout.split()
        before = iterations_done(hup)
        stopped = stop_cli("hup", "--root", str(tmp_path))  # before the second ends: the first trains no longer
        done = wait_until(lambda: jobs.slurm_job_status(ids[1]).state == "completed", 400, "the second job to end")
    finally:
        a.kill()
        b.kill()
    for cli, job_id, sig in ((b, ids[1], "SIGINT"), (a, ids[0], "SIGHUP")):
        assert codes.pop(0) == 0, cli.describe()
        (line,) = [x for x in cli.stderr.splitlines() if "detached" in x]
        assert (
            f"detached ({sig}): SLURM job {job_id} runs on" in line
            and "orchestrator status" in line
            and "orchestrator stop" in line
        ), cli.describe()
    assert states == [ids[1], "RUNNING", ids[0], "RUNNING"], states
    assert done and "completed: iteration 20" not in b.stdout  # it completed after its launcher left
    assert status.run_status(ctrl_c).state == "completed"
    # `orchestrator stop`: the stop iteration saved, not requeued, status says so
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    (attempt,) = [x for x in attempts.attempts(history.read_records(hup)) if x.job_id == ids[0]]
    assert attempt.cause == "by request" and not attempt.requeued and attempt.iteration >= before, attempt
    assert attempt.iteration in complete_checkpoints(hup), (attempt, complete_checkpoints(hup))
    assert f"resumes from {hup}/checkpoints/iter_{attempt.iteration:07d}" in stopped.stdout, stopped.stdout
    st = wait_until(lambda: (x := jobs.slurm_job_status(ids[0])) and x.ended and x, 60, "SLURM to end the job")
    assert st.restarts == 0 and not [r for r in history.read_records(hup) if r["event"] == "requeued"], st
    rows = status_rows(tmp_path)
    assert table_line(rows, "hup").split()[1:4] == ["stopped", "(by", "request)"], rows["_table"]
    # bad input: stopped twice, a finished run, an unknown one
    for args, what in ((["hup"], "is not live"), (["int"], "is not live"), (["nope"], "no run directory")):
        files = {d: run_files(d) for d in (hup, ctrl_c)}
        again = stop_cli(*args, "--root", str(tmp_path))
        assert again.returncode == 2 and again.stdout == "", again
        assert again.stderr.startswith("error: ") and len(again.stderr.splitlines()) == 1 and what in again.stderr
        assert files == {d: run_files(d) for d in (hup, ctrl_c)}


@needs_slurm
def test_killed_rank_ends_the_job_instead_of_hanging(tmp_path, cache_dir):
    """SIGKILL one rank (what the OOM killer does): no result file from it; srun ends the step
    (--kill-on-bad-exit=1), the launcher reports the failure, the job does not hang. Without
    failure retries (cluster.max_failures=0: the retry is the node-loss test's)."""
    run_dir = tmp_path / "slurm"
    cli = Cli(
        SMALL
        + TWO_RANKS
        + [f"run.root={tmp_path}", "training.train_iters=5000", "cluster.max_failures=0", "run.name=slurm"],
        cache_dir,
        tmp_path / "logs",
    )
    try:
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        wait_until(lambda: iterations_done(run_dir) >= 2, 180, "training on SLURM", cli)
        victim = wait_until(lambda: rank_process(run_dir, 1), 30, "rank 1's process")
        t0 = time.monotonic()
        victim.kill()
        code = cli.wait(60)
        elapsed = time.monotonic() - t0
        print(
            f"launcher ended {elapsed:.1f} s after the {'scancel' if 'scancel' in cli.out_path.parent.parent.name else 'kill'}"
        )
        wait_until(lambda: jobs.slurm_job_status(job_id).state not in ("running", "pending"), 60, "the job to end")
    finally:
        cli.kill()
    assert code == 1 and elapsed < 60, (code, elapsed, cli.describe())
    assert f"error: job {job_id}" in cli.stderr, cli.describe()
    assert "task 1: Killed" in (run_dir / "submitit" / f"{job_id}_0_log.err").read_text()  # srun saw it
    assert rank_process(run_dir, 0) is None  # nobody left blocked
    st = status.run_status(run_dir)
    assert st.state in ("failed", "cancelled") and st.job.results.get(1) is None, st  # no result from the killed rank
    # one rank of the node killed: a crash, not a node failure; cluster.max_failures=0: not requeued
    assert attempt_causes(run_dir, job_id) == [(0, "crashed", False)], history.read_records(run_dir)
    assert jobs.slurm_job_status(job_id).restarts == 0
    # the killed rank is the recorded cause, not rank 0 that saw its connection close (srun names it)
    ended = [a for a in attempts.attempts(history.read_records(run_dir)) if a.job_id == job_id][-1]
    assert ended.message.startswith("rank(s) [1] died without a result (exit by signal 9, SIGKILL, per srun: "), (
        ended.message
    )


def attempt_causes(run_dir: Path, job_id: str) -> List[tuple]:
    return [
        (a.attempt, a.cause, a.requeued) for a in attempts.attempts(history.read_records(run_dir)) if a.job_id == job_id
    ]


def trains_after_first_stop(run_dir: Path) -> bool:
    """Whether the run has trained an iteration after its first ``stopped`` event (the next attempt)."""
    try:
        stops = events(run_dir, "stopped")
    except (OSError, json.JSONDecodeError):  # not written yet, or a line being written
        return False
    return bool(stops) and iterations_done(run_dir) > stops[0]["iteration"]


@needs_slurm
def test_time_limit_requeues_and_resumes_then_finds_the_requeues_used_up(tmp_path, cache_dir):
    """SLURM's time limit, twice, on one rank (--signal=USR2@110, cluster.max_num_timeout=1): the first
    USR2 -> save -> the job requeues itself (``scontrol requeue``, requeue 1 of at most 1) -> SLURM
    restarts it -> it resumes from that checkpoint; the second attempt's USR2 finds the one requeue
    used up, so it saves and stops (cause ``timeout``, not requeued), and the launcher exits 1 saying so.
    Each attempt gets its limit once it trains: its run time so far, rounded up, + 1 minute (60-120 s
    left, the signal due at once), so SLURM's time-limit check (every 30 s) sends the signal within ~30 s
    and the save has over a minute; slurm_dev's 15 minutes hold until then, however long start-up takes."""
    run_dir = tmp_path / "slurm"
    cli = Cli(
        SMALL
        + ONE_RANK
        + [
            f"run.root={tmp_path}",
            "run.name=slurm",
            "training.train_iters=100000",
            "checkpoint.save_interval=null",
            "cluster.signal_delay_s=110",
            "cluster.max_num_timeout=1",
        ],
        cache_dir,
        tmp_path / "logs",
    )
    try:
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        wait_until(lambda: iterations_done(run_dir) >= 2, 240, "training on SLURM", cli)
        set_time_limit(job_id, run_time_min(job_id) + 1)
        wait_until(lambda: f"job {job_id} requeued (1 of at most 1)" in cli.stdout, 120, "the time-limit requeue", cli)
        set_time_limit(job_id, 15)  # the next attempt's limit, until it trains
        wait_until(lambda: trains_after_first_stop(run_dir), 300, "the requeued attempt to train", cli)
        set_time_limit(job_id, run_time_min(job_id) + 1)
        code = cli.wait(420)
    finally:
        cli.kill()
    assert code == 1, cli.describe()
    stops = [e["iteration"] for e in events(run_dir, "stopped")]
    assert attempt_causes(run_dir, job_id) == [(0, "timeout", True), (1, "timeout", False)], history.read_records(
        run_dir
    )
    assert len(stops) == 2 and stops[0] < stops[1], stops
    (line,) = [x for x in cli.stderr.splitlines() if x.startswith("error:")]
    assert (
        line.startswith(f"error: job {job_id}: reached its time limit")
        and "its requeues are used up (1 of cluster.max_num_timeout=1)" in line
    ), cli.describe()
    requeued = [r for r in history.read_records(run_dir) if r["event"] == "requeued"]
    assert [(r["job_id"], r["restart_count"], r["signal"]) for r in requeued] == [(job_id, 0, "SIGUSR2")], requeued
    log = (run_dir / "submitit" / f"{job_id}_0_log.out").read_text()
    ckpt = run_dir / "checkpoints" / f"iter_{stops[0]:07d}"
    assert f"resumed from {ckpt} at iteration {stops[0]}" in log, log[-3000:]
    assert (
        json.loads((run_dir / "checkpoints" / f"iter_{stops[1]:07d}" / "manifest.json").read_text())["iteration"]
        == stops[1]
    )
    err = (run_dir / "submitit" / f"{job_id}_0_log.err").read_text()
    assert f"requeued SLURM job {job_id}: requeue 1 of at most 1" in err, err[-3000:]
    assert f"SLURM job {job_id} restarted: requeue 1 of at most 1 (SLURM_RESTART_COUNT=1)" in err, err[-3000:]
    st = wait_until(lambda: (x := jobs.slurm_job_status(job_id)) and x.ended and x, 60, "SLURM to end the job")
    assert st.restarts == 1, st  # the first time limit's requeue only
    listing = subprocess.run(
        [sys.executable, "-m", "orchestrator", "status", str(tmp_path), "--history"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert f"timeout (requeued)  iteration {stops[0]}" in listing and f"timeout  iteration {stops[1]}" in listing, (
        listing
    )


@needs_slurm
def test_a_nan_is_never_requeued(tmp_path, cache_dir):
    """optimizer.lr=1000 on SLURM with cluster.max_failures=1 left: the NaN stop ends the job (exit 1,
    one line), the attempt's cause is ``nan`` and SLURM never restarts it."""
    run_dir = tmp_path / "slurm"
    cli = Cli(
        SMALL
        + ONE_RANK
        + [
            f"run.root={tmp_path}",
            "run.name=slurm",
            "training.train_iters=40",
            "optimizer.lr=1000",
            "cluster.max_failures=1",
            "training.spike.factor=null",
        ],  # the spike stop would end it first (nan's turn)
        cache_dir,
        tmp_path / "logs",
    )
    try:
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        code = cli.wait(400)
    finally:
        cli.kill()
    assert code == 1, cli.describe()
    (line,) = [x for x in cli.stderr.splitlines() if x.startswith("error:")]
    assert re.search(r"non-finite (gradient norm|lm loss) \S+ at iteration \d+", line), cli.describe()
    st = wait_until(lambda: (x := jobs.slurm_job_status(job_id)) and x.ended and x, 60, "SLURM to end the job")
    time.sleep(3)  # a wrong requeue would show by now
    assert jobs.slurm_job_status(job_id).restarts == 0, st
    assert attempt_causes(run_dir, job_id) == [(0, "nan", False)]
    assert f"job {job_id} requeued" not in cli.stdout, cli.stdout
    assert "Traceback" not in cli.stderr


# ---- a late time-limit signal (no cluster needed) ----------------------------------------------

_LATE_USR2 = r"""
import os, signal, subprocess, sys, time
from orchestrator.runtime.faults.preempt import StopRequest
stop = StopRequest().install()
if sys.argv[1] == "done":
    stop.training_done()
class SlowTeardown:
    def __del__(self):
        time.sleep(1.5)
keep = SlowTeardown()  # destroyed during interpreter finalization, after Python's handlers are gone
subprocess.Popen(["sh", "-c", f"sleep 0.7; kill -USR2 {os.getpid()}"])
"""


def test_usr2_during_teardown_after_training_does_not_kill_the_task(tmp_path):
    """Seen on the dev cluster: the time-limit USR2 reached a job that had just finished, during
    its teardown; the tasks died of it (exit 140) after writing their success results and SLURM
    recorded the job FAILED. After StopRequest.training_done() it is ignored."""
    script = tmp_path / "late_usr2.py"
    script.write_text(_LATE_USR2)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    plain = subprocess.run([sys.executable, str(script), "plain"], cwd=REPO, env=env, timeout=60)
    assert plain.returncode == -signal.SIGUSR2  # the failure mode, reproduced
    done = subprocess.run([sys.executable, str(script), "done"], cwd=REPO, env=env, timeout=60)
    assert done.returncode == 0


# ---- the stop signals reach the rank's children too (no cluster needed) -------------------------

_WRITER_QUEUE = r"""
import os, signal, time
if __name__ == "__main__":  # the Manager is spawned: it imports this file again (keep that cheap)
    from orchestrator.runtime.rank import mcore
    from orchestrator.runtime.training import checkpoint
    signal.signal(signal.SIGUSR2, lambda *a: print("rank handler ran", flush=True))  # the rank's StopRequest
    for mode in ("plain", "shielded"):
        mcore.set_write_results_queue(None)
        if mode == "shielded":
            checkpoint.start_writer_queue()
        queue = mcore.write_results_queue_starter()()  # what megatron's torch_dist writer uses at every save
        for sig in (signal.SIGUSR2, signal.SIGTERM):  # what SLURM sends every process of the step
            os.kill(queue._manager._process.pid, sig)
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(1)
        try:
            queue.put("saved")
            print(mode, "queue:", queue.get(timeout=10), flush=True)
        except Exception as exc:
            print(mode, "queue broken:", type(exc).__name__, flush=True)
        os.kill(queue._manager._process.pid, signal.SIGKILL)  # shielded, it ignores the stop signals
"""


@pytest.mark.mcore_lines
def test_checkpoint_writer_survives_the_stop_signals(tmp_path):
    """Seen on the dev cluster: SLURM's time-limit USR2 (and scancel's SIGTERM) reach every process of
    the step, megatron's checkpoint writer keeps its results in a multiprocessing Manager (a spawned
    process, default dispositions) that died of it, and the next save failed (EOFError). Started
    through the runtime it survives both, and the rank's own handler still runs."""
    script = tmp_path / "writer_queue.py"
    script.write_text(_WRITER_QUEUE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with open(tmp_path / "out.txt", "w") as f:  # a file: a stray Manager cannot hold a pipe open
        subprocess.run(
            [sys.executable, str(script)], cwd=REPO, env=env, stdout=f, stderr=subprocess.DEVNULL, timeout=600
        )  # two spawned Managers: 130 s at load 24
    out = (tmp_path / "out.txt").read_text()
    assert "plain queue broken:" in out, out  # the failure mode, reproduced
    assert "shielded queue: saved" in out and out.count("rank handler ran") == 2, out


# ---- issue 29: a slow link, named before training --------------------------------------------------


def _veth(node: str) -> str:
    """The host end of a dev-cluster node's veth pair (launch/slurm-dev-lib.sh: node<i> -> veth-node<i>)."""
    return f"veth-node{int(node[len('node') :])}"


@needs_two_nodes
def test_slow_link_named_by_check_links_and_refused_before_iteration_1(tmp_path, cache_dir):
    """One node's link shaped with tc (tbf, 100 Mbit/s into it; the fault lock held, the qdisc always
    removed): ``check links`` names that link with both numbers and exits 1; a training job with
    ``cluster.link_check.action=refuse`` stops before iteration 1 with one ``error:`` line, exit 2.
    PP=2 on two nodes, one rank on each (the one cross-node pipeline link, as ranks 0 <-> 2 of the PP2 x DP2
    run across nodes: half the rank start-ups). The unshaped case (no warning) is asserted on that run above."""
    first, second = _NODES[:2]
    pin = [f"cluster.exclude={','.join(_NODES[2:])}"] if len(_NODES) > 2 else []
    pp2 = ["parallelism.data_parallel_size=1", "cluster.nodes=2", "cluster.tasks_per_node=1"]
    common = SMALL + ["cluster=slurm_dev", *pp2, *pin, f"run.root={tmp_path}", "training.train_iters=2"]
    veth = _veth(second)
    with open("/tmp/dev-fault.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subprocess.run(
            [
                "tc",
                "qdisc",
                "add",
                "dev",
                veth,
                "root",
                "tbf",
                "rate",
                "100mbit",
                "burst",
                "32kbit",
                "latency",
                "400ms",
            ],
            check=True,
            timeout=30,
        )
        try:
            check = Cli(["check", "links", *common, "run.name=check"], cache_dir, tmp_path / "logs_check")
            try:
                assert check.wait(240) == 1, check.describe()
            finally:
                check.kill()
            refused = Cli(
                [*common, "run.name=refused", "cluster.link_check.action=refuse"], cache_dir, tmp_path / "logs_refused"
            )
            try:
                assert refused.wait(240) == 2, refused.describe()
            finally:
                refused.kill()
        finally:
            subprocess.run(["tc", "qdisc", "del", "dev", veth, "root"], timeout=30)
    # check links: every link measured, the slow one (into the shaped node) named with both numbers
    slow = [ln for ln in check.stdout.splitlines() if "slow link:" in ln]
    assert len(slow) == 1 and f"slow link: {first} -> {second} (ranks 0 -> 1, pipeline neighbours) over dev0" in slow[0]
    measured, reference = (float(x) for x in re.search(r": ([\d.]+) Gbit/s vs ([\d.]+) Gbit/s", slow[0]).groups())
    assert measured < 0.2 < 2 < reference, slow[0]  # 100 Mbit/s shaped; the other direction free
    assert f"cluster.exclude={first} or {second}" in slow[0] and "GLOO_SOCKET_IFNAME" in slow[0]
    assert f"p2p       {second} -> {first}" in check.stdout and "1 slow" in check.stdout, check.stdout
    # refuse: the same line, before iteration 1, as the launcher's one error line; not requeued
    err = [ln for ln in refused.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(
        f"error: cluster.link_check.action=refuse: slow link: {first} -> {second}"
    ), refused.describe()
    assert "iteration 1/" not in refused.stdout and "params on rank 0" not in refused.stdout, refused.stdout
    assert not (tmp_path / "refused" / "metrics.jsonl").exists() or not read_metrics(tmp_path / "refused")
    assert "requeued" not in refused.stdout, refused.stdout


@needs_slurm
def test_a_slurm_job_is_never_ended_by_an_early_signal_or_an_unreadable_state(tmp_path, cache_dir, monkeypatch):
    """issue 39, one real SLURM job, its launcher's wait run in this process:

    * SIGINT, SIGTERM, SIGHUP at the instant before the wait's own handlers are in place -- the entry's handler
      (signals.interrupt: a KeyboardInterrupt) still installed, as between the submission and the wait -- each
      detach: the job is still RUNNING/PENDING (squeue) after each. Before, that KeyboardInterrupt scancelled it.
    * then scontrol and squeue fail for the wait's own calls (a PATH shim answering as an unreachable controller,
      exit 1) for 18 s, past the wait's 15 s grace for an ended job: the state is UNREADABLE, polled again, never
      the job's end -- the wait goes on (a SIGINT ends it: a detach) and the job runs on. Taken as UNKNOWN, the
      wait reported the job ended and scancelled it. The test scancels it."""
    import shutil
    import threading

    import submitit

    from orchestrator.config.compose import compose_config
    from orchestrator.submit import signals
    from orchestrator.submit.wait import wait

    real_squeue = shutil.which("squeue")
    args = SMALL + ONE_RANK + [f"run.root={tmp_path}", "run.name=early", "training.train_iters=5000"]
    proc = subprocess.run(
        [sys.executable, "-m", "orchestrator", *args, "cluster.wait=false"],
        cwd=REPO,
        env=dict(os.environ, ORCHESTRATOR_CACHE=str(cache_dir)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "early"
    job_id = submitted_job(run_dir)
    (record,) = [r for r in history.read_records(run_dir) if r.get("event") == "submitted"]
    job = submitit.SlurmJob(folder=record["folder"], job_id=job_id, tasks=(0,))
    cfg = compose_config(args)
    shim = tmp_path / "shim"
    shim.mkdir()
    for tool in ("scontrol", "squeue"):  # fails for this process's own calls only (the job's are its children's)
        (shim / tool).write_text(
            f'#!/bin/sh\nif [ "$PPID" = "{os.getpid()}" ]; then echo x >> {shim}/{tool}.failed; echo "slurm_load_jobs '
            f'error: Unable to contact slurm controller (connect failure)" >&2; exit 1; fi\nexec {shutil.which(tool)} "$@"\n'
        )
        (shim / tool).chmod(0o755)
    previous = {sig: signal.getsignal(sig) for sig in signals.SIGNALS}
    monkeypatch.setattr(signals, "_PENDING", None)  # what the entry's handler remembers
    monkeypatch.setattr(signals, "_PENDING_EXC", None)
    got, states = [], []

    def waited(after_s: float) -> None:
        timer = threading.Timer(after_s, os.kill, (os.getpid(), sig))
        timer.start()
        try:
            wait(job, cfg, 1, own_signals=False)  # no handlers of its own: only the entry's
        except BaseException as exc:  # noqa: BLE001 - a KeyboardInterrupt, or the failure the test names
            got.append(exc)
        finally:
            timer.cancel()
        time.sleep(2)  # a scancel shows in squeue at once
        run = subprocess.run([real_squeue, "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
        states.append(run.stdout.strip())

    try:
        for sig in signals.SIGNALS:
            signal.signal(sig, signals.interrupt)
            waited(1.0)
        monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
        sig = signal.SIGINT
        waited(18.0)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        subprocess.run(["scancel", job_id], capture_output=True, timeout=30)
    assert [type(e).__name__ for e in got] == ["Detached"] * 4, got
    assert [e.signum for e in got] == [*signals.SIGNALS, signal.SIGINT] and all(e.job_id == job_id for e in got), got
    assert all(s in ("RUNNING", "PENDING") for s in states), states
    failed = {t: len((shim / f"{t}.failed").read_text().split()) for t in ("scontrol", "squeue")}
    assert failed["scontrol"] >= 5 and failed["squeue"] >= 5, failed  # the wait polled an unreadable state
