"""Shared helpers: run the real CLI in a subprocess, read what it wrote."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("OMP_NUM_THREADS", "1")
"""Every rank of the suite's local jobs runs one OpenMP thread (the launcher keeps a set OMP_NUM_THREADS,
submit/executor.py): on 2 cores shared by two workers and the 0.19.2 leg, a second thread per rank
mostly spins; a 14-iteration one-rank job next to two busy cores took 22-24 CPU-s with 2 threads, 10.5
with 1 (bench numbers use the product's default, cores // ranks)."""


@functools.lru_cache(maxsize=1)
def slurm_unavailable_reason() -> str:
    """Why the SLURM dev cluster (launch/slurm-dev-up.sh) cannot be used, or "" when it answers."""
    if shutil.which("sinfo") is None:
        return "sinfo not found (install with launch/slurm-dev-install.sh)"
    try:
        out = subprocess.run(["sinfo", "-h", "-p", "dev", "-o", "%a %t"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return "sinfo did not answer within 15 s"
    if out.returncode != 0:
        return f"sinfo failed: {out.stderr.strip()[:200]}"
    if not out.stdout.strip():
        return "no partition 'dev' (start the dev cluster: launch/slurm-dev-up.sh)"
    return ""


SLURM_ORDER = (
    "test_four_ranks_",
    "test_a_nan_is_never",
    "test_scancel_",
    "test_signals_to_a_slurm_",
    "test_a_signal_to_tune_",
    "test_a_slurm_job_is_never_ended_",
    "test_killed_rank_",
    "test_slow_link_",
    "test_slurm_run_across_nodes",
    "test_time_limit_",
    "test_slurm_sweep_",
    "test_two_detached_",
    "test_node_loss_",
    "test_in_place_restart_",
    "test_a_dead_node_is_replaced_",
)
"""The SLURM tests run one after another (they share the dev cluster), in this order: the short ones
first (the suite's first minutes, when every worker starts at once, are the most loaded)."""

LONGEST_FIRST = (
    "test_train",
    "test_slurm_train",
    "test_hosts",
    "test_pipeline_schedule",
    "test_guard",
    "test_distopt",
    "test_cli",
    "test_sweep",
    "test_retention",
    "test_hf_import",
    "test_straggler",
    "test_status",
    "test_installed",
    "test_tokenizers",
    "test_mcore_upgrade",
    "test_slurm",
    "test_data",
    "test_cp",
    "test_eval_tb",
    "test_rampup",
    "test_tune",
    "test_validate",
    "test_convert",
)
"""Modules by their wall time in the suite (measured with --durations), longest first: xdist takes the
groups in this order (``--no-loadscope-reorder``), so no long module starts last."""


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Two pytest-xdist workers (``-n 2 --dist loadgroup --no-loadscope-reorder``, pyproject): the SLURM
    tests, first in the queue, on one of them, one after another (they mostly wait on the dev cluster's
    timers), while the other modules, a module at a time (its module-scoped reference runs are built
    once), fill both workers longest first."""

    def order(item) -> tuple:
        if item.get_closest_marker("slurm"):
            at = next((i for i, p in enumerate(SLURM_ORDER) if item.name.startswith(p)), len(SLURM_ORDER))
            return (0, "", at)
        module = item.module.__name__.rsplit(".", 1)[-1]
        rank = LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)
        return (1, f"{rank:03d}", 0)

    for item in items:
        item.add_marker(pytest.mark.xdist_group("slurm" if item.get_closest_marker("slurm") else item.module.__name__))
    items.sort(key=order)  # stable: a module's tests keep their file order


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One data cache for the whole session (stdlib corpus tokenized once; xdist workers share it: the
    data preparation takes a file lock)."""
    env = os.environ.get("ORCHESTRATOR_TEST_CACHE")
    if env:
        Path(env).mkdir(parents=True, exist_ok=True)
        return Path(env)
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_cli(
    args: List[str],
    *,
    cache: Path,
    timeout: int = 600,
    check: bool = True,
    env: Dict[str, str] | None = None,
    python: str = sys.executable,
) -> subprocess.CompletedProcess:
    """``python -m orchestrator ARGS`` in the repo, with the shared data cache (``python``: this one)."""
    full_env = dict(os.environ, ORCHESTRATOR_CACHE=str(cache), PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    proc = subprocess.run(
        [python, "-m", "orchestrator", *args], cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"orchestrator {' '.join(args)} exited {proc.returncode}\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def read_metrics(run_dir: Path) -> List[dict]:
    """Per-iteration records of metrics.jsonl (events excluded), in file order."""
    path = run_dir / "metrics.jsonl"
    return [r for r in (json.loads(line) for line in path.read_text().splitlines()) if "event" not in r]


def losses_by_iteration(run_dir: Path) -> Dict[int, float]:
    out: Dict[int, float] = {}
    for rec in read_metrics(run_dir):
        out[rec["iteration"]] = rec["lm_loss"]  # a resumed run's later record wins
    return out


def agent_worker(run_dir: Path, rank: int):
    """The process of rank ``rank`` of a job of torch elastic agents (``cluster.max_restarts`` > 0:
    ``... agent rank <run_dir>/agents/.../job*.pkl``), not its children (the checkpoint writer's); None before it runs."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            if (
                len(cmd) >= 2
                and cmd[-2] == "rank"
                and str(run_dir) in cmd[-1]
                and p.environ().get("RANK") == str(rank)
                and p.parent().cmdline()[-2:-1] != ["rank"]
            ):
                return p
        except psutil.Error:
            continue
    return None


def wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    """``predicate()``'s first truthy value, polled every ``poll_s`` s; AssertionError naming ``what`` after
    ``timeout_s`` s (tests wait on files and records, never on a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


REFERENCE_ITERS = 20
"""Iterations of the PP2 x DP2 runs that tests compare with one :class:`SharedReference` (the learning-rate
schedule spans train_iters: runs of other lengths have other losses)."""


class SharedReference:
    """An uninterrupted local run that several tests compare with (a SLURM run, a hosts run, one killed and
    resumed): made once per session, whichever test asks first, while that test's own job starts, and read by
    the others (any xdist worker: a file lock in the session's data cache). ``args`` name the run's math only
    (no run.root/run.name; saves do not change the losses, so the reference saves nothing)."""

    def __init__(self, args: List[str], cache: Path):
        import fcntl
        import hashlib

        self.args, self.cache = list(args), cache
        key = hashlib.sha1("\0".join(sorted(self.args)).encode()).hexdigest()[:12]
        self.root = cache / "references" / key
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.root / "lock", "w")  # noqa: SIM115 - held while this test makes the run
        self.proc = None
        if (self.root / "done").exists():
            return
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # another worker makes it: losses() waits for its lock
        if not (self.root / "done").exists():
            self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ, ORCHESTRATOR_CACHE=str(self.cache), PYTHONUNBUFFERED="1")
        with open(self.root / "log.txt", "w") as log:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "orchestrator",
                    *self.args,
                    f"run.root={self.root}",
                    "run.name=ref",
                    "checkpoint.save_interval=null",
                    "checkpoint.save_at_end=false",
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def losses(self, timeout: float = 600) -> Dict[int, float]:
        """Iteration -> lm loss of the reference (waits for it; makes it here if its maker failed)."""
        import fcntl

        deadline = time.monotonic() + timeout
        if self.proc is None and not (self.root / "done").exists():
            while True:  # another worker's run: its lock is released when it ends
                try:
                    fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"the shared reference {self.root} took over {timeout} s"
                    time.sleep(0.5)
            if not (self.root / "done").exists():
                self.proc = self._start()
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.proc.kill()
                raise
            assert code == 0, (self.root / "log.txt").read_text()[-4000:]
            (self.root / "done").touch()
            self.proc = None
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        return losses_by_iteration(self.root / "ref")


def submit_like_launcher(cfg, fn, *args, world_size: int):
    """Submit ``fn`` (in place of the training job) as orchestrator.submit.executor.submit does with
    one task per rank (SLURM and GPU jobs; a local CPU job's task forks its ranks, which only
    ``TrainJob`` does): its executor for ``cfg.cluster``, the submission recorded in the run's jobs.jsonl."""
    from orchestrator.ckpt import history
    from orchestrator.submit import executor

    job = executor.make_executor(cfg, world_size).submit(fn, *args)
    history.record_submission(
        cfg.run.dir,
        str(job.job_id),
        cfg.cluster,
        {"stdout": str(job.paths.stdout), "stderr": str(job.paths.stderr)},
        num_tasks=world_size,
    )
    return job


def mounted_tmpfs(mnt: Path, mib: int):
    """Yield ``mnt``, a fresh tmpfs of ``mib`` MiB (skips without root); unmounted afterwards."""
    mnt.mkdir()
    out = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}M", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {out.stderr.strip()[:200]}")
    try:
        yield mnt
    finally:
        for _ in range(20):  # a rank may still be exiting
            if subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        else:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ---------------------------------------------------------------- a Megatron-LM user's data: GPT-2 BPE, .bin/.idx
GPT2_VOCAB, GPT2_EOD = 50257, 50256


def make_gpt2_assets(root: Path):
    """GPT-2-sized BPE files and two ``.bin/.idx`` datasets in ``root``, made here (nothing downloaded):
    vocab.json with 50257 ids (``<|endoftext|>`` = 50256) and 50000 merges over GPT-2's byte alphabet;
    ``ok`` and ``bad`` (an id 50304 in document 7), 200 documents of 120 uint16 ids ending in the eod,
    written by megatron-core's ``IndexedDatasetBuilder``. Returns (root, vocab.json, merges.txt, ok
    prefix, bad prefix)."""
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for a in alphabet:
        for b in alphabet:
            if len(vocab) < GPT2_EOD:
                merges.append(f"{a} {b}")
                vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = GPT2_EOD
    (root / "gpt2-vocab.json").write_text(json.dumps(vocab))
    (root / "gpt2-merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    rng = np.random.default_rng(0)
    for name, bad_id in (("ok", None), ("bad", 50304)):
        builder = IndexedDatasetBuilder(str(root / f"{name}.bin"), dtype=np.uint16)
        for d in range(200):
            ids = rng.integers(0, GPT2_EOD, 120)
            ids[-1] = GPT2_EOD
            if bad_id is not None and d == 7:
                ids[3] = bad_id
            builder.add_document(ids, [len(ids)])
        builder.finalize(str(root / f"{name}.idx"))
    return root, root / "gpt2-vocab.json", root / "gpt2-merges.txt", root / "ok", root / "bad"


def gpt2_args(gpt2, prefix):
    _, vocab, merges, _, _ = gpt2
    return [
        "data=indexed",
        f"data.paths=[{prefix}]",
        "data.tokenizer=GPT2BPETokenizer",
        f"data.vocab_file={vocab}",
        f"data.merge_file={merges}",
    ]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``ORCHESTRATOR_TEST_CPU_LOG=FILE``: append each test's CPU seconds (this worker's own and its waited-for
    descendants': the launchers and local ranks it started; SLURM's ranks run under slurmd, not counted) and
    its wall seconds as a JSON line: where the suite's CPU goes on a 2-core CI machine (``--durations`` shows
    wall time only, and a test that waits on SLURM's timers costs wall but little CPU)."""
    out = os.environ.get("ORCHESTRATOR_TEST_CPU_LOG")
    if not out:
        yield
        return
    import resource

    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    began, wall = cpu(), time.monotonic()
    yield
    record = {
        "test": item.nodeid,
        "cpu_s": round(cpu() - began, 2),
        "wall_s": round(time.monotonic() - wall, 2),
        "python": sys.prefix,  # .ci/run's two legs (the 0.19.2 venv's) write to one file
    }
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
