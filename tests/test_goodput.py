"""The goodput account (ckpt.goodput) over hand-built records whose every second is known, and the forecast's
formula (plan.goodput); the account of real runs is checked where those runs already happen (test_train's
in-place restart and resumed runs)."""

from __future__ import annotations

import math

import pytest

from orchestrator.ckpt.goodput import CAUSES, account_from_records
from orchestrator.ckpt.goodput_report import draw_timeline, one_line, table
from orchestrator.plan.goodput import expected_ettr, forecast, interval_iterations, young_daly_s


def _two_attempts():
    """A SLURM run: queued 10 s, start-up 10 s, iterations 1..8 (1 s each, a save at 4 blocking 0.5 s), a crash seen
    3 s after iteration 8; requeued, it loads iteration 4's checkpoint (1 s) and trains 5..10, saves at 10 and
    completes. Every second of the 49 s wall is accounted by hand in the test."""
    jobs = [
        {"event": "submitted", "job_id": "7", "cluster": "slurm", "time": 0.0},
        {"event": "job_running", "job_id": "7", "attempt": 0, "time": 10.0},
        {"event": "attempt_started", "job_id": "7", "attempt": 0, "iteration": 0, "time": 15.0},
        {"event": "attempt_ended", "job_id": "7", "attempt": 0, "cause": "crashed", "iteration": 8, "time": 31.0},
        {"event": "submitted", "job_id": "8", "cluster": "slurm", "time": 33.0},
        {"event": "job_running", "job_id": "8", "attempt": 0, "time": 38.0},
        {"event": "attempt_started", "job_id": "8", "attempt": 0, "iteration": 4, "time": 40.0},
        {"event": "attempt_ended", "job_id": "8", "attempt": 0, "cause": "completed", "iteration": 10, "time": 49.0},
    ]
    metrics = [{"event": "start", "iteration": 0, "load_s": None, "time": 20.0}]
    metrics += [{"iteration": i, "step_time_s": 1.0, "time": 20.0 + i} for i in range(1, 9)]
    metrics.insert(5, {"event": "saved", "iteration": 4, "started": 24.0, "blocking_s": 0.5, "time": 24.5})
    metrics.append({"event": "start", "iteration": 4, "load_s": 1.0, "time": 42.0})
    metrics += [{"iteration": i, "step_time_s": 1.0, "time": 38.0 + i} for i in range(5, 11)]
    metrics.append({"event": "saved", "iteration": 10, "started": 48.0, "blocking_s": 0.5, "time": 48.5})
    return jobs, metrics


def test_every_second_of_a_crashed_and_requeued_run_has_its_cause():
    jobs, metrics = _two_attempts()
    acc = account_from_records(jobs, metrics)
    want = {
        "productive": 4.0 + 6.0,  # 1..4 of the first attempt, 5..10 of the second
        "queued": 10.0,
        "start-up": 10.0,
        "checkpoint load": 1.0,
        "save blocking": 1.0,
        "lost work": 3.5,  # 5..8 of the first attempt, less the save's half second inside iteration 5
        "failure detection and restart": 3.0 + 10.0,  # last iteration -> crash seen; crash -> the load
        "shutdown": 0.5,
    }
    assert acc.wall_s == 49.0
    assert {c: round(v, 9) for c, v in acc.seconds.items() if v} == want
    assert set(acc.seconds) == set(CAUSES) and math.isclose(sum(acc.seconds.values()), acc.wall_s)
    assert math.isclose(acc.ettr, 10.0 / 49.0)
    assert (acc.kept_iterations, acc.lost_iterations, acc.attempts, acc.live) == (10, 4, 2, False)
    assert [(f.time, f.cause) for f in acc.failures] == [(31.0, "crashed")]


def test_a_run_that_ends_in_a_failure_loses_what_it_trained_past_its_last_save():
    jobs, metrics = _two_attempts()
    jobs, metrics = jobs[:4], metrics[:10]  # the crash was the end: no requeue
    acc = account_from_records(jobs, metrics)
    assert acc.lost_iterations == 4 and acc.kept_iterations == 4
    assert math.isclose(acc.seconds["lost work"], 3.5) and math.isclose(acc.seconds["productive"], 4.0)
    assert math.isclose(sum(acc.seconds.values()), acc.wall_s) and acc.wall_s == 31.0


def test_iterations_a_failed_start_ran_past_its_last_record_are_lost_work_not_detection():
    """Records every 7 iterations (7 at 17 s, 14 at 24 s, a save at 14); a rank killed at iteration 18, 4.5 s after
    the record at 14 (seen at 28.5 s); the requeued job loads 14 and trains 15..21. Iterations 15..18 ran between
    24 and 28.5 s and were redone: lost work, as the history's "4 iteration(s) lost" says (before: 0 lost, and the
    4.5 s went to failure detection)."""
    jobs = [
        {"event": "submitted", "job_id": "1", "cluster": "local", "time": 0.0},
        {"event": "attempt_started", "job_id": "1", "attempt": 0, "iteration": 0, "time": 5.0},
        {"event": "attempt_ended", "job_id": "1", "attempt": 0, "cause": "crashed", "iteration": 18, "time": 28.5},
        {"event": "submitted", "job_id": "2", "cluster": "local", "time": 30.0},
        {"event": "attempt_started", "job_id": "2", "attempt": 0, "iteration": 14, "time": 31.0},
        {"event": "attempt_ended", "job_id": "2", "attempt": 0, "cause": "completed", "iteration": 21, "time": 40.0},
    ]
    metrics = [{"event": "start", "iteration": 0, "load_s": None, "time": 10.0}]
    metrics += [{"iteration": i, "step_time_s": 1.0, "time": 10.0 + i} for i in (7, 14)]
    metrics.append({"event": "saved", "iteration": 14, "started": 24.0, "blocking_s": 0.0, "time": 24.0})
    metrics.append({"event": "start", "iteration": 14, "load_s": 1.0, "time": 32.0})
    metrics.append({"iteration": 21, "step_time_s": 1.0, "time": 39.0})
    acc = account_from_records(jobs, metrics)
    assert (acc.kept_iterations, acc.lost_iterations) == (21, 4)
    assert math.isclose(acc.seconds["lost work"], 4.5) and math.isclose(acc.seconds["productive"], 14.0 + 7.0)
    assert math.isclose(acc.seconds["failure detection and restart"], 2.5)  # 28.5 -> the new start at 31, then the load
    assert math.isclose(sum(acc.seconds.values()), acc.wall_s)


def test_a_run_whose_last_attempt_ended_unsaved_loses_what_it_trained_past_its_last_save():
    """A double Ctrl-C at iteration 30 (records every 10, no checkpoint), or ``stop --now`` there with the last save
    at 20: the iterations past the last save are gone with the processes (before: all 30 "kept")."""
    for saved, kept in ((None, 0), (20, 20)):
        jobs = [
            {"event": "submitted", "job_id": "1", "cluster": "local", "time": 0.0},
            {"event": "attempt_started", "job_id": "1", "attempt": 0, "iteration": 0, "time": 1.0},
            {
                "event": "attempt_ended",
                "job_id": "1",
                "attempt": 0,
                "cause": "interrupted",
                "iteration": 30,
                "time": 33.5,
            },
        ]
        metrics = [{"event": "start", "iteration": 0, "load_s": None, "time": 2.0}]
        metrics += [{"iteration": i, "step_time_s": 1.0, "time": 2.0 + i} for i in (10, 20, 30)]
        if saved:
            metrics.insert(3, {"event": "saved", "iteration": saved, "started": 22.0, "blocking_s": 0.0, "time": 22.0})
        acc = account_from_records(jobs, metrics)
        assert (acc.kept_iterations, acc.lost_iterations) == (kept, 30 - kept), saved
        assert math.isclose(acc.seconds["productive"], float(kept)) and math.isclose(
            acc.seconds["lost work"], 30.0 - kept
        )
        assert math.isclose(sum(acc.seconds.values()), acc.wall_s)


def test_a_live_run_is_accounted_to_now_and_records_every_log_interval_cover_their_iterations():
    jobs = [
        {"event": "submitted", "job_id": "1", "cluster": "local", "time": 100.0},
        {"event": "attempt_started", "job_id": "1", "attempt": 0, "iteration": 0, "time": 102.0},
    ]
    metrics = [{"event": "start", "iteration": 0, "load_s": None, "time": 103.0}]
    metrics += [{"iteration": i, "step_time_s": 1.0, "time": 103.0 + i} for i in (10, 20)]  # log_interval 10
    acc = account_from_records(jobs, metrics, now=130.0)
    assert acc.live and acc.wall_s == 30.0 and acc.kept_iterations == 20
    # a local job starts at once (no queue); the 7 s since the last record are iterations in flight
    assert {c: v for c, v in acc.seconds.items() if v} == {"productive": 27.0, "start-up": 3.0}


def test_the_account_is_said_and_drawn(tmp_path):
    acc = account_from_records(*_two_attempts())
    assert one_line(acc).startswith("goodput: ETTR 20.4% of 49.0 s wall (2 attempts, 1 failure); the rest: ")
    text = table(acc, "runs/x")
    assert "ETTR 20.4%" in text and "failure detection and restart" in text and "100.0%" in text.splitlines()[-3]
    png = draw_timeline(acc, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_the_forecast_is_young_daly():
    # C = 10 s, M = 10 h: tau* = sqrt(2 C M) = 848.5 s; ETTR there beats 4x shorter and 4x longer intervals
    c, m, r = 10.0, 36000.0, 120.0
    tau = young_daly_s(c, m)
    assert math.isclose(tau, math.sqrt(2 * c * m))
    best = expected_ettr(tau, c, m, r)
    assert best > expected_ettr(tau / 4, c, m, r) and best > expected_ettr(tau * 4, c, m, r)
    assert math.isclose(best, tau / ((m + r) * math.expm1((tau + c) / m)))
    assert math.isclose(best, (tau / (tau + c)) / (1 + (r + (tau + c) / 2) / m), rel_tol=1e-3)  # its first order
    assert interval_iterations(c, m, step_s=2.0) == round(tau / 2.0)
    f = forecast(nodes=4, step_s=2.0, save_s=c, load_s=5.0, interval_iters=100, in_place=True)
    assert f.best_ettr >= f.ettr and f.restart_s == 125.0 and f.best_interval_iters > 0
    with pytest.raises(ValueError):
        expected_ettr(0.0, c, m, r)


def test_the_forecast_is_the_mean_of_poisson_failures_while_the_job_is_up():
    """Failures at rate 1/M while the job trains, saves or redoes lost work (bench/goodput.py injects them so),
    each costing R and the work since the last completed save: 200,000 simulated failures at M = 60 s, R = 23.4 s,
    tau = 23.74 s, C = 0.79 s (bench/goodput.py's regime at T = 60 s) give the forecast's ETTR
    within 0.3 points; the first-order form (half a cycle lost per failure, failures only during kept work) was
    4 points above."""
    import random

    m, r, tau, c = 60.0, 23.4, 23.74, 0.79
    rng, kept, wall = random.Random(39), 0.0, 0.0
    for _ in range(200_000):
        g = rng.expovariate(1.0 / m)
        kept += (g // (tau + c)) * tau
        wall += g + r
    assert abs(expected_ettr(tau, c, m, r) - kept / wall) < 0.003, (expected_ettr(tau, c, m, r), kept / wall)
    assert (tau / (tau + c)) / (1 + (r + (tau + c) / 2) / m) - kept / wall > 0.04


def test_a_slurm_state_that_cannot_be_read_is_never_taken_as_the_jobs_end():
    """issue 39: scontrol and squeue both unanswered (the controller unreachable) -> UNREADABLE, which the launcher's
    wait polls again; only SLURM's own word that it does not know the job (purged) is an end."""
    from orchestrator.slurm import UNREADABLE, slurm_state
    from orchestrator.submit.jobs import SLURM_ENDED

    down = ("sh", "-c", "echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1")
    purged = ("sh", "-c", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1")
    assert slurm_state("424242", squeue=down) == (UNREADABLE, 0) and UNREADABLE not in SLURM_ENDED
    assert slurm_state("424242", squeue=purged) == ("UNKNOWN", 0) and "UNKNOWN" in SLURM_ENDED


def test_a_death_no_rank_lived_to_record_is_down_time_and_a_failure():
    """bench/goodput.py's every-7 run at T = 60 s: rank 2 killed during a save; its peers, blocked, never failed
    by themselves and their agents stopped them (SIGTERM, SIGKILL 30 s later, node after node): 65 s without an
    ``attempt_ended`` until the ranks started again in place. The account counted those 65 s productive (the time
    after an attempt's last record is iterations in flight) and listed no failure. Iterations 1..10 (1 s each,
    a save at 10), the death at 18, the restart at 40 (load 1 s), iterations 11..20, completed at 52."""
    jobs = [
        {"event": "submitted", "job_id": "5", "cluster": "slurm", "time": 0.0},
        {"event": "attempt_started", "job_id": "5", "attempt": 0, "iteration": 0, "time": 5.0},
        {"event": "rank_signalled", "job_id": "5", "attempt": 0, "rank": 2, "time": 18.0, "message": "rank 2 died"},
        {"event": "rank_signalled", "job_id": "5", "attempt": 0, "rank": 3, "time": 30.0, "message": "rank 3 died"},
        {"event": "attempt_started", "job_id": "5", "attempt": 0, "iteration": 10, "restart": 1, "time": 40.0},
        {"event": "attempt_ended", "job_id": "5", "attempt": 0, "cause": "completed", "iteration": 20, "time": 52.0},
    ]
    metrics = [{"event": "start", "iteration": 0, "load_s": None, "time": 6.0}]
    metrics += [{"iteration": i, "step_time_s": 1.0, "time": 6.0 + i} for i in range(1, 11)]
    metrics.append({"event": "saved", "iteration": 10, "started": 16.0, "blocking_s": 0.0, "time": 16.0})
    metrics.append({"event": "start", "iteration": 10, "load_s": 1.0, "time": 41.0})
    metrics += [{"iteration": i, "step_time_s": 1.0, "time": 31.0 + i} for i in range(11, 21)]
    acc = account_from_records(jobs, metrics)
    want = {
        "queued": 5.0,
        "start-up": 1.0,
        "productive": 20.0,
        "failure detection and restart": 24.0,  # the last record at 16 -> the restart at 40 (was productive)
        "checkpoint load": 1.0,
        "shutdown": 1.0,
    }
    assert {c: round(v, 9) for c, v in acc.seconds.items() if v} == want
    assert math.isclose(sum(acc.seconds.values()), acc.wall_s) and acc.wall_s == 52.0
    assert [(f.time, f.cause, f.attempt) for f in acc.failures] == [(18.0, "crashed", "5.0")]  # one, the first death
