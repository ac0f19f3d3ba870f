"""Hydra multirun sweeps end to end: real points (4 local CPU ranks each), one results table.

The table is checked against what the jobs wrote (``metrics.jsonl``) and against the closed-form
arithmetic (Megatron's FLOPs formula, the 1F1B bubble), so no number in it is invented.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest
from conftest import REPO, losses_by_iteration, run_cli, slurm_unavailable_reason

from orchestrator.sweep import driver as sweep

SHORT = [
    "training.train_iters=5",
    "training.timing_warmup_iters=1",
    "data.stdlib_max_mb=2",
    "checkpoint.save_at_end=false",
    "training.log_interval=1",
]
WARMUP = 1


def sweep_dir_of(root: Path, name: str) -> Path:
    found = sorted((root / "sweeps" / name).iterdir())
    assert len(found) == 1, found
    return found[0]


def read_csv(path: Path) -> List[Dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def metrics_records(run_dir: Path) -> List[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def gpt_tiny_model_flops(gbs: int) -> float:
    """72 B s l h^2 (1 + s/12h + V/12lh) for gpt_tiny (s=128, l=4, h=128) and the byte vocabulary
    258 padded to 384 (Narayanan et al. 2021 without recomputation, i.e. 3 x forward)."""
    s, l, h, v = 128, 4, 128, 384
    return 72 * gbs * s * l * h * h * (1 + s / (12 * h) + v / (12 * l * h))


# ---------------------------------------------------------------- a measured micro-batch sweep
@pytest.fixture(scope="module")
def mbs_sweep(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("sweeps")
    proc = run_cli(
        ["-m", "+experiment=gpt_pp2_dp2", "training.micro_batch_size=2,4", *SHORT, f"run.root={root}", "run.name=mbs"],
        cache=cache_dir,
    )
    return proc, sweep_dir_of(root, "mbs")


@pytest.mark.slow
def test_sweep_table_numbers_are_the_metrics_numbers(mbs_sweep):
    proc, sd = mbs_sweep
    assert proc.stdout.count("[sweep] point 0: completed at iteration 5 of 5") == 1, proc.stdout[-3000:]
    assert proc.stdout.count("[sweep] point 1: completed at iteration 5 of 5") == 1, proc.stdout[-3000:]
    for name in ("summary.csv", "summary.md", "summary.png"):
        assert (sd / name).stat().st_size > 0, name
    assert (sd / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = read_csv(sd / "summary.csv")
    assert [c for c in sweep.COLUMNS if c not in rows[0]] == []
    assert sorted(r["overrides"] for r in rows) == ["training.micro_batch_size=2", "training.micro_batch_size=4"]
    run_dirs = set()
    for row in rows:
        assert row["status"] == "completed", row
        run_dir = Path(row["run_dir"])
        assert run_dir == sd / row["point"]  # every point its own run dir (and checkpoint dir)
        run_dirs.add(run_dir)
        point = json.loads((run_dir / "point.json").read_text())
        assert point["status"] == "completed" and point["job_id"] == row["job_id"] and row["job_id"]
        job = [
            r for r in map(json.loads, (run_dir / "jobs.jsonl").read_text().splitlines()) if r["event"] == "submitted"
        ][-1]
        assert job["job_id"] == row["job_id"] and Path(job["warm_pool"]).parent == sd / ".pool"
        assert (Path(job["folder"]) / f"{row['job_id']}_submitted.pkl").exists()

        records = metrics_records(run_dir)
        summary = [r for r in records if r.get("event") == "summary"][-1]
        iters = [r for r in records if "event" not in r]
        step = float(row["step_time_median_s"])
        # Median after warm-up: the summary's, and recomputable from the per-iteration records.
        assert step == summary["step_time_median_s"]
        assert step == statistics.median(r["step_time_s"] for r in iters if r["iteration"] > WARMUP)
        assert int(row["timed_iterations"]) == 5 - WARMUP == summary["timed_iterations"]
        assert float(row["tokens_per_s"]) == summary["tokens_per_step"] / step == 16 * 128 / step
        assert float(row["samples_per_s"]) == 16 / step
        assert float(row["tflops_per_device"]) == pytest.approx(gpt_tiny_model_flops(16) / step / 4 / 1e12, rel=1e-12)
        assert float(row["peak_rss_mib"]) == max(summary["peak_rss_mb_per_rank"])
        assert float(row["predicted_mib"]) == point["plan"]["peak_bytes"] / 2**20
        mbs = int(row["training.micro_batch_size"])
        m = 16 // (mbs * 2)
        assert float(row["bubble_fraction"]) == pytest.approx((2 - 1) / (m + 2 - 1))
        assert point["measured"]["step_time_median_s"] == step
    assert len(run_dirs) == 2
    assert len({r["job_id"] for r in rows}) == 1  # both points ran on the same warm ranks


@pytest.mark.slow
def test_a_point_on_warm_ranks_trains_exactly_as_a_fresh_job(mbs_sweep, tmp_path, cache_dir):
    """The second point ran on ranks that had already trained the first; a fresh job of the same
    config (its own processes) gives the same loss at every iteration."""
    _, sd = mbs_sweep
    warm = next(Path(r["run_dir"]) for r in read_csv(sd / "summary.csv") if r["point"] == "1")
    assert "training.micro_batch_size=4" in json.loads((warm / "point.json").read_text())["overrides"]
    run_cli(
        ["+experiment=gpt_pp2_dp2", "training.micro_batch_size=4", *SHORT, f"run.root={tmp_path}", "run.name=fresh"],
        cache=cache_dir,
    )
    fresh_losses = losses_by_iteration(tmp_path / "fresh")
    assert sorted(fresh_losses) == [1, 2, 3, 4, 5]
    assert losses_by_iteration(warm) == fresh_losses


@pytest.mark.slow
def test_sweep_ranking_follows_measured_tokens_per_s(mbs_sweep):
    proc, sd = mbs_sweep
    rows = read_csv(sd / "summary.csv")
    speeds = [float(r["tokens_per_s"]) for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    assert [r["rank"] for r in rows] == ["1", "2"]
    best = rows[0]
    assert f"fastest: point {best['point']} ({best['overrides']})" in proc.stdout
    # The printed table lists the points in the same order.
    printed = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "`training." in line]
    assert [line.split("|")[2].strip() for line in printed] == [r["point"] for r in rows]
    md = (sd / "summary.md").read_text()
    assert md.index(f"`{rows[0]['overrides']}`") < md.index(f"`{rows[1]['overrides']}`")


@pytest.mark.slow
def test_summarize_rebuilds_the_same_table(mbs_sweep, tmp_path):
    _, sd = mbs_sweep
    before = {n: (sd / n).read_text() for n in ("summary.csv", "summary.md")}
    for n in ("summary.csv", "summary.md", "summary.png"):
        (sd / n).unlink()
    out = subprocess.run(
        [sys.executable, "-m", "orchestrator.sweep", "summarize", str(sd)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert {n: (sd / n).read_text() for n in before} == before
    assert (sd / "summary.png").exists()
    assert "ranked by measured tokens/s" in out.stdout


# ---------------------------------------------------------------- points that do not run or crash
@pytest.mark.slow
def test_invalid_and_crashing_points_are_recorded_and_the_sweep_exits_nonzero(tmp_path, cache_dir):
    # micro_batch_size=3: 16 % (3 x DP 2) != 0 -> invalid before anything runs.
    # micro_batch_size=8 with an environment the ranks cannot use (OMP_NUM_THREADS=many): a valid
    # config, but the job itself fails inside the ranks (validate refuses every config error first).
    proc = run_cli(
        [
            "-m",
            "+experiment=gpt_pp2_dp2",
            "training.micro_batch_size=3,8",
            "+cluster.env.OMP_NUM_THREADS=many",
            *SHORT,
            f"run.root={tmp_path}",
            "run.name=bad",
        ],
        cache=cache_dir,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    sd = sweep_dir_of(tmp_path, "bad")
    rows = {r["point"]: r for r in read_csv(sd / "summary.csv")}
    assert rows["0"]["status"] == "invalid"
    assert "training.global_batch_size=16 is not divisible" in rows["0"]["reason"] and "16 % 6" in rows["0"]["reason"]
    assert not (sd / "0" / "submitit").exists()  # nothing was submitted for it
    assert rows["1"]["status"] == "failed"
    assert "'many'" in rows["1"]["reason"]
    # It ran on warm ranks (the pool's job); the failing ranks left their tracebacks in the pool's files.
    assert (
        rows["1"]["job_id"] and (sd / ".pool" / "pool_0" / "submitit" / f"{rows['1']['job_id']}_submitted.pkl").exists()
    )
    assert "'many'" in (sd / ".pool" / "pool_0" / "trial_0.rank0.error").read_text()
    assert rows["1"]["tokens_per_s"] == "" and rows["1"]["step_time_median_s"] == ""  # nothing invented
    for num in ("0", "1"):
        point = json.loads((sd / num / "point.json").read_text())
        assert point["status"] == rows[num]["status"] and point["reason"] == rows[num]["reason"]
    assert (sd / "summary.md").exists() and (sd / "summary.png").exists()
    assert "1 failed, 1 invalid" in proc.stdout
    (said,) = [x for x in proc.stderr.splitlines() if x.startswith("error: sweep:")]  # one line, the first failure
    assert said.startswith("error: sweep: 1 of 2 point(s) did not complete; point 1 (") and "rank 0 failed" in said, (
        said
    )


def test_points_predicted_not_to_fit_are_skipped_unless_asked(tmp_path, cache_dir):
    # gpt_6.7b on 4 CPU ranks needs ~180 GiB per rank by the planner, and this machine has a quarter of its
    # memory per rank: skipped (judged on the device that runs, not the gpu preset), nothing runs.
    proc = run_cli(
        [
            "-m",
            "+experiment=gpt_pp2_dp2",
            "model=gpt_6.7b",
            "training.micro_batch_size=3,4",
            f"run.root={tmp_path}",
            "run.name=big",
        ],
        cache=cache_dir,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]  # invalid, none failed
    (said,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert said.startswith("error: sweep: 1 of 2 point(s) invalid; point 0 (training.micro_batch_size=3): "), said
    sd = sweep_dir_of(tmp_path, "big")
    rows = {r["point"]: r for r in read_csv(sd / "summary.csv")}
    assert rows["0"]["status"] == "invalid"
    assert rows["1"]["status"] == "skipped_oom_predicted"
    assert "does not fit" in rows["1"]["reason"] and " on cpu " in rows["1"]["reason"]
    assert "sweep.run_predicted_oom=true" in rows["1"]["reason"]
    import psutil

    assert float(rows["1"]["predicted_mib"]) > psutil.virtual_memory().total / 2**20 / 4
    assert not (sd / "1" / "submitit").exists()


# ---------------------------------------------------------------- summarize while points run
def _write_point(sd: Path, num: int, status: str, records: List[dict], pid: int) -> None:
    d = sd / str(num)
    d.mkdir(parents=True)
    (d / "point.json").write_text(
        json.dumps(
            {
                "point": num,
                "overrides": [f"training.micro_batch_size={2**num}"],
                "status": status,
                "reason": "",
                "job_id": None,
                "run_dir": str(d),
                "driver": {"pid": pid, "host": os.uname().nodename},
                "training": {"train_iters": 10, "timing_warmup_iters": 2},
                "layout": {"world_size": 4, "global_batch_size": 16, "tokens_per_step": 2048},
                "plan": {"gpu": "A100-80GB", "peak_bytes": 2**31, "bubble_fraction": 0.2, "model_flops": 1.2e10},
            }
        )
    )
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"iteration": 9, "lm_l')


def test_summarize_reads_running_points_from_their_metrics(tmp_path):
    sd = tmp_path / "sweep"
    steps = [0.9, 0.5, 0.30, 0.20, 0.25]
    records = [
        {"iteration": i + 1, "lm_loss": 5.0, "step_time_s": t, "tokens_per_s": 2048 / t, "max_rss_mb": 400.0 + i}
        for i, t in enumerate(steps)
    ]
    _write_point(sd, 0, "running", records, pid=os.getpid())  # the driver is alive: running
    _write_point(sd, 1, "running", records[:2], pid=2**22 + 12345)  # a gone driver, no job: interrupted
    # Hydra's record of the whole sweep: 3 points, the third not started yet.
    (sd / "multirun.yaml").write_text(
        "hydra:\n  overrides:\n    task:\n    - +experiment=gpt_pp2_dp2\n    - training.micro_batch_size=1,2,4\n"
    )
    rows, swept = sweep.write_summary(sd)
    assert swept == ["training.micro_batch_size"]
    assert [(r["point"], r["status"], r["overrides"]) for r in rows][-1] == (
        2,
        "pending",
        "training.micro_batch_size=4",
    )
    by_point = {r["point"]: r for r in rows}
    run = by_point[0]
    assert run["status"] == "running" and run["rank"] == 1
    assert run["step_time_median_s"] == statistics.median(steps[2:])  # the first 2 (warm-up) excluded
    assert run["tokens_per_s"] == 2048 / run["step_time_median_s"]
    assert run["peak_rss_mib"] == 404.0 and run["iteration"] == 5
    assert "iteration 5/10" in run["reason"]
    gone = by_point[1]
    assert gone["status"] == "interrupted" and gone["step_time_median_s"] is None
    assert sweep.exit_code(rows) == 1
    assert (sd / "summary.csv").exists() and (sd / "summary.png").exists()


def test_exit_code_rules():
    def rows(*statuses):
        return [{"status": s} for s in statuses]

    assert sweep.exit_code(rows("completed", "skipped_oom_predicted", "planned")) == 0
    assert sweep.exit_code(rows("completed", "invalid")) == 2
    assert sweep.exit_code(rows("invalid", "failed")) == 1
    assert sweep.exit_code(rows("completed", "submitted")) == 1
    assert sweep.exit_code(rows("completed", "submitted"), unfinished_ok=True) == 0


# ---------------------------------------------------------------- SLURM: the same sweep, points queued at once
@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.skipif(
    bool(slurm_unavailable_reason()), reason=f"SLURM dev cluster not reachable: {slurm_unavailable_reason()}"
)
def test_slurm_sweep_queues_every_point_and_builds_the_same_table(tmp_path, cache_dir):
    proc = run_cli(
        [
            "-m",
            "+experiment=gpt_pp2_dp2",
            "parallelism=none",  # one rank a point: what is tested is the queue and the table, not a layout
            "cluster=slurm_dev",
            "cluster.tasks_per_node=1",
            "training.micro_batch_size=2,4",
            *SHORT,
            "cluster.timeout_min=5",
            "cluster.max_num_timeout=0",
            f"run.root={tmp_path}",
            "run.name=slurm",
        ],
        cache=cache_dir,
        timeout=900,
    )
    sd = sweep_dir_of(tmp_path, "slurm")
    rows = read_csv(sd / "summary.csv")
    assert [c for c in sweep.COLUMNS if c not in rows[0]] == []
    assert [r["status"] for r in rows] == ["completed", "completed"]
    assert len({r["job_id"] for r in rows}) == 2 and all(r["job_id"].isdigit() for r in rows)
    # Both jobs were queued before the driver waited for either.
    assert proc.stdout.index("point 1: submitted") < proc.stdout.index("waiting for 2 SLURM job(s)")
    for r in rows:
        summary = [x for x in metrics_records(Path(r["run_dir"])) if x.get("event") == "summary"][-1]
        assert float(r["step_time_median_s"]) == summary["step_time_median_s"]


def _both_queued_and_point_0_done(sweeps: Path) -> bool:
    """Point 0's rank has written its result and point 1's job is queued (under load its sample indices can take
    longer to build than point 0 takes to train: a signal then finds point 1 not yet queued, a case of its own)."""
    if not list(sweeps.glob("*/0/submitit/*_0_result.pkl")):
        return False
    point1 = list(sweeps.glob("*/1/point.json"))
    return bool(point1) and json.loads(point1[0].read_text()).get("job_id") is not None


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.skipif(
    bool(slurm_unavailable_reason()), reason=f"SLURM dev cluster not reachable: {slurm_unavailable_reason()}"
)
def test_a_signal_to_a_slurm_sweep_detaches_from_every_queued_point(tmp_path, cache_dir):
    """SIGHUP to a SLURM sweep's launcher once point 0's job has completed (its result files are there:
    the launcher is then in point 0's wait, between the two waits, or in point 1's, and the test does not
    need to know which): exit 0, no traceback, one line naming point 1's job with the `status`, `summarize`
    and `stop` commands, point 1's job left running (point.json: submitted, detached). Its `stop ... --now`
    ends it. Before, a signal between two waits exited 130, and one in a wait named only that point's job."""
    import signal
    import time

    args = [
        "-m",
        "+experiment=gpt_pp2_dp2",
        "parallelism=none",  # one rank a point (point 1 trains until it is stopped: one rank's CPU, not two)
        "cluster=slurm_dev",
        "cluster.tasks_per_node=1",
        "training.train_iters=4,2000",
        *SHORT[1:],
        "checkpoint.save_interval=100000",
        "cluster.timeout_min=5",
        "cluster.max_num_timeout=0",
        f"run.root={tmp_path}",
        "run.name=hup",
    ]
    env = dict(os.environ, ORCHESTRATOR_CACHE=str(cache_dir), PYTHONUNBUFFERED="1")
    log = tmp_path / "out.txt"
    with open(log, "w") as out:
        cli = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", *args], cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 400
        while not _both_queued_and_point_0_done(tmp_path / "sweeps" / "hup"):
            assert cli.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        cli.send_signal(signal.SIGHUP)
        assert cli.wait(timeout=60) == 0, log.read_text()[-3000:]
    finally:
        if cli.poll() is None:
            cli.kill()
    sd = sweep_dir_of(tmp_path, "hup")
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert json.loads((sd / "0" / "point.json").read_text())["status"] == "completed"  # its results were there
    point1 = json.loads((sd / "1" / "point.json").read_text())
    assert point1["status"] == "submitted" and "the launcher detached (SIGHUP)" in point1["reason"], point1
    line = [ln for ln in text.splitlines() if "detached" in ln and "point.json" not in ln]
    assert len(line) == 1 and line[0].startswith("[orchestrator] detached (SIGHUP) from the sweep: SLURM job(s) "), (
        text[-3000:]
    )
    for said in (
        f"{point1['job_id']} (point 1)",
        f"`python -m orchestrator status {sd}`",
        f"`python -m orchestrator sweep summarize {sd}`",
        f"`python -m orchestrator stop {sd}/<point>`",
    ):
        assert said in line[0], (said, line[0])
    assert "(point 0)" not in line[0], line[0]
    queued = subprocess.run(["squeue", "-h", "-j", point1["job_id"], "-o", "%T"], capture_output=True, text=True)
    assert queued.stdout.strip() in ("PENDING", "RUNNING"), queued  # untouched: it runs on
    stop = subprocess.run(
        [sys.executable, "-m", "orchestrator", "stop", str(sd / "1"), "--now"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert stop.returncode == 0, stop.stdout + stop.stderr
