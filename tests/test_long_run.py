"""Runs that last days (issue 26): costs that stay flat, on the files a long run leaves behind.

Unit tests on real files written by the production writers (no job runs here): ``status`` of a run whose
``metrics.jsonl`` holds far more than it reads, ``status`` of a sweep one of whose points lost a rank,
the cleanup rule for set-aside checkpoint directories, and the launcher's poll of aggregated heartbeats.
``bench/long_run.py`` measures the same things at 100,000 iterations, 200 checkpoints and 1,024 ranks.
"""

from __future__ import annotations

import io
import json
import os
import time
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from orchestrator.ckpt import history
from orchestrator.ckpt.rundir import METRICS_FILE
from orchestrator.io import append_jsonl, write_atomic
from orchestrator.submit import outcome, run_records, status

RECORD = (
    '{{"consumed_samples": {s}, "grad_norm": 1.25, "iteration": {i}, "lm_loss": {loss:.4f}, "lr": 0.0003, '
    '"max_gpu_mem_mb": null, "max_rss_mb": 1630.2, "skipped": false, "step_time_s": 0.5, '
    '"throughput_tflops": 0.012, "time": {t:.3f}, "tokens_per_s": 8192.0}}\n'
)
"""A training record as the logging rank writes it (sorted keys, ~280 B)."""


def long_metrics(run_dir: Path, iterations: int, train_iters: int) -> None:
    """``metrics.jsonl`` of one job that started at iteration 0 and logged every iteration up to ``iterations``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    append_jsonl(
        run_dir / METRICS_FILE,
        {
            "event": "start",
            "iteration": 0,
            "train_iters": train_iters,
            "resumed_from": None,
            "load_s": None,
            "time": time.time(),
        },
    )
    with open(run_dir / METRICS_FILE, "a") as f:
        f.writelines(RECORD.format(s=8 * i, i=i, loss=10.0 - i * 1e-4, t=1.7e9 + i) for i in range(1, iterations + 1))


def test_status_of_a_long_run_shows_total_eta_and_tokens_per_s(tmp_path):
    """30,000 records (7.4 MiB, 7x what status reads): the total comes from the job's ``attempt_started``
    record, and a run written before that record carried it finds the ``start`` record searching backwards."""
    run = tmp_path / "long"
    long_metrics(run, 30_000, 100_000)
    job_id = str(os.getpid())  # a live local "job": this process
    history.record_submission(run, job_id, "local", num_tasks=1, folder=str(run / "submitit"))
    history.record_attempt_started(run, job_id, 0, iteration=0, host="h", world_size=1, train_iters=100_000)
    assert (run / METRICS_FILE).stat().st_size > 7 * run_records.TAIL_BYTES
    st = status.run_status(run)
    assert (st.state, st.iteration, st.train_iters, st.tokens_per_s) == ("running", 30_000, 100_000, 8192.0)
    assert st.eta_s == 70_000 * 0.5
    row = status.format_table([st], tmp_path).splitlines()[1].split()
    assert row[0] == "long" and row[5:] == ["30000/100000", "7.0000", "8,192", "9h43m"], row
    # written before attempt_started carried train_iters: the start record, found from the end
    assert run_records.live_rates(run, records=[])["train_iters"] == 100_000
    append_jsonl(run / METRICS_FILE, {"event": "start", "iteration": 30_000, "train_iters": 200_000})
    assert run_records.live_rates(run)["train_iters"] == 200_000  # a newer job's start, in the tail


def test_status_finds_the_breakdown_and_the_straggler_older_than_the_last_mib(tmp_path):
    """issue 36: a straggler line and a step breakdown written early in a long job (7 MiB of iteration records after
    them) are still what `status --detail` shows: read backwards block by block, not only the last MiB."""
    run = tmp_path / "long"
    long_metrics(run, 0, 100_000)
    append_jsonl(run / METRICS_FILE, {"event": "straggler", "line": "rank 3 (node2) is 45% slower", "time": 1.0})
    append_jsonl(
        run / METRICS_FILE,
        {"event": "breakdown", "iteration": 10, "iterations": [1, 10], "stages": [{"stage": 0}], "time": 2.0},
    )
    with open(run / METRICS_FILE, "a") as f:
        f.writelines(RECORD.format(s=8 * i, i=i, loss=10.0, t=1.7e9 + i) for i in range(11, 30_011))
    assert (run / METRICS_FILE).stat().st_size > 7 * run_records.TAIL_BYTES
    assert run_records.slowness(run) == ["rank 3 (node2) is 45% slower"]
    assert run_records.latest_breakdown(run)["what"] == "iterations 1-10"
    append_jsonl(run / METRICS_FILE, {"event": "start", "iteration": 30_010, "train_iters": 100_000})
    assert run_records.slowness(run) == []  # a newer job's: the old job's straggler is not its


def _point(sweep: Path, num: int, job_id: str, pool: Path, trial: int) -> Path:
    """A sweep point on warm ranks as the launcher records it (:meth:`orchestrator.submit.pool.WarmPool.run`)."""
    run = sweep / str(num)
    history.record_submission(
        run,
        job_id,
        "local",
        {"stdout": str(pool / "submitit" / f"{job_id}_0_log.out")},
        num_tasks=3,
        warm_pool=str(pool),
        trial=trial,
    )
    long_metrics(run, 3, 10)
    return run


def test_status_of_a_sweep_whose_point_lost_a_rank_prints_a_table(tmp_path):
    """Point 1's rank 1 was killed (SIGKILL: it writes nothing); its peers' collectives broke and each wrote
    its error file (:func:`orchestrator.runtime.start.pool.error_path`), then the launcher recorded the end.
    ``status`` printed ``ValueError: too many values to unpack`` here."""
    from orchestrator.runtime.start.pool import error_path, result_path

    sweep, pool = (
        tmp_path / "sweeps" / "s" / "2026-01-01_00-00-00",
        tmp_path / "sweeps" / "s" / "t" / ".pool" / "pool_0",
    )
    pool.mkdir(parents=True)
    ok = _point(sweep, 0, "4242", pool, 0)
    write_atomic(result_path(pool, 0), json.dumps({"summaries": [{"status": "completed", "logging_rank": True}]}))
    bad = _point(sweep, 1, "4242", pool, 1)
    broken = (
        'Traceback (most recent call last):\n  File "loop.py", line 80, in train\n'
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer\n"
    )
    for rank in (2, 0):
        write_atomic(error_path(pool, 1, rank), broken)
    outcome.record_end(
        str(bad), "4242", "crashed", "job 4242: rank 0 failed in warm trial 1:\n" + broken + f"logs: {pool}/submitit/"
    )
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert status.main([str(tmp_path)]) == 0
    lines = buf.getvalue().splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:] if line and not line.startswith((" ", str(tmp_path)))}
    assert lines[0].split()[:2] == ["RUN", "STATE"]
    assert rows[str(ok.relative_to(tmp_path))][1:3] == ["completed", "4242"], rows
    assert rows[str(bad.relative_to(tmp_path))][1:3] == ["failed", "(crashed)"], rows
    assert f"{bad}: rank 0 failed; last lines:" in lines
    assert any("Connection reset by peer" in line for line in lines) and "Traceback" not in lines[0]
    with redirect_stdout(io.StringIO()) as js:
        assert status.main([str(tmp_path), "--json"]) == 0
    failures = [json.loads(x)["failure"] for x in js.getvalue().splitlines()]
    assert failures[0] is None and failures[1][0] == 0


# ---- retention: flat per save, set-aside directories cleaned by one rule ---------------------------
def _aside(save_dir: Path, name: str, age_s: float) -> Path:
    path = save_dir / name
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x" * 64)
    for p in (path / "__0_0.distcp", path):
        os.utime(p, (time.time() - age_s, time.time() - age_s))
    return path


def test_set_aside_directories_keep_the_newest_and_never_one_still_changing(tmp_path):
    from orchestrator.ckpt.retention import set_aside_dirs, set_aside_to_remove

    save_dir = tmp_path / "checkpoints"
    old_torn = _aside(save_dir, "iter_0000030.torn.20260101_000000", 3600)
    old_replaced = _aside(save_dir, "iter_0000030.replaced.20260102_000000", 3600)
    busy = _aside(save_dir, "iter_0000040.torn.20260103_000000", 3600)
    (busy / "__1_0.distcp").write_bytes(b"y")  # a file written just now: could still be completing
    newest = _aside(save_dir, "iter_0000050.torn.20260104_000000", 3600)
    _aside(save_dir, "iter_0000060", 3600)  # not set aside: never a candidate
    found = set_aside_dirs(save_dir)
    assert sorted(p.name for p, _ in found) == sorted(p.name for p in (old_torn, old_replaced, busy, newest))
    assert sorted(set_aside_to_remove(found, time.time(), 600.0)) == sorted([old_torn, old_replaced])
    assert set_aside_to_remove(found, time.time(), 7200.0) == []  # nothing has settled for 2 h
    assert set_aside_to_remove(found[:1], time.time() + 1e6, 0.0) == []  # the only one is the newest: kept


def test_the_pruner_verifies_only_the_new_checkpoint_and_deletes_off_the_callers_thread(tmp_path, monkeypatch):
    from test_manifest import pp2_dp2, save_checkpoint

    from orchestrator.ckpt import catalogue
    from orchestrator.ckpt import manifest as mf
    from orchestrator.ckpt.retention import TRASH_PREFIX, Pruner

    cfg = pp2_dp2(tmp_path / "run")
    save_dir = mf.save_dir_of(cfg)
    for it in range(10, 121, 10):
        save_checkpoint(cfg, it, digest="size")
    torn = save_checkpoint(cfg, 125, manifest=False)
    _aside(save_dir, "iter_0000020.torn.20260101_000000", 3600)
    _aside(save_dir, "iter_0000030.replaced.20260102_000000", 3600)
    pruner = Pruner(save_dir, keep_last=3, keep_every=50, settle_s=600)
    pruner._scan.join()  # the job's start: what is on disk is verified once, in the pruner's thread
    verified = []
    monkeypatch.setattr(
        "orchestrator.ckpt.retention.inspect_checkpoint",
        lambda path, verify=True: verified.append(Path(path).name) or catalogue.inspect_checkpoint(path, verify),
    )
    save_checkpoint(cfg, 130, digest="size")
    removed = pruner.after_save(130)
    assert verified == ["iter_0000130"]  # only what was just written
    assert [p.name for p in removed] == [f"iter_{i:07d}" for i in (10, 20, 30, 40, 60, 70, 80, 90)]
    assert pruner.close(timeout_s=60)
    names = sorted(p.name for p in save_dir.iterdir())
    assert names == [
        "iter_0000030.replaced.20260102_000000",
        "iter_0000050",
        "iter_0000100",
        "iter_0000110",
        "iter_0000120",
        "iter_0000125",
        "iter_0000130",
    ]  # the newest set-aside one kept; the torn save untouched
    assert torn.is_dir() and not any(n.startswith(TRASH_PREFIX) for n in names)


# ---- heartbeats: one file read per poll, whatever the number of ranks -------------------------------
def _count_opens():
    import sys

    opened = []
    sys.addaudithook(lambda event, args: opened.append(args[0]) if event == "open" and opened_on[0] else None)
    return opened


opened_on = [False]
OPENED = _count_opens()
"""Every file this process opens while ``opened_on[0]`` (Python's audit hook: ``open`` and ``os.open``)."""


def test_a_poll_at_1024_ranks_opens_one_file_and_still_names_the_stalled_rank(tmp_path):
    from orchestrator.runtime.faults.heartbeat import slots_path, write_slot
    from orchestrator.runtime.faults.watchdog import JobWatch, Watchdog

    world, stalled = 1024, 517
    (tmp_path / "heartbeat").mkdir()

    def beat(alive: int) -> None:
        for r in range(world):
            write_slot(
                slots_path(tmp_path),
                r,
                {
                    "rank": r,
                    "host": f"node{r // 8}",
                    "job_id": "77",
                    "attempt": 0,
                    "iteration": 41,
                    "alive": 1 if r == stalled else alive,
                },
            )

    beat(1)
    watch = JobWatch(tmp_path, "77", world, timeout_s=0.0, grace_s=0.0, every_s=0.0)
    dog = Watchdog(tmp_path, 0, world, "node0", "77", 0, timeout_s=1.0, poll_s=0.3)  # silent: unchanged > 0.9 s
    dog.iteration = 41
    OPENED.clear()
    opened_on[0] = True
    try:
        assert watch.silent_for() == 0.0  # the launcher's poll
        dog._observe()  # a stalling rank's first look at every rank
    finally:
        opened_on[0] = False
    assert [Path(p).name for p in OPENED] == ["ranks", "ranks"], OPENED
    assert len(watch.last) == world and watch.last[stalled]["host"] == "node64"
    time.sleep(1.0)
    beat(2)  # every thread but rank 517's wrote again
    dog._observe()
    assert dog.stalled() == ([stalled], "not responding (process stopped, frozen or dead)")
    assert dog._hosts([stalled]) == "node64"
    time.sleep(0.01)
    assert watch.hung() is None  # the job's threads are writing


def test_a_warm_pool_that_ended_before_its_next_trial_is_named_not_waited_on(tmp_path):
    """The warm ranks' job ended between two points (CI saw it once: the next point waited 20 minutes for a trial
    nobody would run). Its next trial -- no rank of it ever seen, no result -- raises PoolEnded, which the
    launcher answers with fresh ranks (PoolLauncher), not a crash of the point."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from orchestrator.errors import JobFailedError
    from orchestrator.submit.pool import PoolEnded, WarmPool

    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    pool = WarmPool.__new__(WarmPool)  # its state after three trials, without starting ranks
    pool.dir, pool.world_size, pool.forked, pool.seen_all, pool.alive = tmp_path, 4, True, False, True
    pool.cfg = SimpleNamespace(cluster=SimpleNamespace(kind="local", timeout_min=60))
    pool.job = SimpleNamespace(job_id="4242", _process=ended, paths=SimpleNamespace(stderr=str(tmp_path / "err")))
    with pytest.raises(PoolEnded, match=r"^job 4242: the warm ranks' job had ended before trial 3 started$"):
        pool._check(3, time.time(), 600.0)
    assert issubclass(PoolEnded, JobFailedError)
    pool.seen_all = True  # a trial whose ranks were seen and are gone is a failure of that trial, as before
    with pytest.raises(JobFailedError, match=r"warm rank\(s\) \[0, 1, 2, 3\] died without a result \(killed\?") as err:
        pool._check(3, time.time(), 600.0)
    assert not isinstance(err.value, PoolEnded) and "in trial 3" in str(err.value)


def test_a_killed_warm_rank_is_named_with_its_signal(tmp_path):
    """A forked warm rank killed by a signal (kill -9, the OOM killer) is named with it, read from its zombie as for
    a job's forked ranks, whether the launcher sees it gone or its peers' broken collectives first."""
    import os
    import signal
    import subprocess
    import sys
    from types import SimpleNamespace

    from orchestrator.errors import JobFailedError
    from orchestrator.runtime.start.pool import error_path, pid_path
    from orchestrator.submit.pool import WarmPool

    controller = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the pool's job: alive
    victim = os.fork()
    if victim == 0:
        time.sleep(60)
        os._exit(0)
    try:
        os.kill(victim, signal.SIGKILL)  # a zombie until this process reaps it
        pid_path(tmp_path, 3, 0).write_text(str(os.getpid()))
        pid_path(tmp_path, 3, 1).write_text(str(victim))
        pool = WarmPool.__new__(WarmPool)
        pool.dir, pool.world_size, pool.forked, pool.seen_all, pool.alive = tmp_path, 2, True, True, True
        pool.cfg = SimpleNamespace(cluster=SimpleNamespace(kind="local", timeout_min=60))
        pool.job = SimpleNamespace(job_id="77", _process=controller, paths=SimpleNamespace(stderr=str(tmp_path / "e")))
        deadline = time.time() + 10
        while pool._killed(3) == {} and time.time() < deadline:
            time.sleep(0.05)
        with pytest.raises(JobFailedError) as gone:
            pool._check(3, time.time(), 600.0)
        assert str(gone.value).startswith(
            "job 77: warm rank(s) [1] died without a result (exit by signal 9, SIGKILL: killed? out of memory?) in trial 3"
        ), gone.value
        error_path(tmp_path, 3, 0).write_text("Traceback ...\nRuntimeError: Connection closed by peer [10.0.0.1]:123")
        with pytest.raises(JobFailedError) as peers:  # rank 0's broken collective landed first: rank 1 is the cause
            pool._check(3, time.time(), 600.0)
        assert str(peers.value).startswith("job 77: warm rank(s) [1] died without a result (exit by signal 9, SIGKILL")
        assert "its peers' errors followed: RuntimeError: Connection closed by peer" in str(peers.value)
    finally:
        os.waitpid(victim, 0)
        controller.kill()
        controller.wait()


def test_status_tokens_per_s_is_the_jobs_own_figure_once_it_ended(tmp_path):
    """A running job: its step time the median over the iterations after the first (the ETA's pace: a slow first
    iteration does not drag it) and its tokens/s that pace's (tokens per iteration / step time, so the rate and the
    ETA agree); an ended job: its summary's tokens per step / median step time, the figure of its own last line."""
    from orchestrator.submit import run_records

    rows = [{"event": "start", "iteration": 0, "train_iters": 5}]
    rows += [
        {"iteration": i, "tokens_per_s": t, "step_time_s": 2048 / t} for i, t in enumerate([100, 900, 1000, 1100], 1)
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    running = run_records.live_rates(tmp_path)
    assert running["step_time_s"] == pytest.approx(2048 / 1000)
    assert running["tokens_per_s"] == pytest.approx(
        1000
    )  # 2048 tokens an iteration at that pace (not 1100, the newest)
    summary = {"event": "summary", "tokens_per_step": 2048, "step_time_median_s": 2.0, "iteration": 4}
    path.write_text(
        path.read_text() + json.dumps({"event": "saved", "iteration": 4}) + "\n" + json.dumps(summary) + "\n"
    )
    assert run_records.live_rates(tmp_path)["tokens_per_s"] == 1024
