"""cluster=hosts (torchrun's agent on every host over SSH) and cluster=torchrun (a platform's one launcher per
node), on the dev cluster of hosts (launch/hosts-dev-up.sh: hnode1, hnode2, network namespaces with sshd).

Pure parts (hostfile, the platform's variables, the world size of a host list, the agent's command line) are
unit-tested; one end-to-end test trains PP=2 x DP=2 on two hosts, loses one host's SSH session mid-run,
resumes, and compares every loss with a local run of the same config; one more starts the same job with
cluster=torchrun by hand in the two namespaces.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import psutil
import pytest
from conftest import REFERENCE_ITERS, REPO, SharedReference, losses_by_iteration, read_metrics, run_cli

from orchestrator.config.hosts import Host, node_env, parse_hostfile
from orchestrator.errors import ConfigError
from orchestrator.runtime.start.agent import agent_command

KEY_DIR = Path("/etc/orchestrator-hosts-dev")
SSH = [
    "ssh",
    "-o",
    "BatchMode=yes",
    "-o",
    "ConnectTimeout=5",
    "-o",
    f"UserKnownHostsFile={KEY_DIR}/known_hosts",
    "-i",
    str(KEY_DIR / "id_ed25519"),
]
SMALL = ["+experiment=gpt_pp2_dp2", "data.stdlib_max_mb=2", "training.log_interval=1", "training.eval_iters=0"]
REL = 1e-5


def _hosts_unavailable() -> str:
    if shutil.which("ssh") is None or not (KEY_DIR / "id_ed25519").exists():
        return "no dev hosts (bash launch/hosts-dev-up.sh, as root)"
    for host in ("hnode1", "hnode2"):
        r = subprocess.run(SSH + [f"root@{host}", "true"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return f"ssh root@{host} failed: {r.stderr.strip()[:200]} (bash launch/hosts-dev-up.sh)"
    return ""


_REASON = _hosts_unavailable()
needs_hosts = pytest.mark.skipif(bool(_REASON), reason=_REASON or "-")


# ---- pure parts ------------------------------------------------------------------------------------
def test_hostfile_lines_slots_and_comments():
    text = "# our nodes\ngpu1 slots=8\n\ngpu2 slots=8  # spare below\n"
    assert parse_hostfile(text, "hf") == [Host("gpu1", 8), Host("gpu2", 8)]
    with pytest.raises(ConfigError, match=r"cluster.hostfile=hf: line 2 'gpu2 gpus=8'"):
        parse_hostfile("gpu1\ngpu2 gpus=8\n", "hf")


def test_platform_variables_torchrun_kubeflow_skypilot_and_disagreements():
    env = node_env({"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234", "NNODES": "2", "NODE_RANK": "1"}, 2)
    assert (env.master_addr, env.master_port, env.nnodes, env.node_rank) == ("10.0.0.1", 1234, 2, 1)
    env = node_env({"MASTER_ADDR": "m", "PET_NNODES": "4", "PET_NODE_RANK": "3", "WORLD_SIZE": "32"}, 8)
    assert (env.nnodes, env.node_rank, env.master_port) == (4, 3, 29500)
    env = node_env({"SKYPILOT_NODE_IPS": "10.1.0.5\n10.1.0.6\n", "SKYPILOT_NODE_RANK": "0"}, 8)
    assert (env.master_addr, env.nnodes, env.node_rank) == ("10.1.0.5", 2, 0)
    with pytest.raises(ConfigError, match=r"^WORLD_SIZE=6 but NNODES=2 nodes x 2 processes per node = 4 ranks"):
        node_env({"MASTER_ADDR": "m", "NNODES": "2", "NODE_RANK": "0", "WORLD_SIZE": "6"}, 2)
    with pytest.raises(ConfigError, match=r"^NODE_RANK=2: not below NNODES=2"):
        node_env({"MASTER_ADDR": "m", "NNODES": "2", "NODE_RANK": "2"}, 2)
    with pytest.raises(ConfigError, match=r"^MASTER_ADDR is not set"):
        node_env({"NNODES": "2", "NODE_RANK": "0"}, 2)


def test_agent_command_is_one_command_for_ssh_platforms_and_srun():
    argv = agent_command(
        "/py",
        "/runs/a/agents/j/job.pkl",
        nnodes=4,
        nproc_per_node=8,
        rdzv_endpoint="gpu1:29500",
        rdzv_id="j",
        watch_stdin=True,
    )
    assert argv[:4] == ["/py", "-m", "orchestrator.runtime.start.agent", "node"]
    assert "--node-rank" not in argv and argv[-2:] == ["--watch-stdin", "/runs/a/agents/j/job.pkl"]
    static = agent_command("/py", "job.pkl", nnodes=2, nproc_per_node=2, rdzv_endpoint="m:1", rdzv_id="j", node_rank=1)
    assert static[static.index("--node-rank") + 1] == "1" and "--watch-stdin" not in static


# ---- end to end ------------------------------------------------------------------------------------
def _one_error_line(proc: subprocess.CompletedProcess, *parts: str) -> str:
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def _job_processes(marker: str) -> List[str]:
    """Processes (on any namespace of this machine: one pid namespace) whose command line names ``marker``."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if marker in cmd and p.pid != os.getpid():
            found.append(f"{p.pid} {cmd[:160]}")
    return found


@needs_hosts
def test_bad_hosts_are_refused_in_one_line_before_anything_starts(tmp_path, cache_dir):
    """An unreachable host, a host list shorter than the layout, a run root a host cannot see: one line each,
    exit 2, nothing created."""
    root = tmp_path / "runs"
    common = SMALL + ["cluster=hosts_dev", f"run.root={root}", "run.name=bad", "training.train_iters=2"]
    proc = run_cli(common + ["cluster.hosts=[hnode1,hnode9]"], cache=cache_dir, check=False, timeout=120)
    _one_error_line(proc, "cluster.hosts: host hnode9 is not reachable by SSH")
    proc = run_cli(common + ["cluster.hosts=[hnode1]"], cache=cache_dir, check=False, timeout=120)
    _one_error_line(proc, "cluster.hosts=[hnode1]: 1 host(s) x 2 processes = 2 ranks", "needs TP x PP x CP x DP = 4")
    # an sshd on hnode2 whose mount namespace hides the run root behind an empty tmpfs
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    pidfile = tmp_path / "sshd.pid"
    subprocess.run(
        [
            "nsenter",
            "--net=/run/netns/host-node2",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            f"mount -t tmpfs none {hidden} && exec /usr/sbin/sshd -f {KEY_DIR}/sshd_config "
            f"-o PidFile={pidfile} -o ListenAddress=10.78.0.12 -p 2222",
        ],
        check=True,
        timeout=30,
    )
    try:
        for _ in range(50):
            if pidfile.exists():
                break
            time.sleep(0.1)
        proc = run_cli(
            SMALL
            + [
                "cluster=hosts_dev",
                "cluster.hosts=[hnode2]",
                "cluster.ssh.port=2222",
                "parallelism.data_parallel_size=1",
                f"run.root={hidden}",
                "run.name=bad",
                "training.train_iters=2",
            ],
            cache=cache_dir,
            check=False,
            timeout=120,
        )
        _one_error_line(proc, f"run.root={hidden}: host hnode2 cannot see {hidden}")
    finally:
        if pidfile.exists():
            os.kill(int(pidfile.read_text()), 15)
    assert not root.exists() and list(hidden.iterdir()) == []


class Launcher:
    """``python -m orchestrator ARGS`` in the background, output to a file."""

    def __init__(
        self,
        args: List[str],
        cache: Path,
        log: Path,
        env: Dict[str, str] | None = None,
        prefix: List[str] | None = None,
    ):
        self.log = log
        full = dict(os.environ, ORCHESTRATOR_CACHE=str(cache), PYTHONUNBUFFERED="1", **(env or {}))
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                [*(prefix or []), sys.executable, "-m", "orchestrator", *args],
                cwd=REPO,
                env=full,
                stdout=out,
                stderr=subprocess.STDOUT,
                text=True,
            )

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"did not end within {timeout} s:\n{self.text[-4000:]}") from None

    @property
    def text(self) -> str:
        return self.log.read_text(errors="replace")


def _ssh_client_to(host: str, launcher_pid: int) -> psutil.Process:
    for child in psutil.Process(launcher_pid).children():
        cmd = child.cmdline()
        if cmd and cmd[0] == "ssh" and host in cmd and "--watch-stdin" in cmd[-1]:
            return child
    raise AssertionError(f"no ssh client to {host} under pid {launcher_pid}")


def _assert_losses_match(got: Dict[int, float], ref: Dict[int, float], iterations) -> None:
    for it in iterations:
        assert it in got and it in ref, (it, sorted(got), sorted(ref))
        assert abs(got[it] - ref[it]) <= REL * abs(ref[it]), (it, got[it], ref[it])


@needs_hosts
@pytest.mark.slow
def test_two_hosts_lose_a_session_name_it_then_torchrun_resumes_and_matches_local(tmp_path, cache_dir):
    """PP=2 x DP=2 on hnode1 + hnode2 (2 ranks each), cluster=hosts: kill -9 the SSH client to hnode2 once
    iteration 4 is logged; the launcher names hnode2 within 30 s, exits 1, and no process of the job is left on
    any host; the manifest of its checkpoint records both hosts. The rerun is the same job with
    cluster=torchrun, started by hand in each namespace with the platform's variables (one CI run for both
    acceptance items): it resumes from that checkpoint and finishes, and every loss of the 20 iterations,
    before and after the loss, equals a local run's (1e-5). Variables that disagree with the layout, and a
    layout change, are refused in one line."""
    n = REFERENCE_ITERS
    root = tmp_path / "runs"
    common = SMALL + [f"run.root={root}", f"training.train_iters={n}", "checkpoint.save_interval=3", "run.name=job"]
    ref = SharedReference(SMALL + [f"training.train_iters={n}"], cache_dir)  # shared with the SLURM tests
    local = ref.losses(300)  # first: its one task builds the sample indices the others reuse
    first = Launcher(common + ["cluster=hosts_dev"], cache_dir, tmp_path / "hosts.log")
    run_dir = root / "job"
    deadline = time.monotonic() + 300
    while not any(r["iteration"] >= 4 for r in (read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else [])):
        assert first.proc.poll() is None and time.monotonic() < deadline, first.text[-4000:]
        time.sleep(0.2)
    _ssh_client_to("hnode2", first.proc.pid).kill()
    killed = time.monotonic()
    while "hnode2: session ended" not in first.text and time.monotonic() - killed < 60:
        time.sleep(0.2)
    named_after = time.monotonic() - killed
    assert first.wait(120) == 1, first.text[-4000:]
    line = next((ln for ln in first.text.splitlines() if "hnode2: session ended" in ln), "")
    assert "killed by SIGKILL" in line and named_after <= 30, (named_after, first.text[-3000:])
    job_id = next(p.name for p in (run_dir / "agents").iterdir())
    assert _job_processes(job_id) == []
    # recorded and shown as the README says: a node failure naming the host, not the BrokenPipeError its rank
    # raised on the lost session's output ("rank 2 ... crashed"), nor "rank 0 raised an exception" (issue 39)
    from orchestrator.ckpt.attempts import attempts
    from orchestrator.ckpt.history import read_records
    from orchestrator.submit.status import run_status

    lost = "host hnode2: the SSH client was killed by SIGKILL"
    ended = [a for a in attempts(read_records(run_dir)) if a.job_id == job_id]
    assert [(a.cause, a.message.startswith(lost)) for a in ended] == [("node failure", True)], ended
    assert run_status(run_dir).job.describe().startswith(f"failed (node failure) - {lost}"), run_status(run_dir).job
    manifest = json.loads((run_dir / "checkpoints" / "iter_0000003" / "manifest.json").read_text())
    # the newest save before the session was lost (under load the job may reach iteration 6's save before the kill)
    newest = max(p.name for p in (run_dir / "checkpoints").glob("iter_*") if (p / "manifest.json").exists())
    assert manifest["hosts"] == ["hnode1", "hnode1", "hnode2", "hnode2"], manifest["hosts"]

    tr = common + [
        "cluster=torchrun",
        "cluster.gpus_per_node=0",
        "cluster.tasks_per_node=2",
        "+cluster.env.OMP_NUM_THREADS=1",
    ]
    bad = run_cli(
        tr,
        cache=cache_dir,
        check=False,
        timeout=120,
        env={"MASTER_ADDR": "hnode1", "MASTER_PORT": "29617", "NNODES": "3", "NODE_RANK": "0"},
    )
    _one_error_line(bad, "NNODES=3 nodes x 2 processes per node = 6 ranks", "needs TP x PP x CP x DP = 4")
    nodes = [
        Launcher(
            tr,
            cache_dir,
            tmp_path / f"torchrun{i}.log",
            env={"MASTER_ADDR": "hnode1", "MASTER_PORT": "29617", "NNODES": "2", "NODE_RANK": str(i)},
            prefix=[
                "nsenter",
                f"--net=/run/netns/host-node{i + 1}",
                "unshare",
                "--uts",
                "--",
                "sh",
                "-c",
                f'hostname hnode{i + 1} && exec "$@"',
                "sh",
            ],
        )
        for i in range(2)
    ]
    for node in nodes:
        assert node.wait(300) == 0, node.text[-4000:]
    resumed = f"{newest} (iteration {int(newest[len('iter_') :])})"
    assert "will resume from" in nodes[0].text and resumed in nodes[0].text, nodes[0].text[-3000:]
    _assert_losses_match(losses_by_iteration(run_dir), local, range(1, n + 1))
    manifest = json.loads((run_dir / "checkpoints" / f"iter_{n:07d}" / "manifest.json").read_text())
    assert sorted(set(manifest["hosts"])) == ["hnode1", "hnode2"], manifest["hosts"]
    proc = run_cli(
        common
        + ["cluster=hosts_dev", "parallelism.pipeline_model_parallel_size=1", "parallelism.data_parallel_size=null"],
        cache=cache_dir,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 2 and "pipeline_model_parallel_size" in proc.stderr, proc.stderr[-2000:]


@needs_hosts
@pytest.mark.slow
def test_sigterm_to_a_hosts_launcher_saves_and_exits_143_as_a_local_ones(tmp_path, cache_dir):
    """A two-host job from a hostfile deleted as soon as the job is launched (the ranks never read it) trains; then
    SIGTERM to the launcher of that two-host job (``kill PID``) at iteration 2 of a run that saves every 1,000:
    as for a local job (submit.signals), the ranks save the iteration they stop at and exit, the launcher exits
    143 with one line naming that checkpoint, ``status`` says ``stopped (interrupted)`` (it said ``failed``, and
    the launcher exited 130), and no process of the job is left on any host."""
    import re
    import signal

    from orchestrator.submit.status import run_status

    root = tmp_path / "runs"
    hostfile = tmp_path / "hostfile"  # on the launcher's machine only: deleted once the job is launched
    hostfile.write_text("hnode1 slots=2\nhnode2 slots=2\n")
    launcher = Launcher(
        SMALL
        + [
            "cluster=hosts_dev",
            "cluster.hosts=[]",
            f"cluster.hostfile={hostfile}",
            "cluster.tasks_per_node=null",
            f"run.root={root}",
            "run.name=term",
            "training.train_iters=1000",
            "checkpoint.save_interval=1000",
        ],
        cache_dir,
        tmp_path / "term.log",
    )
    run_dir, deadline = root / "term", time.monotonic() + 300
    while not list((run_dir / "agents").glob("*/job.pkl")) if (run_dir / "agents").exists() else True:
        assert launcher.proc.poll() is None and time.monotonic() < deadline, launcher.text[-4000:]
        time.sleep(0.05)
    hostfile.unlink()  # issue 36: the ranks get the hosts (and the layout) with the job, never from this file
    while not any(r["iteration"] >= 2 for r in (read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else [])):
        assert launcher.proc.poll() is None and time.monotonic() < deadline, launcher.text[-4000:]
        time.sleep(0.2)
    launcher.proc.send_signal(signal.SIGTERM)
    assert launcher.wait(120) == 143, launcher.text[-4000:]
    last = launcher.text.strip().splitlines()[-1]
    m = re.match(
        r"stopped after saving \(SIGTERM\); resume from (\S+) \(iteration (\d+)\) with: python -m orchestrator ", last
    )
    assert m and Path(m.group(1)) == run_dir / "checkpoints" / f"iter_{int(m.group(2)):07d}", launcher.text[-3000:]
    assert (Path(m.group(1)) / "manifest.json").exists() and int(m.group(2)) >= 2
    assert run_status(run_dir).job.describe().startswith("stopped (interrupted)"), run_status(run_dir).job
    assert _job_processes(next(p.name for p in (run_dir / "agents").iterdir())) == []


def test_status_of_a_hosts_job_follows_its_launcher_and_its_rank_results(tmp_path):
    """``status``: a hosts job is running while its launcher lives (here: this process), completed once every
    rank's result file (``result_<rank>.pkl`` beside the job file) says success."""
    import pickle
    import socket

    from orchestrator.ckpt.history import read_records, record_submission
    from orchestrator.submit.jobs import job_status

    folder = tmp_path / "agents" / "hosts-1"
    folder.mkdir(parents=True)
    record_submission(
        tmp_path,
        "hosts-1",
        "hosts",
        {"stdout": str(folder / "hnode1.log")},
        num_tasks=2,
        launcher={"pid": os.getpid(), "host": socket.gethostname()},
    )
    assert job_status("hosts-1", "hosts", folder, 2, events=read_records(tmp_path)).state == "running"
    for rank in range(2):
        (folder / f"result_{rank}.pkl").write_bytes(pickle.dumps(("success", {"status": "completed"})))
    assert job_status("hosts-1", "hosts", folder, 2, events=read_records(tmp_path)).state == "completed"
    # ranks that stopped on the job's decision (a graceful stop: SystemExit(76)), their launcher gone: stopped
    from orchestrator.ckpt.history import record_event

    stopped = tmp_path / "agents" / "hosts-2"
    stopped.mkdir()
    record_submission(
        tmp_path,
        "hosts-2",
        "hosts",
        {"stdout": str(stopped / "hnode1.log")},
        num_tasks=2,
        launcher={"pid": os.getpid(), "host": "a-host-that-is-not-this-one"},
    )
    record_event(tmp_path, "stopped", job_id="hosts-2", reason="stop asked (SIGTERM to the launcher)")
    for rank in range(2):
        (stopped / f"result_{rank}.pkl").write_bytes(pickle.dumps(("error", "SystemExit(76)")))
    assert (
        job_status("hosts-2", "hosts", stopped, 2, events=read_records(tmp_path)).describe()
        == "stopped - stopped after saving a checkpoint (not requeued)"
    )
    # its launcher gone, no result (a second signal stopped the ranks at once): failed, not "unknown"
    for rank in range(2):
        (stopped / f"result_{rank}.pkl").unlink()
    assert (
        job_status(
            "hosts-2", "hosts", stopped, 2, events=[r for r in read_records(tmp_path) if r.get("event") != "stopped"]
        ).describe()
        == "failed - the hosts job ended without result files"
    )


def test_world_size_of_a_hostfile_is_hosts_times_slots_and_a_short_list_names_its_hosts(tmp_path):
    from orchestrator.config.layout import world_size_of
    from orchestrator.config.schema import JobConfig
    from orchestrator.errors import LayoutError

    cfg = JobConfig()
    cfg.cluster.kind, cfg.cluster.gpus_per_node = "hosts", 0
    cfg.parallelism.pipeline_model_parallel_size, cfg.parallelism.data_parallel_size = 2, 2
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("hnode1 slots=2\nhnode2 slots=2\n")
    cfg.cluster.hostfile = str(hostfile)
    assert world_size_of(cfg) == (4, "2 hosts x 2 processes per node")
    hostfile.write_text("hnode1 slots=2\n")
    with pytest.raises(
        LayoutError,
        match=r"^cluster.hosts=\[hnode1\]: 1 host\(s\) x 2 processes = 2 ranks, but the "
        r"layout needs TP x PP x CP x DP = 4; fix: list 2 hosts",
    ):
        world_size_of(cfg)
    hostfile.write_text("hnode1 slots=2\nhnode2 slots=4\n")
    with pytest.raises(ConfigError, match=r"hosts have different slots \(\[2, 4\]\)"):
        world_size_of(cfg)


def test_a_worker_of_the_agent_takes_torchruns_variables_even_inside_a_slurm_step():
    """Under ``srun`` (one agent per node, issue 28) the workers inherit the step's SLURM_* variables: their rank
    and rendezvous are torchrun's."""
    from orchestrator.runtime.rank.distributed import rendezvous_from_env

    env = {
        "SLURM_PROCID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "TORCHELASTIC_RUN_ID": "7",
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "29400",
    }
    rv = rendezvous_from_env(env, resolve=lambda h: h)
    assert (rv.rank, rv.world_size, rv.local_rank, rv.master_addr, rv.master_port, rv.source) == (
        5,
        8,
        1,
        "node1",
        29400,
        "env",
    )


def test_orchestrator_stop_of_a_torchrun_job_saves_and_is_a_stop_not_a_failure(tmp_path, cache_dir):
    """issue 36: `orchestrator stop` of a cluster=torchrun job (one node, this machine) saves and stops every rank with
    the stop code; the launcher reads that as a stop (exit 143, 'stopped after saving (orchestrator stop)', where to
    resume), as a local job's does: it said "torchrun's agent exited 1" and failed."""
    from orchestrator.runtime.rank.rendezvous import reserve_local_port

    root = tmp_path / "runs"
    launcher = Launcher(
        SMALL
        + [
            "cluster=torchrun",
            "cluster.gpus_per_node=0",
            "cluster.tasks_per_node=2",
            "+cluster.env.OMP_NUM_THREADS=1",
            f"run.root={root}",
            "parallelism.data_parallel_size=1",
            "run.name=tstop",
            "training.train_iters=1000",
            "checkpoint.save_interval=1000",
        ],
        cache_dir,
        tmp_path / "tstop.log",
        env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(reserve_local_port()), "NNODES": "1", "NODE_RANK": "0"},
    )
    run_dir, deadline = root / "tstop", time.monotonic() + 300
    while not any(r["iteration"] >= 2 for r in (read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else [])):
        assert launcher.proc.poll() is None and time.monotonic() < deadline, launcher.text[-4000:]
        time.sleep(0.2)
    run_cli(["stop", str(run_dir)], cache=cache_dir, timeout=60)
    assert launcher.wait(180) == 143, launcher.text[-4000:]
    last = launcher.text.strip().splitlines()[-1]
    assert "stopped after saving (orchestrator stop" in last and "resume from " in last, launcher.text[-3000:]
    assert "torchrun's agent exited" not in launcher.text, launcher.text[-3000:]
