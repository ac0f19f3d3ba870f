"""Batch-size ramp-up (``training.rampup_batch_size``, issue 37 item 5) in real jobs on CPU ranks.

GPT tiny, MBS 1, GBS 12, ramp ``[4, 4, 16]``: megatron-core's calculator gives batches 4, 4, 8, 12, 12, 12 over
6 iterations (consumed 4, 8, 16, 28, 40, 52). One iteration-0 checkpoint (one rank) starts every run, so PP2 x DP2
and PP1 x DP4 train the same weights on the same samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import losses_by_iteration, read_metrics, run_cli

ITERS = 6
RAMP = ["training.micro_batch_size=1", "training.global_batch_size=12", "training.rampup_batch_size=[4,4,16]"]
BASE = [
    "+experiment=gpt_pp2_dp2",
    "data.stdlib_max_mb=2",
    "training.log_interval=1",
    "training.eval_iters=0",
    f"training.train_iters={ITERS}",
    "checkpoint.save_interval=null",
    "optimizer.lr_warmup_iters=2",
    "training.breakdown_interval=0",
    *RAMP,
]
DP4 = ["parallelism=none", "parallelism.data_parallel_size=4"]


def calculator_batches(dp: int, iterations: int):
    """(num_microbatches, global batch) per iteration from megatron-core's own calculator, as the loop asks it."""
    from megatron.core import num_microbatches_calculator as nmc

    from orchestrator.config.ramp import step_schedule

    options = dict(rank=1, global_batch_size=12, micro_batch_size=1, data_parallel_size=dp)
    if hasattr(nmc, "RampupBatchsizeNumMicroBatchesCalculator"):  # megatron-core 0.16.1
        options["rampup_batch_size"] = [4, 4, 16]
    else:  # 0.19: the step schedule (equal to 0.16.1's ramp: tests/test_rampup.py's unit test on that line)
        options["step_batch_size_schedule"] = step_schedule([4, 4, 16], 12)
    nmc.destroy_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(**options)
    out, consumed = [], 0
    for _ in range(iterations):
        nmc.update_num_microbatches(consumed_samples=consumed, consistency_check=True)
        out.append((nmc.get_num_microbatches(), nmc.get_current_global_batch_size()))
        consumed += out[-1][1]
    nmc.destroy_num_microbatches_calculator()
    return out


@pytest.fixture(scope="module")
def init(tmp_path_factory, cache_dir) -> Path:
    root = tmp_path_factory.mktemp("ramp_init")
    run_cli(BASE + ["parallelism=none", f"run.root={root}", "run.name=init", "training.train_iters=0"], cache=cache_dir)
    return root / "init" / "checkpoints" / "iter_0000000"


@pytest.fixture(scope="module")
def pp2_dp2(tmp_path_factory, cache_dir, init) -> Path:
    root = tmp_path_factory.mktemp("ramp_pp2")
    run_cli(BASE + [f"checkpoint.init_from={init}", f"run.root={root}", "run.name=full"], cache=cache_dir)
    return root / "full"


@pytest.mark.slow
@pytest.mark.mcore_lines
def test_the_ramp_follows_megatron_cores_calculator_and_layouts_agree(tmp_path, cache_dir, init, pp2_dp2):
    """Every iteration's batch and micro-batch count is the calculator's (DP 2 and DP 4), consumed samples add up,
    the manifest records the ramp, and PP1 x DP4 reproduces PP2 x DP2's losses (the layout tolerance, 1e-3 rel)."""
    run_cli(BASE + DP4 + [f"checkpoint.init_from={init}", f"run.root={tmp_path}", "run.name=dp4"], cache=cache_dir)
    for run_dir, dp in ((pp2_dp2, 2), (tmp_path / "dp4", 4)):
        records = read_metrics(run_dir)
        expected = calculator_batches(dp, ITERS)
        assert [(r["num_microbatches"], r["batch_size"]) for r in records] == expected
        assert [b for _, b in expected] == [4, 4, 8, 12, 12, 12]
        assert [r["consumed_samples"] for r in records] == [4, 8, 16, 28, 40, 52]
        manifest = json.loads((run_dir / "checkpoints" / f"iter_{ITERS:07d}" / "manifest.json").read_text())
        assert manifest["consumed_samples"] == 52 and manifest["batch"]["rampup_batch_size"] == [4, 4, 16]
    # status and the launcher's ETA count samples down: 52 in all (not 6 x 12), 44 left after iteration 2
    from orchestrator.submit.run_records import remaining_s

    lines = (pp2_dp2 / "metrics.jsonl").read_text().splitlines()
    start = next(json.loads(line) for line in lines if '"event": "start"' in line)
    assert start["train_samples"] == 52
    assert remaining_s(2, ITERS, 1.0, read_metrics(pp2_dp2)[1], start["train_samples"], 0.25) == 44 * 0.25
    a, b = losses_by_iteration(pp2_dp2), losses_by_iteration(tmp_path / "dp4")
    assert sorted(a) == sorted(b) == list(range(1, ITERS + 1))
    for it in a:
        assert abs(a[it] - b[it]) <= 1e-3 * abs(a[it]), (it, a[it], b[it])
    # the LR schedule in samples (Megatron-LM's): warm-up 2 x 12 = 24 samples, stepped by each batch
    lrs = [r["lr"] for r in read_metrics(pp2_dp2)]
    assert lrs[:3] == pytest.approx([0.0, 1e-3 * 4 / 24, 1e-3 * 8 / 24], rel=1e-6)


@pytest.mark.slow
@pytest.mark.mcore_lines
def test_a_resume_mid_ramp_continues_at_the_ramps_batch(tmp_path, cache_dir, init, pp2_dp2):
    """Stopped after iteration 2 (8 samples, batch 4), resumed: iteration 3 trains 8 samples, the rest 12, and the
    losses are the uninterrupted run's (1e-5 rel). A resume that changes the ramp is refused before anything
    is queued; so is a bad ramp (one line, exit 2, nothing written)."""
    common = BASE + [f"checkpoint.init_from={init}", f"run.root={tmp_path}", "run.name=cut"]
    first = run_cli(common + ["training.exit_after_iters=2"], cache=cache_dir)
    assert "exited: iteration 2" in first.stdout
    changed = run_cli(common + ["training.rampup_batch_size=[4,8,16]"], cache=cache_dir, check=False)
    assert changed.returncode == 2 and "training.rampup_batch_size" in changed.stderr
    assert "training.rampup_batch_size=[4,4,16]" in changed.stderr  # the override that matches
    run_cli(common, cache=cache_dir)
    records = read_metrics(tmp_path / "cut")
    assert [(r["iteration"], r["batch_size"], r["consumed_samples"]) for r in records[2:]] == [
        (3, 8, 16),
        (4, 12, 28),
        (5, 12, 40),
        (6, 12, 52),
    ]
    want, got = losses_by_iteration(pp2_dp2), losses_by_iteration(tmp_path / "cut")
    for it in range(3, ITERS + 1):
        assert abs(want[it] - got[it]) <= 1e-5 * abs(want[it]), (it, want[it], got[it])
    bad = run_cli(
        BASE + [f"run.root={tmp_path}", "run.name=bad", "training.rampup_batch_size=[3,4,16]"],
        cache=cache_dir,
        check=False,
    )
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: training.rampup_batch_size=[3,4,16]: the start (3) is not divisible by training.micro_batch_size x "
        "DP = 1 x 2 = 2, so a ramp batch is not whole micro-batches on every DP rank; fix: start and increment "
        "multiples of 2, e.g. training.rampup_batch_size=[2,2,16]"
    ], bad.stderr
    assert not (tmp_path / "bad").exists()


def test_the_step_schedule_for_megatron_core_0_19_is_0_16_1s_ramp_at_every_count():
    """megatron-core 0.19 has no ramp calculator: its step schedule (config.ramp.step_schedule) must give 0.16.1's
    ramp batch at every consumed-sample count (checked against 0.16.1's own calculator, on that line)."""
    from megatron.core import num_microbatches_calculator as nmc

    from orchestrator.config.ramp import iterations_for, samples_after, step_schedule

    if not hasattr(nmc, "RampupBatchsizeNumMicroBatchesCalculator"):
        pytest.skip("megatron-core 0.19 has no ramp calculator to compare with")
    for start, inc, samples, gbs in ((4, 4, 16, 12), (4, 4, 10, 16), (16, 16, 5859375, 1536), (2, 2, 3, 10)):
        calc = nmc.RampupBatchsizeNumMicroBatchesCalculator(gbs, 1, 1, False, 1, start, inc, samples)
        steps = [tuple(map(int, e.split(":"))) for e in step_schedule([start, inc, samples], gbs).split()]
        counts = {0, samples, samples + 1, *(t + d for t, _ in steps for d in (-1, 0, 1))}
        for c in sorted(x for x in counts if x >= 0):
            calc.update(c, False)
            assert calc.get_current_global_batch_size() == max(b for t, b in steps if t <= c), (start, inc, samples, c)
    assert samples_after([4, 4, 16], 12, 6) == 52 and iterations_for([4, 4, 16], 12, 40) == 5
    assert iterations_for([4, 4, 16], 12, 41) == 6 and samples_after(None, 12, 6) == 72
