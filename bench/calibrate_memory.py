"""Calibrate the planner's memory and step-time model on this machine's CPU, and check it.

Runs a few small CPU trainings through the real entry point (``python -m orchestrator``), turns each
run's ``metrics.jsonl`` summary into a calibration sample and fits a device profile with
:mod:`orchestrator.plan.calibrate` -- the same code ``python -m orchestrator tune`` uses on its trials,
so the rank-to-stage mapping, the planner terms and the fit are defined once. It prints, per rank,

* the planner's model states (weights + gradients + optimizer state) and activations of that rank's
  pipeline stage,
* the measured peak RSS, the calibrated prediction (overhead + factors x terms) and its error, both
  in-sample and leave-one-config-out (fitted without that config: what a new config would see),

then the fitted constants and the step times, predicted vs measured (Kendall's tau).

    python bench/calibrate_memory.py                 # all configs (several minutes on 2 cores)
    python bench/calibrate_memory.py --only pp2_mbs2 --only pp2_mbs8 --iters 4
    python bench/calibrate_memory.py --save          # also store the profile (~/.cache/orchestrator/profiles)
    python bench/calibrate_memory.py --plan-speed    # only time the planner (100-point grid, suggest)

This is a benchmark, not a test: it takes minutes and its numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orchestrator.config.compose import compose_config  # noqa: E402
from orchestrator.plan import calibrate, suggest  # noqa: E402  (pure Python: no torch here)
from orchestrator.plan import memory as planner
from orchestrator.plan.inputs import cpu_preset  # noqa: E402
from orchestrator.plan.profile import prior_profile, save_profile  # noqa: E402

MiB = 2**20
# Big enough that model states and activations stand out of a ~365 MiB baseline, small enough for 2 cores.
MODEL = ["model.num_layers=8", "model.hidden_size=512", "model.num_attention_heads=8"]

CONFIGS: Dict[str, List[str]] = {
    # name: overrides on top of +experiment=gpt_pp2_dp2
    "pp2_mbs2": [
        "parallelism=pp2_dp2",
        *MODEL,
        "model.seq_length=128",
        "model.max_position_embeddings=128",
        "training.micro_batch_size=2",
        "training.global_batch_size=8",
    ],
    "pp2_mbs8": [
        "parallelism=pp2_dp2",
        *MODEL,
        "model.seq_length=128",
        "model.max_position_embeddings=128",
        "training.micro_batch_size=8",
        "training.global_batch_size=32",
    ],
    "tp2_pp2_mbs4": [
        "parallelism=tp2_pp2",
        *MODEL,
        "model.seq_length=128",
        "model.max_position_embeddings=128",
        "training.micro_batch_size=4",
        "training.global_batch_size=16",
    ],
    "vpp2_mbs4": [
        "parallelism=pp2_vpp2_dp2",
        *MODEL,
        "model.seq_length=128",
        "model.max_position_embeddings=128",
        "training.micro_batch_size=4",
        "training.global_batch_size=16",
    ],
    "none_mbs4": [
        "parallelism=none",
        *MODEL,
        "model.seq_length=128",
        "model.max_position_embeddings=128",
        "training.micro_batch_size=4",
        "training.global_batch_size=8",
    ],
    "pp4_mbs2": [
        "parallelism=pp4",
        *MODEL,
        "model.seq_length=128",
        "model.max_position_embeddings=128",
        "training.micro_batch_size=2",
        "training.global_batch_size=8",
    ],
    # MoE: 4 SwiGLU experts, top-2, split over EP 2 (each rank: 2 experts of its stage's layers)
    "moe_ep2_mbs4": [
        "parallelism=pp2_dp2",
        *MODEL,
        "model.seq_length=128",
        "model.max_position_embeddings=128",
        "model.num_moe_experts=4",
        "model.activation=swiglu",
        "model.add_bias_linear=false",
        "parallelism.expert_model_parallel_size=2",
        "training.micro_batch_size=4",
        "training.global_batch_size=16",
    ],
    "pp2_seq512": [
        "parallelism=pp2_dp2",
        "model.num_layers=4",
        "model.hidden_size=256",
        "model.num_attention_heads=8",
        "model.seq_length=512",
        "model.max_position_embeddings=512",
        "training.micro_batch_size=4",
        "training.global_batch_size=16",
    ],
}
COMMON = [
    "+experiment=gpt_pp2_dp2",
    "data=mock",
    "checkpoint.save_interval=null",
    "checkpoint.save_at_end=false",
    "checkpoint.auto_resume=false",
    "cluster.timeout_min=30",
]


def compose(overrides: List[str], run_dir: Path):
    """The JobConfig the run will see (same conf/, same overrides)."""
    return compose_config([*overrides, f"run.dir={run_dir}"])


def launch(name: str, overrides: List[str], root: Path, iters: int) -> Optional[dict]:
    """Run one training; return its summary line (None when it failed)."""
    args = [
        sys.executable,
        "-m",
        "orchestrator",
        *overrides,
        f"run.root={root}",
        f"run.name={name}",
        f"training.train_iters={iters}",
        "training.timing_warmup_iters=1",
    ]
    start = time.time()
    proc = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=1800)
    metrics = root / name / "metrics.jsonl"
    summary = None
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "summary":
                summary = record
    status = "ok" if summary else f"FAILED (exit {proc.returncode})"
    print(f"  ran {name:<24} {time.time() - start:6.1f} s  {status}", flush=True)
    if summary is None:
        print("\n".join("    | " + l for l in (proc.stdout + proc.stderr).splitlines()[-15:]), flush=True)
    return summary


def plan_speed() -> None:
    """Time a 100-point grid of plans and one suggest() for the 6.7B model on 128 GPUs (pure Python)."""
    from orchestrator.config.layout import ParallelLayout

    shape = planner.ModelShape(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        seq_length=2048,
        max_position_embeddings=2048,
        vocab_size=50257,
    )
    grid = [
        ParallelLayout(
            world_size=128,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            micro_batch_size=mbs,
            global_batch_size=2048,
            sequence_parallel=tp > 1,
            num_layers=32,
            num_attention_heads=32,
            seq_length=2048,
            max_position_embeddings=2048,
        )
        for tp in (1, 2, 4, 8)
        for pp in (1, 2, 4, 8, 16)
        for mbs in (1, 2, 4, 8, 16)
    ]
    gpu = planner.gpu_preset("H100")
    start = time.perf_counter()
    plans = [planner.plan_layout(lay, shape, planner.Recipe(), gpu) for lay in grid]
    grid_s = time.perf_counter() - start
    print(f"planned {len(plans)} layouts in {grid_s * 1000:.0f} ms ({grid_s / len(plans) * 1e6:.0f} us each)")
    # The seed's job: gpt_6.7b, TP1 PP2 on 4 x 8 A100-40GB, MBS 4, GBS 256, bf16.
    cfg = compose(
        [
            "model=gpt_6.7b",
            "cluster.kind=slurm",
            "cluster.nodes=4",
            "cluster.gpus_per_node=8",
            "parallelism.pipeline_model_parallel_size=2",
            "training.micro_batch_size=4",
            "training.global_batch_size=256",
            "training.precision=bf16",
            "gpu=A100-40GB",
        ],
        REPO / "runs" / "x",
    )
    start = time.perf_counter()
    found = suggest.suggest(cfg)
    print(
        f"suggest() for the seed's job, every candidate layout planned: "
        f"{(time.perf_counter() - start) * 1000:.0f} ms, {len(found)} suggestions"
    )


def cpu_plan(cfg, profile=None):
    """The plan of ``cfg`` on this machine's CPU (uncalibrated terms when ``profile`` is None)."""
    return planner.plan(cfg, gpu="cpu", profile=profile)


def print_memory(samples: Dict[str, dict], prior) -> None:
    fitted = calibrate.fit_profile(prior, list(samples.values()))
    print(
        "\npeak memory per rank, MiB (pred = calibrated overhead + factors x (states, activations); "
        "LOO = fitted without this config)"
    )
    print(
        f"{'config':<16}{'rank':>5}{'stage':>6}{'states':>9}{'activ':>9}{'RSS':>9}{'pred':>9}{'error':>8}"
        f"{'LOO pred':>10}{'LOO err':>9}"
    )
    loo_errors = []
    for name, sample in samples.items():
        loo = calibrate.fit_profile(prior, [s for n, s in samples.items() if n != name])
        for rank, (r, err, lerr) in enumerate(
            zip(sample["ranks"], calibrate.memory_errors(fitted, sample), calibrate.memory_errors(loo, sample))
        ):
            loo_errors.append(abs(lerr))
            print(
                f"{name:<16}{rank:>5}{r['stage']:>6}{r['states'] / MiB:>9.1f}{r['activations'] / MiB:>9.1f}"
                f"{r['measured'] / MiB:>9.1f}{r['measured'] * (1 + err) / MiB:>9.1f}{err:>+8.1%}"
                f"{r['measured'] * (1 + lerr) / MiB:>10.1f}{lerr:>+9.1%}"
            )
    stats = fitted.fit
    print(
        f"in-sample |error| max {stats['memory_error_max_pct']:.1f}%, mean {stats['memory_error_mean_pct']:.1f}% "
        f"over {stats['memory_samples']} ranks; leave-one-config-out max {100 * max(loo_errors):.1f}%"
    )
    print(f"fitted: {fitted.summary()}")


def print_step_times(samples: Dict[str, dict], prior) -> None:
    fitted = calibrate.fit_profile(prior, list(samples.values()))
    timed = {n: s for n, s in samples.items() if s.get("time")}
    if len(timed) < 2:
        return
    print(f"\n{'config':<16}{'measured s':>11}{'predicted s':>12}{'error':>8}")
    pred = {n: calibrate.predicted_step_s(fitted, s["time"]["features"]) for n, s in timed.items()}
    for n, s in timed.items():
        m = s["time"]["measured_s"]
        print(f"{n:<16}{m:>11.3f}{pred[n]:>12.3f}{(pred[n] - m) / m:>+8.0%}")
    tau = calibrate.kendall_tau(list(pred.values()), [s["time"]["measured_s"] for s in timed.values()])
    print(f"Kendall tau (predicted vs measured step time): {tau:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=None, help="directory for the runs (default: a temporary one)")
    ap.add_argument("--iters", type=int, default=3, help="training iterations per run (first is not timed)")
    ap.add_argument("--only", action="append", help="run only these configs (repeatable)")
    ap.add_argument("--save", action="store_true", help="store the fitted profile for this machine's CPU")
    ap.add_argument("--plan-speed", action="store_true", help="only time the planner and exit")
    args = ap.parse_args()
    if args.plan_speed:
        plan_speed()
        return 0
    root = Path(args.root or tempfile.mkdtemp(prefix="calibrate_"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"calibration runs under {root}")
    samples: Dict[str, dict] = {}
    prior = prior_profile(cpu_preset(4))
    for name in args.only or list(CONFIGS):
        overrides = [*COMMON, *CONFIGS[name]]
        summary = launch(name, overrides, root, args.iters)
        if summary is not None:
            samples[name] = calibrate.sample_of(cpu_plan(compose(overrides, root / name)), summary, name, prior.cores)
    if not samples:
        return 1
    print_memory(samples, prior)
    print_step_times(samples, prior)
    if args.save:
        print(f"saved: {save_profile(calibrate.fit_profile(prior, list(samples.values())))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
