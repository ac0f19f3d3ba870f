"""``checkpoint.save_interval=auto`` (issue 39 item 3): Young–Daly's interval sqrt(2 C M) in iterations, chosen
on every rank alike, re-chosen after each save from its measured blocking time, within the auto bounds.

The rule tests are pure Python; the ``slow`` one trains gpt_tiny at DP 2 (two ranks that must agree on every
save, or the collective save hangs) with a job MTBF small enough that the interval lands inside the bounds.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import run_cli

from orchestrator.config.schema import JobConfig
from orchestrator.pipeline import goodput_forecast
from orchestrator.plan.ckpt_size import save_iterations
from orchestrator.plan.goodput import NODE_MTBF_HOURS, interval_iterations, job_mtbf, young_daly_s


def test_the_job_mtbf_comes_from_the_config_then_the_history_then_the_fleet():
    assert job_mtbf(2.0, 8, failures=3, wall_s=100.0) == (7200.0, "cluster.mtbf_hours=2")
    s, why = job_mtbf(None, 8, failures=4, wall_s=7200.0)
    assert s == 1800.0 and why.startswith("this run's history: 4 failure(s) in 2 h")
    s, why = job_mtbf(None, 4)
    assert s == pytest.approx(NODE_MTBF_HOURS * 3600 / 4) and "/ 4 node(s)" in why
    # sqrt(2 C M): C = 2 s, M = 10,000 s -> 200 s; at 0.5 s per step, 400 iterations, clipped to the bounds
    assert young_daly_s(2.0, 10_000.0) == pytest.approx(200.0)
    assert interval_iterations(2.0, 10_000.0, 0.5) == 400
    assert interval_iterations(2.0, 10_000.0, 0.5, 10, 100) == 100
    assert interval_iterations(0.001, 1.0, 0.5, 10, None) == 10


def test_plan_forecasts_auto_at_its_young_daly_interval_and_space_counts_the_most_saves():
    cfg = JobConfig()
    cfg.training.train_iters = 100
    cfg.checkpoint.save_interval, cfg.checkpoint.auto_min_interval = "auto", 20
    cfg.cluster.mtbf_hours = 1.0
    fc = goodput_forecast(cfg, step_s=0.5)
    want = max(20, round(math.sqrt(2 * fc.save_s * 3600.0) / 0.5))
    assert fc.auto and fc.interval_iters == want and fc.mtbf_s == 3600.0
    assert "checkpoint.save_interval=auto: " in fc.lines()[1] and "cluster.mtbf_hours=1" in fc.lines()[0]
    assert save_iterations(cfg) == [20, 40, 60, 80, 100]  # the most auto may save: every auto_min_interval


@pytest.mark.parametrize(
    "override, said",
    [
        (
            "checkpoint.save_interval=sometimes",
            "checkpoint.save_interval='sometimes': must be an integer >= 0, auto or null",
        ),
        ("checkpoint.save_interval=-5", "checkpoint.save_interval=-5: must be an integer >= 0, auto or null"),
        ("checkpoint.auto_min_interval=0", "checkpoint.auto_min_interval=0: must be a positive integer"),
        ("cluster.mtbf_hours=-1", "cluster.mtbf_hours=-1.0: must be a finite number > 0 or null"),
    ],
)
def test_bad_interval_settings_are_one_line_exit_2(tmp_path, cache_dir, override, said):
    proc = run_cli(["model=gpt_tiny", f"run.root={tmp_path}", override], cache=cache_dir, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert line.startswith(f"error: {said}"), line
    assert not any(tmp_path.iterdir())  # nothing written


def test_auto_max_below_min_is_refused(tmp_path, cache_dir):
    args = ["model=gpt_tiny", f"run.root={tmp_path}", "checkpoint.save_interval=auto", "checkpoint.auto_min_interval=9"]
    proc = run_cli([*args, "checkpoint.auto_max_interval=4"], cache=cache_dir, check=False)
    assert proc.returncode == 2 and proc.stderr.startswith(
        "error: checkpoint.auto_max_interval=4: below checkpoint.auto_min_interval=9"
    ), proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.slow
def test_auto_saves_at_the_young_daly_interval_of_each_measured_save(tmp_path, cache_dir):
    low, high, iters = 2, 12, 26
    run_cli(
        [
            "model=gpt_tiny",
            "parallelism=none",
            "parallelism.data_parallel_size=2",
            "data.stdlib_max_mb=2",
            "training.eval_iters=0",
            "training.log_interval=10",
            "training.micro_batch_size=1",
            "training.global_batch_size=2",
            f"training.train_iters={iters}",
            "logging.tensorboard=false",
            "checkpoint.save_interval=auto",
            f"checkpoint.auto_min_interval={low}",
            f"checkpoint.auto_max_interval={high}",
            "checkpoint.keep_last=null",
            "cluster.mtbf_hours=0.00007",  # 0.25 s: C ~0.1 s, steps ~0.04 s quiet: ~6 iterations, inside [2, 12]
            f"run.root={tmp_path}",
            "run.name=auto",
        ],
        cache=cache_dir,
    )
    records = [json.loads(x) for x in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    choices = [r for r in records if r.get("event") == "save_interval"]
    saved = [r for r in records if r.get("event") == "saved"]
    # the first choice once auto_min_interval iterations ran, from the planner's predicted save cost
    assert choices[0]["iteration"] == low and choices[0]["save_s_source"] == "predicted", choices[0]
    for c in choices:  # each interval is Young-Daly's of its own logged inputs, clipped to the bounds
        raw = round(math.sqrt(2 * c["save_s"] * c["mtbf_s"]) / c["step_s"])
        assert c["interval"] == min(high, max(low, raw)), c
        assert c["mtbf_source"] == "cluster.mtbf_hours=7e-05" and c["bounds"] == [low, high]
    # every save happens where the choice before it said, and is followed by a choice from its measured cost
    at, expected = 0, []
    for c in choices:
        assert c["next_save"] == at + c["interval"], (c, at)
        if c["next_save"] >= iters:
            break
        expected.append(c["next_save"])
        at = c["next_save"]
    periodic = [s for s in saved if s["iteration"] < iters]
    assert [s["iteration"] for s in periodic] == expected and len(expected) >= 2, (choices, saved)
    for s, c in zip(periodic, choices[1:]):
        assert c["iteration"] == s["iteration"] and c["save_s_source"] == "measured"
        assert c["save_s"] == pytest.approx(s["blocking_s"], abs=1e-4), (s, c)
    on_disk = sorted(int(p.name[5:]) for p in (tmp_path / "auto" / "checkpoints").glob("iter_*"))
    assert on_disk == expected + [iters]
