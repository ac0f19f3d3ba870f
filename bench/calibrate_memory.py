"""Calibrate the planner on this machine: predicted vs measured peak memory per rank, step-time ratios.

Runs a few small CPU trainings through the real entry point (``python -m orchestrator``), reads each
run's ``metrics.jsonl`` summary (``peak_rss_mb_per_rank``, ``step_time_median_s``) and prints, per rank,

* predicted = the planner's weights + gradients + optimizer state + activations for that rank's
  pipeline stage (no GPU framework overhead; fp32 on CPU),
* measured = peak RSS minus a *baseline*: the RSS of the same layout training a tiny model
  (torch + megatron import, gloo groups, data pipeline), less the tiny model's own prediction,
* ratio = predicted / (measured - baseline), and the error.

It also compares step-time ratios between configs (relative to the first) with the planner's, using
a CPU pseudo-preset; absolute CPU times mean little, ratios tell whether the model ranks layouts right.

    python bench/calibrate_memory.py                 # all configs (several minutes on 2 cores)
    python bench/calibrate_memory.py --only pp2_mbs2 --iters 4
    python bench/calibrate_memory.py --shared-baseline   # one 1-rank baseline instead of one per layout
    python bench/calibrate_memory.py --plan-speed        # only time the planner (100-point grid, suggest)

Global rank r sits on pipeline stage r // (world / PP) (Megatron's default order tp-cp-ep-dp-pp).
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

from orchestrator.plan import memory as planner, suggest  # noqa: E402  (pure Python: no torch in this process)
from orchestrator.spec.schema import register_configs, to_job_config  # noqa: E402

MiB = 2 ** 20
# Big enough that model states and activations stand out of a ~430 MiB baseline, small enough for 2 cores.
MODEL = ["model.num_layers=8", "model.hidden_size=512", "model.num_attention_heads=8"]
TINY = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=2", "model.seq_length=32",
        "model.max_position_embeddings=32", "training.micro_batch_size=1"]

CONFIGS: Dict[str, List[str]] = {
    # name: overrides on top of +experiment=gpt_pp2_dp2
    "pp2_mbs2": ["parallelism=pp2_dp2", *MODEL, "model.seq_length=128", "model.max_position_embeddings=128",
                 "training.micro_batch_size=2", "training.global_batch_size=8"],
    "pp2_mbs8": ["parallelism=pp2_dp2", *MODEL, "model.seq_length=128", "model.max_position_embeddings=128",
                 "training.micro_batch_size=8", "training.global_batch_size=32"],
    "tp2_pp2_mbs4": ["parallelism=tp2_pp2", *MODEL, "model.seq_length=128", "model.max_position_embeddings=128",
                     "training.micro_batch_size=4", "training.global_batch_size=16"],
    "vpp2_mbs4": ["parallelism=pp2_vpp2_dp2", *MODEL, "model.seq_length=128", "model.max_position_embeddings=128",
                  "training.micro_batch_size=4", "training.global_batch_size=16"],
    "pp2_seq512": ["parallelism=pp2_dp2", "model.num_layers=4", "model.hidden_size=256",
                   "model.num_attention_heads=8", "model.seq_length=512", "model.max_position_embeddings=512",
                   "training.micro_batch_size=4", "training.global_batch_size=16"],
}
COMMON = ["+experiment=gpt_pp2_dp2", "data=mock", "checkpoint.save_interval=null", "checkpoint.save_at_end=false",
          "checkpoint.auto_resume=false", "cluster.timeout_min=30"]
# CPU pseudo-preset for step-time ratios: only the compute/communication balance matters.
CPU = planner.GpuPreset("cpu", memory_bytes=64 * 2 ** 30, peak_flops_16bit=2e10, peak_flops_fp32=2e10,
                        intra_node_bw=2e9, inter_node_bw=2e9)


def compose(overrides: List[str], run_dir: Path):
    """The JobConfig the run will see (same conf/, same overrides)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        cfg = hydra_compose("config", overrides=[*overrides, f"run.dir={run_dir}"])
    return to_job_config(cfg)


def launch(name: str, overrides: List[str], root: Path, iters: int) -> Optional[dict]:
    """Run one training; return its summary line (None when it failed)."""
    args = [sys.executable, "-m", "orchestrator", *overrides, f"run.root={root}", f"run.name={name}",
            f"training.train_iters={iters}", "training.timing_warmup_iters=1"]
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


def predicted_by_rank(cfg) -> List[dict]:
    """Planner bytes per global rank: model states and activations of that rank's stage."""
    plan = planner.plan(cfg)
    lay = plan.layout
    per_stage = lay.world_size // lay.pipeline_model_parallel_size
    out = []
    for rank in range(lay.world_size):
        st = plan.stages[rank // per_stage]
        out.append({"stage": st.stage, "states": st.weights + st.gradients + st.optimizer,
                    "activations": st.activations})
    return out


def cpu_step_time(cfg) -> float:
    """The planner's step time for ``cfg`` on the CPU pseudo-preset (seconds; only ratios matter)."""
    shape = planner.ModelShape.from_model_config(cfg.model, planner.vocab_size_of(cfg)[0])
    return planner.plan_layout(planner.layout_from_config(cfg), shape, planner.recipe_of(cfg), CPU).step_time_s


def fit(rows) -> None:
    """Least squares: net ~ a x states + b x activations + c (MiB). a, b near 1 and c near 0 = calibrated."""
    import numpy as np

    if len(rows) < 4:
        return
    X = np.array([[r[3], r[4], 1.0] for r in rows])
    y = np.array([r[6] for r in rows])
    (a, b, c), *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ np.array([a, b, c])
    print(f"fit: measured net = {a:.2f} x states + {b:.2f} x activations + {c:.0f} MiB "
          f"(rms residual {float(np.sqrt(np.mean(resid ** 2))):.0f} MiB)")


def plan_speed() -> None:
    """Time a 100-point grid of plans and one suggest() for the 6.7B model on 128 GPUs (pure Python)."""
    from orchestrator.spec.layout import ParallelLayout

    shape = planner.ModelShape(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048,
                               max_position_embeddings=2048, vocab_size=50257)
    grid = [ParallelLayout(world_size=128, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                           micro_batch_size=mbs, global_batch_size=2048, sequence_parallel=tp > 1, num_layers=32,
                           num_attention_heads=32, seq_length=2048, max_position_embeddings=2048)
            for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8, 16) for mbs in (1, 2, 4, 8, 16)]
    gpu = planner.gpu_preset("H100")
    start = time.perf_counter()
    plans = [planner.plan_layout(lay, shape, planner.Recipe(), gpu) for lay in grid]
    grid_s = time.perf_counter() - start
    print(f"planned {len(plans)} layouts in {grid_s * 1000:.0f} ms ({grid_s / len(plans) * 1e6:.0f} us each)")
    # The seed's job: gpt_6.7b, TP1 PP2 on 4 x 8 A100-40GB, MBS 4, GBS 256, bf16.
    cfg = compose(["model=gpt_6.7b", "cluster.kind=slurm", "cluster.nodes=4", "cluster.gpus_per_node=8",
                   "parallelism.pipeline_model_parallel_size=2", "training.micro_batch_size=4",
                   "training.global_batch_size=256", "training.precision=bf16", "gpu=A100-40GB"], REPO / "runs" / "x")
    start = time.perf_counter()
    found = suggest.suggest(cfg)
    print(f"suggest() for the seed's job, every candidate layout planned: "
          f"{(time.perf_counter() - start) * 1000:.0f} ms, {len(found)} suggestions")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=None, help="directory for the runs (default: a temporary one)")
    ap.add_argument("--iters", type=int, default=3, help="training iterations per run (first is not timed)")
    ap.add_argument("--only", action="append", help="run only these configs (repeatable)")
    ap.add_argument("--shared-baseline", action="store_true", help="one 1-rank tiny baseline for every layout")
    ap.add_argument("--plan-speed", action="store_true", help="only time the planner and exit")
    args = ap.parse_args()
    if args.plan_speed:
        plan_speed()
        return 0
    root = Path(args.root or tempfile.mkdtemp(prefix="calibrate_"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    names = args.only or list(CONFIGS)
    print(f"calibration runs under {root}")

    baselines: Dict[str, List[float]] = {}

    def baseline_for(parallelism: str, world: int) -> Optional[List[float]]:
        """Per-rank MiB of the tiny run with this layout, minus the tiny model's predicted bytes."""
        key = "shared" if args.shared_baseline else parallelism
        if key not in baselines:
            par = "parallelism=none" if args.shared_baseline else parallelism
            over = [*COMMON, par, *TINY, "training.global_batch_size=4"]
            name = f"baseline_{key.split('=')[-1]}"
            summary = launch(name, over, root, 2)
            if summary is None:
                return None
            pred = predicted_by_rank(compose(over, root / name))
            baselines[key] = [mb - (p["states"] + p["activations"]) / MiB
                              for mb, p in zip(summary["peak_rss_mb_per_rank"], pred)]
        base = baselines[key]
        return base * world if len(base) == 1 else base

    rows, times = [], {}
    for name in names:
        overrides = [*COMMON, *CONFIGS[name]]
        cfg = compose(overrides, root / name)
        summary = launch(name, overrides, root, args.iters)
        parallelism = next(o for o in CONFIGS[name] if o.startswith("parallelism="))
        base = baseline_for(parallelism, planner.plan(cfg).layout.world_size)
        if summary is None or base is None:
            continue
        pred = predicted_by_rank(cfg)
        for rank, (mb, p, b) in enumerate(zip(summary["peak_rss_mb_per_rank"], pred, base)):
            rows.append((name, rank, p["stage"], p["states"] / MiB, p["activations"] / MiB, mb, mb - b))
        if summary.get("step_time_median_s"):
            times[name] = (summary["step_time_median_s"], cpu_step_time(cfg))

    print("\npeak memory per rank, MiB (predicted = model states + activations; measured net = RSS - baseline)")
    print(f"{'config':<16}{'rank':>5}{'stage':>6}{'states':>9}{'activ':>9}{'pred':>9}{'RSS':>9}{'net':>9}"
          f"{'pred/net':>10}{'error':>9}")
    errors = []
    for name, rank, stage, states, act, rss, net in rows:
        pred = states + act
        ratio = pred / net if net > 0 else float("nan")
        err = (pred - net) / net if net > 0 else float("nan")
        errors.append(abs(err))
        print(f"{name:<16}{rank:>5}{stage:>6}{states:>9.1f}{act:>9.1f}{pred:>9.1f}{rss:>9.1f}{net:>9.1f}"
              f"{ratio:>10.2f}{err:>+9.0%}")
    if errors:
        print(f"mean |error| {sum(errors) / len(errors):.0%} over {len(errors)} ranks; "
              f"baselines (MiB/rank): " + ", ".join(f"{k}: {sum(v) / len(v):.0f}" for k, v in baselines.items()))
        fit(rows)
    if len(times) > 1:
        ref = next(iter(times))
        m0, p0 = times[ref]
        print(f"\nstep-time ratios vs {ref} (measured median over timed iterations; predicted with a CPU pseudo-preset)")
        print(f"{'config':<16}{'measured s':>11}{'meas ratio':>11}{'pred ratio':>11}{'error':>9}")
        for name, (m, p) in times.items():
            print(f"{name:<16}{m:>11.3f}{m / m0:>11.2f}{p / p0:>11.2f}{(p / p0 - m / m0) / (m / m0):>+9.0%}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
