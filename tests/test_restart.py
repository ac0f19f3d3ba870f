"""In-place restarts (``cluster.max_restarts``, runtime/start/inplace.py): bad input, and a SLURM job whose killed
rank restarts all ranks inside the same allocation. (The local restart, and restarts used up: test_train.py.)

Time (2 cores, load 8-17 from the other helpers): the SLURM test ~90 s.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REFERENCE_ITERS, REPO, SharedReference, agent_worker, read_metrics, run_cli
from test_slurm_train import (  # noqa: F401
    _NODES,
    ACROSS_NODES,
    SMALL,
    Cli,
    assert_losses_match,
    iterations_done,
    job_nodes,
    needs_two_nodes,
    nodes_back,
    submitted_job,
    wait_until,
)

from orchestrator.ckpt import attempts, history
from orchestrator.submit import jobs


@pytest.mark.parametrize(
    "override, key",
    [
        (["cluster.spare_nodes=1", "cluster.max_restarts=1"], "cluster.spare_nodes=1"),
        (["cluster=slurm_dev", "cluster.max_restarts=-1"], "cluster.max_restarts=-1"),
        (["cluster=slurm_dev", "cluster.spare_nodes=1"], "cluster.spare_nodes=1"),
    ],
)
def test_bad_restart_settings_are_one_line_before_anything_is_queued(tmp_path, cache_dir, override, key):
    """Spares on a local job, a negative count, spares without restarts: one `error:` line naming the key and
    the fix, exit 2, no run directory."""
    proc = run_cli(SMALL + [f"run.root={tmp_path}", "run.name=bad", *override], cache=cache_dir, check=False)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {key}:"), proc.stderr
    assert "fix: " in lines[0] and not (tmp_path / "bad").exists()


RESTART_ITERS = REFERENCE_ITERS
RESTART_SAVE = 4


def needs_three_nodes(test):
    """:func:`needs_two_nodes`, and skipped, with the reason, on a dev cluster of fewer than 3 nodes (a spare)."""
    test = pytest.mark.skipif(
        len(_NODES) < 3,
        reason=f"the dev cluster has {len(_NODES)} node(s) {_NODES}; a job of "
        "2 nodes and a spare needs 3 (launch/slurm-dev-up.sh --nodes 3)",
    )(test)
    return needs_two_nodes(test)


@contextlib.contextmanager
def drained(node: str):
    """``node`` drained in SLURM (what an administrator does to a bad node; its running job steps go on), under the
    dev cluster's fault lock; resumed after."""
    with open("/tmp/dev-fault.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            subprocess.run(
                ["scontrol", "update", f"NodeName={node}", "State=DRAIN", "Reason=test_restart"], check=True, timeout=30
            )
            yield
        finally:
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], timeout=30)


def _spare_node_job(tmp_path, cache_dir):
    """The 2-node SLURM job with one spare node and one in-place restart that the tests below attack, started
    (its run directory, the uninterrupted local reference of the same math, the launcher)."""
    common = SMALL + [
        f"run.root={tmp_path}",
        f"training.train_iters={RESTART_ITERS}",
        f"checkpoint.save_interval={RESTART_SAVE}",
    ]
    ref = SharedReference(SMALL + [f"training.train_iters={RESTART_ITERS}"], cache_dir)  # made by the run across nodes
    cli = Cli(
        common
        + ["cluster=slurm_dev", *ACROSS_NODES, "run.name=slurm", "cluster.max_restarts=1", "cluster.spare_nodes=1"],
        cache_dir,
        tmp_path / "logs",
    )
    return tmp_path / "slurm", ref, cli


@needs_three_nodes
def test_in_place_restart_of_a_killed_rank_on_a_spare_node_keeps_the_slurm_job_and_its_losses(
    tmp_path,
    cache_dir,
    nodes_back,  # noqa: F811 (the fixture, imported from conftest's helpers)
):
    """Acceptance of issue 28: a 2-node PP2 x DP2 job with cluster.max_restarts=1 and cluster.spare_nodes=1 (3
    nodes allocated). After iteration 10 the node of rank 2 (or 0: not the first node, which hosts the rendezvous) is
    drained and that rank killed (kill -9): the same SLURM
    job (never requeued) restarts all ranks in its allocation from the checkpoint at 8; the drained node fails its
    health check and is left out, the spare takes its place (the final manifest's hosts), and the job completes.
    Every loss, the retrained ones too, equals an uninterrupted local run's (1e-5 rel.); the history shows the
    restart apart from requeues. Prints the time from the kill to the first new iteration, next to the job's own
    start-up and checkpoint load."""
    n = RESTART_ITERS
    run_dir, ref, cli = _spare_node_job(tmp_path, cache_dir)
    try:
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        wait_until(lambda: iterations_done(run_dir) >= 10, 400, "iteration 10 on SLURM", cli, poll_s=0.1)
        # a rank of the node that does not host the rendezvous store (the job's first node, never replaced)
        first = job_nodes(job_id)[0]
        rank, victim = next(
            (r, p)
            for r in (2, 0)
            if (p := wait_until(lambda r=r: agent_worker(run_dir, r), 30, f"rank {r}"))
            and p.environ()["SLURMD_NODENAME"] != first
        )
        node = victim.environ()["SLURMD_NODENAME"]
        with drained(node):
            victim.kill()
            killed_at = time.time()
            resumed = wait_until(
                lambda: next((r for r in history.read_records(run_dir) if r["event"] == "restart_resumed"), None),
                300,
                "the first iteration after the restart",
                cli,
                poll_s=0.1,
            )
        assert cli.wait(400) == 0, cli.describe()
    finally:
        cli.kill()
    out = cli.stdout
    assert f"completed: iteration {n} |" in out and out.rstrip().endswith(f"| job {job_id}"), out[-3000:]
    assert "restarting all ranks in place: restart 1 of cluster.max_restarts=1" in out, out[-3000:]
    assert f"node {node} failed its health check and is left out: SLURM has the node" in out, out[-3000:]
    spare = re.search(rf"spare node (\S+) takes the place of node {node}", out)
    assert spare and spare.group(1) != node, out[-3000:]
    st = wait_until(lambda: (s := jobs.slurm_job_status(job_id)) and s.ended and s, 60, "SLURM to end the job")
    assert st.state == "completed" and st.restarts == 0, st  # one job, never requeued
    hosts = json.loads((run_dir / "checkpoints" / f"iter_{n:07d}" / "manifest.json").read_text())["hosts"]
    assert spare.group(1) in hosts and node not in hosts, (hosts, node)

    starts = [a for a in attempts.attempts(history.read_records(run_dir)) if a.job_id == job_id]
    assert [(a.attempt, a.restart, a.cause, a.restarted) for a in starts] == [
        (0, 0, "crashed", True),
        (0, 1, "completed", False),
    ], starts
    assert starts[0].failed == [rank] and starts[1].start_iteration == 8, starts
    # the killed rank is the recorded cause (its agent saw the signal), not a peer whose connection broke (issue 39)
    killed = f"rank {rank} ({node}) died: exit by signal 9, SIGKILL; then rank "
    assert starts[0].message.startswith(killed), starts[0]
    records = read_metrics(run_dir)
    its = [r["iteration"] for r in records]
    cut = next(i for i in range(1, len(its)) if its[i] <= its[i - 1])  # where the restarted ranks' records start
    assert its[:cut] == list(range(1, cut + 1)) and cut >= 10 and its[cut:] == list(range(9, n + 1)), its
    # Every loss, of the first start and of the restarted ranks (iterations 9.. again), equals the uninterrupted
    # run's (1e-5 rel.; the reference shared with the SLURM and hosts tests).
    local = ref.losses(300)
    for rec in records:
        assert_losses_match({rec["iteration"]: rec["lm_loss"]}, local, [rec["iteration"]])
    listing = run_cli(["status", str(tmp_path), "--history"], cache=cache_dir).stdout
    assert f"job {job_id} attempt 0 restart 1 " in listing and "crashed (restarted in place; " in listing, listing
    assert f"(restarted in place; no word from rank(s) {rank} after the failure)" in listing and killed in listing

    start_up = records[0]["time"] - next(r["time"] for r in history.read_records(run_dir) if r["event"] == "submitted")
    log = (run_dir / "submitit" / f"{job_id}_0_log.out").read_text()
    print(
        f"kill -9 of rank {rank} on {node} (drained; spare {spare.group(1)}): the first new iteration "
        f"{resumed['time'] - killed_at:.1f} s after the kill (recorded: {starts[1].recovery_s:.1f} s from the failure); "
        f"the job's own start-up to its first iteration {start_up:.1f} s; "
        f"{[ln for ln in log.splitlines() if 'loaded in' in ln][-1:]}"
    )


def test_a_spare_marks_a_dead_node_left_out_and_takes_its_place(tmp_path):
    """Issue 39: a node that dies cannot write its own "left out" mark. A waiting spare finds the active node whose
    agent has not beaten (``agent_<host>``) for ``dead_after_s``, marks it on its behalf (once, naming the silence)
    and claims its place; the first node (the rendezvous store) is never marked. Before: the spare waited for a mark
    that never came (here until the job's end: None)."""
    import os
    import socket
    import threading

    from orchestrator.runtime.start import spares

    job_dir = tmp_path / "agents" / "7" / "attempt_0"
    job_dir.mkdir(parents=True)
    for task, (host, age) in enumerate((("node1", 100), ("node2", 100), ("node4", 0))):  # node1: the store
        (job_dir / f"agent_{host}").write_text(f"{task}\n")
        os.utime(job_dir / f"agent_{host}", (time.time() - age, time.time() - age))
    ended = threading.Timer(5.0, lambda: (job_dir / "done").write_text("x"))
    ended.start()
    try:
        took = spares.wait_for_a_place(str(tmp_path), job_dir, poll_s=0.1, first="node1", dead_after_s=30)
    finally:
        ended.cancel()
    assert took == "node2" and (job_dir / "taken_node2").exists(), took
    mark = json.loads((job_dir / "left_out_node2.json").read_text())
    assert mark["by"] == socket.gethostname() and mark["problem"].startswith("its agent has been silent for "), mark
    assert not (job_dir / "left_out_node1.json").exists() and not (job_dir / "left_out_node4.json").exists()
    said = [r for r in history.read_records(tmp_path) if r["event"] == "node_left_out"]
    assert [(r["host"], r["task"]) for r in said] == [("node2", 1)], said  # its task writes no result
    assert said[0]["message"].startswith("node node2 is dead (its agent has been silent for "), said
    assert not spares.leave(str(tmp_path), job_dir, "node2", "again")  # said once


@contextlib.contextmanager
def dead(node: str, job_id: str):
    """``node`` dies for job ``job_id``: its slurmd and every process of that job in the node's namespace are killed
    (kill -9; other jobs' ranks there are left alone), under the dev cluster's fault lock; afterwards its slurmd is
    started again (launch/slurm-dev-up.sh is idempotent) and the node resumed if SLURM had set it down."""
    with open("/tmp/dev-fault.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            pids = subprocess.run(["ip", "netns", "pids", f"slurm-{node}"], capture_output=True, text=True).stdout
            for pid in map(int, pids.split()):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                    env = Path(f"/proc/{pid}/environ").read_bytes()
                    if cmd.startswith("slurmd") or f"[{job_id}." in cmd or f"SLURM_JOB_ID={job_id}\0".encode() in env:
                        os.kill(pid, 9)
                except OSError:
                    pass
            yield
        finally:
            subprocess.run(["bash", str(REPO / "launch" / "slurm-dev-up.sh"), "--nodes", str(len(_NODES))], timeout=120)
            subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], capture_output=True, timeout=30)


@needs_three_nodes
def test_a_dead_node_is_replaced_by_a_spare_and_the_slurm_job_completes(
    tmp_path,
    cache_dir,
    nodes_back,  # noqa: F811 (the fixture, imported from conftest's helpers)
):
    """Issue 39: the test above's job (2 nodes + a spare, cluster.max_restarts=1), but the node of rank 2 (or 0: not
    the first node, which hosts the rendezvous) dies after iteration 10: its slurmd and all the job's processes on it
    killed. It cannot mark itself left out; the spare finds its agent silent (spares.DEAD_AFTER_S), marks it dead on
    its behalf and takes its place; the ranks restart in the same SLURM job from the checkpoint at 8 and complete,
    the dead node's task never writing a result (the launcher counts it as left out), every loss equal to the
    uninterrupted run's. Before: the spare waited for a mark that never came and the job never finished."""
    n = RESTART_ITERS
    run_dir, ref, cli = _spare_node_job(tmp_path, cache_dir)
    try:
        job_id = wait_until(lambda: submitted_job(run_dir), 180, "the submission", cli)
        wait_until(lambda: iterations_done(run_dir) >= 10, 400, "iteration 10 on SLURM", cli, poll_s=0.1)
        first = job_nodes(job_id)[0]
        node = next(
            host
            for r in (2, 0)
            if (p := wait_until(lambda r=r: agent_worker(run_dir, r), 30, f"rank {r}"))
            and (host := p.environ()["SLURMD_NODENAME"]) != first
        )
        with dead(node, job_id):
            killed_at = time.time()
            assert cli.wait(400) == 0, cli.describe()
    finally:
        cli.kill()
    out = cli.stdout
    assert f"completed: iteration {n} |" in out and out.rstrip().endswith(f"| job {job_id}"), out[-3000:]
    said = {r["event"]: r for r in history.read_records(run_dir) if r["event"] in ("node_left_out", "spare_joined")}
    spare = said["spare_joined"]["host"]
    assert said["spare_joined"]["replaces"] == node and spare not in (node, first), said
    assert said["node_left_out"]["host"] == node and said["node_left_out"]["by"] == spare, said
    assert said["node_left_out"]["message"].startswith(f"node {node} is dead (its agent has been silent for "), said
    hosts = json.loads((run_dir / "checkpoints" / f"iter_{n:07d}" / "manifest.json").read_text())["hosts"]
    assert spare in hosts and node not in hosts, (hosts, node)
    starts = [a for a in attempts.attempts(history.read_records(run_dir)) if a.job_id == job_id]
    assert [(a.attempt, a.restart, a.cause, a.restarted) for a in starts] == [
        (0, 0, "node failure", True),
        (0, 1, "completed", False),
    ], starts
    assert starts[0].message.startswith(f"node {node} lost (ranks ") and starts[1].start_iteration == 8, starts
    local = ref.losses(300)
    for rec in read_metrics(run_dir):
        assert_losses_match({rec["iteration"]: rec["lm_loss"]}, local, [rec["iteration"]])
    print(
        f"{node} dead at iteration >= 10: spare {spare} in its place, the job completed {time.time() - killed_at:.0f} s after"
    )
