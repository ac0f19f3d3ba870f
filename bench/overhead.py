"""Orchestrator overhead: steady-state step time vs a plain megatron-core loop, same model and layout.

Runs, in this one invocation:
1. a bare megatron-core loop (hand-written here: TransformerConfig → GPTModel per stage → DDP →
   get_megatron_optimizer → get_forward_backward_func, fixed in-memory token batches, no data
   pipeline, no checkpoints) on ``--world`` gloo processes, with the collectives and host reads Megatron-LM's
   ``train_step`` and ``training_log`` add at their defaults (the last stage's loss all-reduce over DP x CP every
   iteration, summed on the device; a barrier and the loss's host read every ``--log-interval``);
2. ``python -m orchestrator`` with the same model, layout and batch settings
   (checkpoint saves and evaluation off, records every ``--log-interval`` iterations) and reads
   ``step_time_median_s`` from its metrics.jsonl;
3. a 1-iteration job both ways, wall clock from process start to exit: the bare loop as a fresh
   ``python bench/overhead.py --bare-job`` (spawn, imports, init, build, one step) and
   ``python -m orchestrator ... training.train_iters=1`` (compose, validate, the warm data cache,
   submission, the ranks, the launcher's wait).

Prints both ratios orchestrator / bare (targets: steps <= 1.01, 1-iteration job <= 1.10) of the
medians and of the minima over ``--repeats`` and, for steps, the median of each repeat's own ratio (alternating which goes first) with its 95% bootstrap
interval, the steps also in CPU
time of the timing rank's process (what the loop costs whatever else runs on the machine), and the
load average before and after: wall-clock timings on a shared 2-core machine are noisy.

    python bench/overhead.py                      # gpt_tiny, pp2_dp2, 40 iterations x 2 repeats
    python bench/overhead.py --parallelism none --iters 60
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Sequence, Tuple

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {"none": (1, 1, 1), "pp2": (1, 2, 1), "pp2_dp2": (1, 2, 2), "tp2_pp2": (2, 2, 1), "pp4": (1, 4, 1)}
PRESET = {"pp2": ["parallelism=pp2_dp2", "parallelism.name=pp2", "parallelism.data_parallel_size=1"]}
"""Layouts without a preset of their own (conf/parallelism): the orchestrator's overrides. ``pp2`` is one rank per
core on a 2-core machine, where ``pp2_dp2``'s four ranks time the scheduler's sharing of two cores as much as the
step."""
EXTRA: List[str] = []
"""``--set KEY=VALUE`` overrides for the orchestrator's jobs (what a feature costs: e.g. ``--set
training.breakdown_interval=0``); none by default: the orchestrator as shipped."""


def _bare_worker(
    rank: int,
    world: int,
    tp: int,
    pp: int,
    iters: int,
    warmup: int,
    mbs: int,
    gbs: int,
    log_interval: int,
    port: int,
    out: str,
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // world)),
    )
    from orchestrator.runtime.rank.startup import jit_fuser_off

    # megatron-core's @jit_fuser kernels (the fused bias-GELU here) as a CPU rank of the orchestrator runs
    # them: eager, not torch.compile'd (runtime/rank/startup.py; OVERHEAD_COMPILED_FUSER=1 keeps torch.compile)
    if not os.environ.get("OVERHEAD_COMPILED_FUSER"):
        jit_fuser_off()
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from orchestrator.runtime.rank import cpu

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    cpu.activate()
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    seq, vocab = 128, 384 if tp == 1 else 512
    config = TransformerConfig(
        num_layers=4,
        hidden_size=128,
        num_attention_heads=4,
        ffn_hidden_size=512,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        bias_activation_fusion=True,  # Megatron-LM's default (--bias-gelu-fusion; the orchestrator's gelu too)
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        deallocate_pipeline_outputs=False,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=vocab,
        max_sequence_length=seq,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=True,  # Megatron-LM's default (no --untie-embeddings-...)
    )
    ddp = DistributedDataParallel(
        config=config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True), module=model
    )
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [ddp])
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, 256, (mbs, seq), generator=gen)
    batch = {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, 1),
        "position_ids": torch.arange(seq).expand(mbs, seq),
        "loss_mask": torch.ones(mbs, seq),
    }

    def loss_func(o):
        # Megatron-LM's pretrain_gpt.loss_func: the loss, and [its sum, the tokens] for the report
        mask = batch["loss_mask"]
        total, tokens = (o.float() * mask).sum(), mask.sum()
        return total / tokens, {"lm loss": torch.cat([total.detach().view(1), tokens.view(1)])}

    def step(it, m):
        return m(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]), loss_func

    fb = get_forward_backward_func()
    dp = ps.get_data_parallel_world_size()
    m = gbs // (mbs * dp)
    times, cpu, total_loss = [], [], torch.zeros(1)
    for i in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses = fb(
            forward_step_func=step,
            data_iterator=iter([None] * m),
            model=[ddp],
            num_microbatches=m,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )
        opt.step()
        # Megatron-LM's train_step: the last stage all-reduces [loss sum, tokens] over DP x CP every
        # iteration; training_log adds it to total_loss_dict on the device and, every log_interval, times
        # the interval with a barrier (timers('interval-time').elapsed(barrier=True)) and reads it (.item())
        if ps.is_pipeline_last_stage():
            val = torch.vstack([x["lm loss"] for x in losses]).sum(dim=0)
            torch.distributed.all_reduce(val, group=ps.get_data_parallel_group(with_context_parallel=True))
            total_loss = total_loss + val[0] / val[1]
        if (i + 1) % log_interval == 0:
            torch.distributed.barrier()
            if ps.is_pipeline_last_stage():
                total_loss.item()
                total_loss = torch.zeros(1)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    if rank == world - 1:  # last stage: where the orchestrator's logging rank times its steps too
        Path(out).write_text(json.dumps({"median_s": statistics.median(times), "cpu_median_s": statistics.median(cpu)}))
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


def bare(tp, pp, dp, iters, warmup, mbs, gbs, log_interval) -> Tuple[float, float]:
    """(median wall, median CPU) seconds per step of the bare loop, on its last rank."""
    import torch.multiprocessing as mp

    world = tp * pp * dp
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "bare.json")
        mp.spawn(
            _bare_worker,
            args=(world, tp, pp, iters, warmup, mbs, gbs, log_interval, 29000 + os.getpid() % 1000, out),
            nprocs=world,
        )
        result = json.loads(Path(out).read_text())
        return result["median_s"], result["cpu_median_s"]


def _orchestrator_args(parallelism, iters, warmup, mbs, gbs, log_interval, root: Path, tag: str) -> List[str]:
    return [
        sys.executable,
        "-m",
        "orchestrator",
        *PRESET.get(parallelism, [f"parallelism={parallelism}"]),
        f"run.root={root}",
        f"run.name=bench_{tag}",
        f"training.train_iters={iters}",
        f"training.timing_warmup_iters={warmup}",
        f"training.micro_batch_size={mbs}",
        f"training.global_batch_size={gbs}",
        f"training.log_interval={log_interval}",
        "training.eval_iters=0",
        "data.stdlib_max_mb=2",
        "checkpoint.save_at_end=false",
        "checkpoint.save_interval=null",
        "optimizer.lr_warmup_iters=0",
        *EXTRA,
    ]


def orchestrated(parallelism, iters, warmup, mbs, gbs, log_interval, root: Path, tag: str) -> Tuple[float, float]:
    """(median wall, median CPU) seconds per step the orchestrator's summary reports (logging rank)."""
    subprocess.run(
        _orchestrator_args(parallelism, iters, warmup, mbs, gbs, log_interval, root, tag),
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    lines = (root / f"bench_{tag}" / "metrics.jsonl").read_text().splitlines()
    summary = [json.loads(l) for l in lines if '"summary"' in l][-1]
    return summary["step_time_median_s"], summary["step_cpu_time_median_s"]


def job_seconds(command: List[str]) -> float:
    """Wall-clock seconds of one command, from its start to its exit."""
    t0 = time.perf_counter()
    subprocess.run(command, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _median_interval(values: Sequence[float], draws: int = 10000, seed: int = 0) -> Tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the median over ``draws`` resamples of ``values`` with replacement
    (the percentile bootstrap, Efron & Tibshirani 1993, ch. 13): how far the median of the repeats' ratios
    could move with other repeats on this machine."""
    import random

    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def _ms(values: Sequence[float]) -> str:
    return f"median {statistics.median(values) * 1e3:.1f} ms, min {min(values) * 1e3:.1f} ms"


def _load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" on {os.cpu_count()} CPUs"


def counts(args, tp: int, pp: int, dp: int) -> None:
    """Collectives and host reads per iteration on every rank, the bare loop's and the orchestrator's (runs
    of 10 and 30 iterations each way, bench/call_counts.py)."""
    import call_counts

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)

        def orch(n: int) -> None:
            orchestrated(args.parallelism, n, 0, args.mbs, args.gbs, args.log_interval, root, f"count{n}")

        orch(1)  # the data cache, before anything is counted
        bare_counts = call_counts.per_iteration(
            lambda n: bare(tp, pp, dp, n, 0, args.mbs, args.gbs, args.log_interval), 10, 30
        )
        orch_counts = call_counts.per_iteration(orch, 10, 30)
    print(f"per iteration, bare megatron-core loop:\n{call_counts.describe(bare_counts)}")
    print(
        f"per iteration, orchestrator (log_interval {args.log_interval}: the loss is read and reduced once in "
        f"{args.log_interval} iterations):\n{call_counts.describe(orch_counts)}"
    )
    print(f"orchestrator minus bare, per iteration:\n{call_counts.compare(orch_counts, bare_counts)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parallelism", default="pp2_dp2", choices=sorted(LAYOUTS))
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--gbs", type=int, default=16)
    ap.add_argument(
        "--log-interval",
        type=int,
        default=10,
        help="orchestrator training.log_interval (records, TensorBoard and the loss sync happen there)",
    )
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--skip-steps", action="store_true", help="only the 1-iteration job comparison")
    ap.add_argument("--skip-job", action="store_true", help="only the steady-state step comparison")
    ap.add_argument(
        "--counts",
        action="store_true",
        help="only: collectives and host reads per iteration, per rank, both ways (bench/call_counts.py)",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an override for the orchestrator's jobs"
    )
    ap.add_argument("--bare-job", action="store_true", help=argparse.SUPPRESS)  # one bare 1-iteration job
    args = ap.parse_args()
    tp, pp, dp = LAYOUTS[args.parallelism]
    EXTRA.extend(args.set)
    if args.bare_job:
        bare(tp, pp, dp, 1, 0, args.mbs, args.gbs, args.log_interval)
        return
    print(f"before: {_load()}", flush=True)
    if args.counts:
        counts(args, tp, pp, dp)
        return
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        # Warm the data cache (prepared corpus, sample indices) so no job below prepares anything.
        orchestrated(args.parallelism, 1, 0, args.mbs, args.gbs, 1, root, "warm")
        if not args.skip_steps:
            bares, orchs = [], []
            for r in range(args.repeats):  # alternate which goes first: the machine's load drifts
                for which in ("bare", "orch") if r % 2 == 0 else ("orch", "bare"):
                    if which == "bare":
                        bares.append(bare(tp, pp, dp, args.iters, args.warmup, args.mbs, args.gbs, args.log_interval))
                    else:
                        orchs.append(
                            orchestrated(
                                args.parallelism,
                                args.iters,
                                args.warmup,
                                args.mbs,
                                args.gbs,
                                args.log_interval,
                                root,
                                str(r),
                            )
                        )
                print(
                    f"repeat {r}: bare {bares[-1][0] * 1e3:.1f} ms/step ({bares[-1][1] * 1e3:.1f} ms CPU), "
                    f"orchestrator {orchs[-1][0] * 1e3:.1f} ms/step ({orchs[-1][1] * 1e3:.1f} ms CPU)",
                    flush=True,
                )
        if not args.skip_job:
            bare_jobs, orch_jobs = [], []
            bare_job = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--bare-job",
                "--parallelism",
                args.parallelism,
                "--mbs",
                str(args.mbs),
                "--gbs",
                str(args.gbs),
            ]
            for r in range(args.repeats):
                for which in ("bare", "orch") if r % 2 == 0 else ("orch", "bare"):
                    if which == "bare":
                        bare_jobs.append(job_seconds(bare_job))
                    else:
                        orch_jobs.append(
                            job_seconds(
                                _orchestrator_args(args.parallelism, 1, 0, args.mbs, args.gbs, 1, root, f"job{r}")
                            )
                        )
                print(
                    f"repeat {r}: 1-iteration job: bare {bare_jobs[-1]:.2f} s, orchestrator {orch_jobs[-1]:.2f} s",
                    flush=True,
                )
    print(
        f"gpt_tiny {args.parallelism} (TP{tp} PP{pp} DP{dp}), MBS {args.mbs}, GBS {args.gbs}, "
        f"{args.iters} iterations ({args.warmup} warm-up, log_interval {args.log_interval}) x {args.repeats} repeats"
    )
    if not args.skip_steps:
        for what, i in (("wall", 0), ("CPU", 1)):
            b, o = [x[i] for x in bares], [x[i] for x in orchs]
            print(f"step {what} time: bare {_ms(b)}, orchestrator {_ms(o)}")
            ratios = [oi / bi for oi, bi in zip(o, b)]  # each repeat's two runs, back to back
            low, high = _median_interval(ratios)
            print(
                f"step ratio orchestrator/bare ({what}): {statistics.median(o) / statistics.median(b):.3f} "
                f"of medians, {min(o) / min(b):.3f} of minima, {statistics.median(ratios):.3f} median of the "
                f"repeats' own ratios (95% bootstrap interval {low:.3f}-{high:.3f}; one repeat's "
                f"{min(ratios):.3f}-{max(ratios):.3f}) (target <= 1.01)"
            )
    if not args.skip_job:
        bj, oj = statistics.median(bare_jobs), statistics.median(orch_jobs)
        print(
            f"1-iteration job: bare {bj:.2f} s, orchestrator {oj:.2f} s (medians; minima {min(bare_jobs):.2f} s, "
            f"{min(orch_jobs):.2f} s; the orchestrator's includes composing, validating, the data cache check, "
            "submission and the launcher's wait)"
        )
        print(
            f"1-iteration job ratio orchestrator/bare: {oj / bj:.3f} of medians, "
            f"{min(orch_jobs) / min(bare_jobs):.3f} of minima (target <= 1.10)"
        )
    print(f"after: {_load()}", flush=True)


if __name__ == "__main__":
    main()
