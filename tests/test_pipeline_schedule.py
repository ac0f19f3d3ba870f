"""The pipeline schedule: predicted (torch-free) against the order megatron-core really runs.

The slow test traces one iteration (``sweep.trace_iteration=1``) of real gpt_tiny CPU runs on warm
ranks — pp4, pp2 x dp2 and pp2_vpp2 x dp2 with num_microbatches < PP, = PP and > PP (megatron-core
0.16.1's interleaved schedule needs num_microbatches a multiple of PP, so >= PP) — and asserts that
every rank ran megatron's forward and backward steps in exactly the predicted order. The orders it
recorded are kept in tests/golden/megatron_schedule_orders.json, which a fast test compares too.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from orchestrator.plan.pipeline_schedule import (
    measured_costs,
    measured_schedule,
    predict,
    predict_like,
    predict_measured,
    schedule_table,
    stage_order,
    warmup_count,
)
from orchestrator.plan.shared_cores import shared_core_stretch


def test_schedule_table_is_megatrons_own_example():
    """megatron/core/pipeline_parallel/schedules.py's comment: PP2 N3M5 with VP2 (group of 3, 5 micro-batches)."""
    table = schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]


def test_orders_by_schedule():
    assert stage_order(1, 0, 3) == [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0), ("F", 2, 0), ("B", 2, 0)]
    # 1F1B, PP4 m=8: rank 1 warms up with 2 forwards, steady F/B pairs, cools down with 2 backwards
    order = stage_order(4, 1, 8)
    assert order[:4] == [("F", 0, 0), ("F", 1, 0), ("F", 2, 0), ("B", 0, 0)] and order[-2:] == [
        ("B", 6, 0),
        ("B", 7, 0),
    ]
    assert [warmup_count(4, r, 2) for r in range(4)] == [2, 2, 1, 0]  # capped at m
    # interleaved PP2 v=2 m=4 on rank 0: warm-up (2-0-1)*2 + (2-1)*2 = 4 forwards: mb 0,1 chunk 0, then chunk 1
    assert stage_order(2, 0, 4, 2)[:6] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1), ("F", 2, 0), ("B", 0, 1)]


@pytest.mark.parametrize(
    "pp,m,v",
    [
        (2, 1, 1),
        (2, 4, 1),
        (4, 2, 1),
        (4, 4, 1),
        (4, 8, 1),
        (4, 16, 1),
        (2, 2, 2),
        (2, 4, 2),
        (4, 8, 2),
        (4, 16, 2),
        (4, 8, 4),
    ],
)
def test_predicted_bubble_is_the_formula_without_communication(pp, m, v):
    """Equal stages, backward = 2 x forward, free transfers: every stage idles (p-1)/(v m) of its busy time."""
    s = predict(pp, m, v)
    overhead, fraction = s.formula()
    assert s.bubble_overhead() == pytest.approx([overhead] * pp)
    assert s.idle_share() == pytest.approx([fraction] * pp)
    assert len(s.steps) == 2 * pp * m * v


@pytest.mark.parametrize("pp,m,v,replicas", [(2, 4, 1, 1), (4, 4, 1, 1), (4, 8, 2, 1), (2, 2, 2, 2), (4, 16, 1, 2)])
def test_ranks_sharing_cores_stretch_by_ranks_per_core_plus_what_the_schedule_cannot_hide(pp, m, v, replicas):
    """A core per rank: the bubble formula exactly. Fewer cores: at least ranks per core, at most that times
    1 + (p-1)/(v m) (the fill and drain, when fewer ranks than cores can run, is all the sharing cannot hide)."""
    ranks = pp * replicas
    assert shared_core_stretch(pp, m, v, replicas, cores=ranks) == pytest.approx(1 + (pp - 1) / (v * m))
    shared = shared_core_stretch(pp, m, v, replicas, cores=2)
    assert ranks / 2 <= shared + 1e-9 and shared <= ranks / 2 * (1 + (pp - 1) / (v * m)) + 1e-9


def test_shared_core_stretch_by_hand():
    # no pipeline: 4 ranks on 2 cores, never waiting: 2x
    assert shared_core_stretch(1, 8, 1, 4, cores=2) == pytest.approx(2.0)
    # PP4 with one micro-batch is a chain (F on stages 0..3, then B on 3..0: 4 x 1 + 4 x 2 = 12 units) whatever the
    # cores: 12 / one rank's 3 units = 4 -- ranks per core (2) times 2, the bubble nothing else can fill
    assert shared_core_stretch(4, 1, 1, 1, cores=2) == pytest.approx(4.0)
    # PP4, m=4 on 2 cores: the fill (one, then two runnable ranks) and drain leave a core idle: above 2
    assert shared_core_stretch(4, 4, 1, 1, cores=2) > 2.05


def test_a_trace_reads_back_as_its_schedule():
    """schedule.json's per-rank events -> the measured Schedule of replica 0: a 'recorded' copy of a
    prediction (plus a dp 1 replica and send/recv calls, which must not count as work) gives its bubble."""
    s = predict(4, 8, 2, comm=0.25)
    ranks = []
    for dp in (0, 1):
        for r in range(4):
            events = [
                {"kind": st.kind, "microbatch": st.microbatch, "chunk": st.chunk, "start": st.start, "end": st.end}
                for st in s.on(r)
            ]
            events += [
                {"kind": "recv_forward", "microbatch": -1, "chunk": -1, "start": 0.0, "end": 0.5},
                {"kind": "iteration", "microbatch": -1, "chunk": -1, "start": 0.0, "end": s.window[1]},
            ]
            ranks.append({"rank": dp * 4 + r, "pp_rank": r, "dp_rank": dp, "tp_rank": 0, "events": events})
    measured = measured_schedule(ranks, 4, 2, 8)
    assert len(measured.steps) == len(s.steps) and len(measured.extra["waits"]) == 4
    assert measured.bubble_overhead() == pytest.approx(s.bubble_overhead())
    assert [measured.order(r) for r in range(4)] == [stage_order(4, r, 8, 2) for r in range(4)]
    again = predict_like(measured)  # equal stages, backward = 2 x forward: the formula
    assert again.bubble_overhead() == pytest.approx([3 / 16] * 4)


@pytest.mark.parametrize("pp,m,v", [(2, 8, 1), (4, 8, 1), (4, 8, 2)])
def test_the_measured_operations_predict_the_bubble_they_came_from(pp, m, v):
    """A recorded copy of a schedule with unequal stages (the last one heavier), a transfer and a gap after
    every step: measured_costs reads back each stage's forward and backward, the transfer and the gaps,
    and predict_measured gives back its bubble and its step, which the bare formula does not."""
    forward = [0.010 + 0.002 * r for r in range(pp - 1)] + [0.020]
    backward = [0.021 + 0.003 * r for r in range(pp)]
    gap = [0.0004 + 0.0001 * r for r in range(pp)]
    truth = predict(pp, m, v, forward=forward, backward=backward, comm=0.002, gap=gap)
    ranks = [
        {
            "rank": r,
            "pp_rank": r,
            "dp_rank": 0,
            "tp_rank": 0,
            "events": [
                {"kind": st.kind, "microbatch": st.microbatch, "chunk": st.chunk, "start": st.start, "end": st.end}
                for st in truth.on(r)
            ],
        }
        for r in range(pp)
    ]
    measured = measured_schedule(ranks, pp, v, m)
    costs = measured_costs(measured)
    assert costs["forward"] == pytest.approx(forward) and costs["backward"] == pytest.approx(backward)
    assert costs["comm"] == pytest.approx(0.002) and costs["gap"] == pytest.approx(gap)
    again = predict_measured(measured)
    assert again.bubble_overhead() == pytest.approx(truth.bubble_overhead())
    assert again.window == pytest.approx(truth.window)
    assert max(abs(b - truth.formula()[0]) for b in truth.bubble_overhead()) > 0.05  # the formula misses it


def test_plan_picture_is_written_without_torch(tmp_path):
    """plan=true plan_picture=FILE.png: the PNG, no torch/megatron import, nothing else written."""
    png = tmp_path / "pp4.png"
    code = (
        "import sys, time; from orchestrator.__main__ import main\n"
        "t = time.perf_counter()\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
        "print('imported', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron'}))"
    )
    args = [
        "parallelism=pp4",
        "model=gpt_6.7b",
        "cluster=slurm_a100_4x8",
        "parallelism.data_parallel_size=null",
        "training.precision=bf16",
        "training.micro_batch_size=1",
        "training.global_batch_size=64",
        "parallelism.virtual_pipeline_model_parallel_size=2",
        "plan=true",
        f"run.root={tmp_path / 'runs'}",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", code, *args, f"plan_picture={png}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "imported []" in proc.stdout and f"wrote {png}" in proc.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and sorted(p.name for p in tmp_path.iterdir()) == ["pp4.png"]


def test_predicted_orders_equal_megatrons_recorded_ones():
    """The orders megatron-core 0.16.1 ran in traced CPU jobs (pp2, pp4, pp2_vpp2, m < PP, = PP, > PP;
    recorded from the slow test below's traces, which then also covered pp2 x dp2), step for step,
    without running anything."""
    golden = json.loads((REPO / "tests" / "golden" / "megatron_schedule_orders.json").read_text())["orders"]
    assert len(golden) == 7
    for key, ranks in golden.items():
        pp, vpp, m = (int(part[len(name) :]) for part, name in zip(key.split("_"), ("pp", "vpp", "m")))
        for rank, recorded in ranks.items():
            predicted = " ".join(f"{kind}{mb}.{chunk}" for kind, mb, chunk in stage_order(pp, int(rank), m, vpp))
            assert predicted == recorded, (key, rank)


LAYOUTS = {
    ("pp4", 2): (4, 1, 2),
    ("pp4", 4): (4, 1, 4),
    ("pp4", 8): (4, 1, 8),
    ("pp2_vpp2_dp2", 4): (2, 2, 2),
    ("pp2_vpp2_dp2", 8): (2, 2, 4),
}
"""(parallelism, global batch size) -> (PP, VPP, num_microbatches) at micro-batch size 1."""


@pytest.mark.slow
def test_megatron_runs_the_predicted_order_on_every_rank(tmp_path, cache_dir):
    """One sweep on 4 warm ranks: pp4 (1F1B) and pp2_vpp2 x dp2 (interleaved) with m < PP, = PP, > PP
    (interleaving with m = 1 < PP is refused by validate, as megatron-core would); every rank of every
    replica, step for step. (pp2 x dp2, the same 1F1B on fewer stages, is in the recorded orders above.)"""
    proc = run_cli(
        [
            "-m",
            "parallelism=pp4,pp2_vpp2_dp2",
            "training.global_batch_size=2,4,8",
            "training.micro_batch_size=1",
            "training.train_iters=1",
            "sweep.trace_iteration=1",
            "training.eval_iters=0",
            "data.stdlib_max_mb=2",
            "checkpoint.save_at_end=false",
            "logging.tensorboard=false",
            "training.timing_warmup_iters=0",
            f"run.root={tmp_path}",
            "run.name=orders",
        ],
        cache=cache_dir,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]  # the one invalid point
    sweep_dir = next((tmp_path / "sweeps" / "orders").iterdir())
    with (sweep_dir / "summary.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    seen = set()
    for row in rows:
        ov = dict(o.split("=", 1) for o in row["overrides"].split())
        key = (ov["parallelism"], int(ov["training.global_batch_size"]))
        if key not in LAYOUTS:
            assert key == ("pp2_vpp2_dp2", 2) and row["status"] == "invalid" and "num_microbatches" in row["reason"]
            continue
        assert row["status"] == "completed", row
        run_dir = Path(row["run_dir"])
        doc = json.loads((run_dir / "schedule.json").read_text())
        pp, v, m = LAYOUTS[key]
        assert (doc["bubble"]["pp"], doc["bubble"]["vpp"], doc["bubble"]["num_microbatches"]) == (pp, v, m)
        assert len(doc["ranks"]) == 4
        for rank in doc["ranks"]:
            real = [(e["kind"], e["microbatch"], e["chunk"]) for e in rank["events"] if e["kind"] in ("F", "B")]
            assert real == stage_order(pp, rank["pp_rank"], m, v), (key, rank["rank"])
            assert any(e["kind"].startswith(("send", "recv")) for e in rank["events"])
            assert all(e["end"] >= e["start"] >= 0 for e in rank["events"])
        seen.add(key)
        b = doc["bubble"]
        assert float(row["measured_bubble_fraction"]) == pytest.approx(sum(b["measured_idle_share"]) / pp)
        chrome = json.loads((run_dir / "schedule_trace.json").read_text())
        assert sum(e["ph"] == "X" and e["cat"] == "compute" for e in chrome["traceEvents"]) == 4 * 2 * m * v
        assert (run_dir / "schedule.png").read_bytes()[:4] == b"\x89PNG"
    assert seen == set(LAYOUTS)


@pytest.mark.parametrize("key", ["training.trace_iteration", "sweep.trace_iteration"])
def test_a_trace_iteration_below_one_is_refused_in_one_line(key):
    from orchestrator.config.checks import validate
    from orchestrator.config.compose import compose_dict
    from orchestrator.config.schema import to_job_config
    from orchestrator.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(to_job_config(compose_dict(["parallelism=pp4", f"{key}=0"])))
    assert str(err.value) == f"{key}=0: must be a positive integer or null; fix: {key}=null (the schema's default)"
