"""Evaluation, TensorBoard and W&B from one small pipelined run (issue 11, items 2 and 3).

One gpt_pp2_dp2 run (PP=2 x DP=2 on CPU, 20 iterations, validation every 5 iterations over 2
global batches) is shared by every test here: validation goes through megatron's forward-only
schedule across the two stages; the TensorBoard event files and the W&B offline run are read back
and compared with metrics.jsonl value by value.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Dict, Iterator, List

import pytest
from conftest import read_metrics, run_cli

pytestmark = pytest.mark.slow

ITERS, EVAL_INTERVAL, EVAL_ITERS = 20, 5, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("evaltb")
    args = [
        "+experiment=gpt_pp2_dp2",
        "data.stdlib_max_mb=2",
        f"training.train_iters={ITERS}",
        "training.log_interval=1",
        f"training.eval_interval={EVAL_INTERVAL}",
        f"training.eval_iters={EVAL_ITERS}",
        "checkpoint.save_interval=null",
        "checkpoint.save_at_end=false",
        f"run.root={root}",
        "run.name=evaltb",
    ]
    args += ["logging.wandb.project=orchestrator-tests", "logging.wandb.mode=offline"]  # wandb: the test extra
    proc = run_cli(args, cache=cache_dir, env={"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"})
    return root / "evaltb", proc


def _evals(run_dir: Path) -> List[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "eval"]


def test_validation_loss_is_logged_at_each_interval_and_decreases(run):
    run_dir, proc = run
    evals = _evals(run_dir)
    assert [e["iteration"] for e in evals] == list(range(EVAL_INTERVAL, ITERS + 1, EVAL_INTERVAL))
    for e in evals:
        assert e["eval_iters"] == EVAL_ITERS and e["consumed_samples"] == e["iteration"] * 16
        assert math.isfinite(e["lm_loss"]) and e["ppl"] == pytest.approx(math.exp(e["lm_loss"]), rel=1e-12)
    losses = [e["lm_loss"] for e in evals]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.3
    # Held-out data: the validation loss is not the training loss of the same iteration.
    train = {r["iteration"]: r["lm_loss"] for r in read_metrics(run_dir)}
    assert all(e["lm_loss"] != train[e["iteration"]] for e in evals)
    # The launcher said what happened: phases from the job, each evaluation, where things are.
    out = proc.stdout
    assert "starting 4 ranks" in out and "building model" in out and "waiting for ranks to exit" in out
    assert f"validation at iteration {ITERS}: lm loss {losses[-1]:.4f}" in out
    assert f"metrics:     {run_dir / 'metrics.jsonl'}" in out
    assert f"tensorboard: tensorboard --logdir {run_dir / 'tensorboard'}" in out
    assert "checkpoint:  none saved" in out


def _scalars(run_dir: Path) -> Dict[str, Dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_events_match_metrics_jsonl(run):
    run_dir, _ = run
    tb = _scalars(run_dir)
    records = read_metrics(run_dir)
    assert [r["iteration"] for r in records] == list(range(1, ITERS + 1))
    pairs = {
        "lm loss": "lm_loss",
        "learning-rate": "lr",
        "grad-norm": "grad_norm",
        "iteration-time": "step_time_s",
        "tokens-per-sec": "tokens_per_s",
        "throughput": "throughput_tflops",
    }
    for tag, key in pairs.items():
        assert tb[tag] == {r["iteration"]: pytest.approx(r[key], rel=1e-6) for r in records}, tag  # float32 events
        assert tb[f"{tag} vs samples"] == {r["consumed_samples"]: pytest.approx(r[key], rel=1e-6) for r in records}
    assert tb["mem-max-rss-bytes"] == {
        r["iteration"]: pytest.approx(r["max_rss_mb"] * 2**20, rel=1e-6) for r in records
    }
    evals = _evals(run_dir)
    assert tb["lm loss validation"] == {e["iteration"]: pytest.approx(e["lm_loss"], rel=1e-6) for e in evals}
    assert tb["lm loss validation ppl"] == {e["iteration"]: pytest.approx(e["ppl"], rel=1e-6) for e in evals}
    assert tb["lm loss validation vs samples"] == {
        e["consumed_samples"]: pytest.approx(e["lm_loss"], rel=1e-6) for e in evals
    }


def _wandb_records(path: Path) -> Iterator[bytes]:
    """Records of a W&B ``.wandb`` file: a 7-byte header, then LevelDB-log blocks of 32 KiB whose
    records (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) hold protobufs."""
    raw, pos, block, pending = path.read_bytes(), 7, 32768, b""
    assert raw[:4] == b":W&B"
    while pos + 7 <= len(raw):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        if length == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        data, pos = raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            yield data
        elif kind == 2:
            pending = data
        elif kind == 3:
            pending += data
        elif kind == 4:
            yield pending + data


def test_wandb_offline_run_holds_the_same_history(run):
    # No skip: wandb is in the test extra (pyproject), so a missing wandb fails here, as it should.
    from wandb.proto import wandb_internal_pb2 as pb

    run_dir, _ = run
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history: Dict[int, dict] = {}
    for data in _wandb_records(files[0]):
        rec = pb.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            history.setdefault(row["_step"], {}).update(row)
    records = read_metrics(run_dir)
    assert sorted(history) == [r["iteration"] for r in records]
    for r in records:
        row = history[r["iteration"]]
        assert row["lm loss"] == r["lm_loss"] and row["learning-rate"] == r["lr"]
        assert row["grad-norm"] == r["grad_norm"] and row["samples"] == r["consumed_samples"]
    for e in _evals(run_dir):
        assert history[e["iteration"]]["lm loss validation"] == e["lm_loss"]
        assert history[e["iteration"]]["lm loss validation ppl"] == e["ppl"]
