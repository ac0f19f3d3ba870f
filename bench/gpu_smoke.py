"""GPU smoke check on one lent H200: the orchestrator vs a bare megatron-core loop, gpt_125m bf16.

On the GPU machine (Python 3.12, torch 2.11 preinstalled, no network) one command
1. installs the wheels carried in ``bench/wheels`` (megatron-core 0.19.2, hydra-core, omegaconf,
   antlr4-python3-runtime, submitit; ``--no-index --no-deps``, so pip never tries to fetch torch)
   into /tmp/gpu_smoke_site; the package itself comes from this checkout through PYTHONPATH
   (pyproject.toml says requires-python <3.12, so ``pip install -e .`` is refused on 3.12);
   then checks with ``importlib.util.find_spec`` every module the run imports (``RUN_IMPORTS``) and
   stops in seconds naming what is missing;
2. composes the config and asks the planner (orchestrator/plan/memory.py, formerly
   orchestrator/planner.py) for model FLOPs per step and the predicted peak memory on the H200;
3. runs ``python -m orchestrator`` (world size 1, nccl, 55 iterations of which 50 timed, mock data, no TensorBoard) and reads the
   summary it writes to ``<run.dir>/metrics.jsonl``;
4. runs a bare megatron-core loop of the same model (this file, ``--bare``), same batch;
   with the megatron config Megatron-LM's own parser builds for it (the golden
   tests/golden/megatron/gpt_125m_1gpu_bf16.json through bench/golden_bare.py), not the orchestrator's;
5. prints tokens/s, MFU, the ratio orchestrator/bare, the fusions and overlaps each side ran with,
   and peak memory vs the planner's prediction,
   and writes ``$OUT/gpu_smoke.json`` (plus logs) when $OUT is set. The whole run stops at 8 min.

The device tool's ``run`` (one line; carry=["bench/wheels"], timeout_s=540):

    PYTHONUNBUFFERED=1 python3 bench/gpu_smoke.py

Here (CPU, PyPI reachable):

    python bench/gpu_smoke.py --fetch     # download the wheels into bench/wheels (git-ignored, ~3 MiB)
    python bench/gpu_smoke.py --dry-run   # every step and command, budgets, config + plan checks

MFU = model FLOPs per token (planner: 3 x forward, attention included, no recomputation) x tokens/s
/ 989e12, the H200 SXM dense BF16 tensor-core peak from NVIDIA's H200 datasheet (1979 TFLOP/s
there is with 2:4 sparsity), as in the planner's "H200" preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / "bench" / "wheels"
SITE = Path("/tmp/gpu_smoke_site")
PEAK_BF16 = 989e12  # H200 SXM dense BF16 (NVIDIA datasheet); the planner's "H200" preset says the same
TOTAL_S = 480  # the whole device run: 8 minutes
BUDGET_S = {"install": 45, "orchestrator": 130, "bare": 110, "cycle": 140, "fp8": 50}
CYCLE_TOL = 1e-5  # relative: the resumed losses vs the uninterrupted run's
PINS = {
    "megatron-core": "0.19.2",
    "hydra-core": "1.3.8",
    "omegaconf": "2.3.1",
    "antlr4-python3-runtime": "4.9.3",
    "submitit": "1.5.4",
    "packaging": "26.2",
}
SDIST_ONLY = {"antlr4-python3-runtime"}  # PyPI has no wheel of 4.9.3: built here by `pip wheel` (pure Python)
ONLY_IF_OLDER = {"packaging": "24.2"}  # megatron-core 0.19 needs packaging>=24.2; the GPU image has one
ON_THE_BOX = [
    "torch",
    "triton",
    "numpy",
    "psutil",
    "rich",
    "matplotlib",
    "filelock",
    "yaml",
    "cloudpickle",
    "typing_extensions",
    "einops",
]  # imported by megatron-core / orchestrator; in the GPU image already
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def say(msg: str) -> None:
    print(f"[gpu_smoke] {msg}", flush=True)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def find_wheels() -> Dict[str, Optional[Path]]:
    """Pinned name -> its wheel file in bench/wheels (None when missing)."""
    files = list(WHEELS.glob("*.whl")) if WHEELS.is_dir() else []
    found: Dict[str, Optional[Path]] = {}
    for name, ver in PINS.items():
        found[name] = next(
            (f for f in files if _norm(f.name.split("-")[0]) == _norm(name) and f.name.split("-")[1] == ver), None
        )
    return found


def _older(dist: str, minimum: str) -> bool:
    """True when ``dist`` is not installed here or older than ``minimum``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = tuple(int(x) for x in re.findall(r"\d+", version(dist))[:3])
    except PackageNotFoundError:
        return True
    return have < tuple(int(x) for x in minimum.split("."))


def install_command() -> List[str]:
    names = [f"{n}=={v}" for n, v in PINS.items() if n not in ONLY_IF_OLDER or _older(n, ONLY_IF_OLDER[n])]
    return [
        sys.executable,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--find-links",
        str(WHEELS),
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(SITE),
        *names,
    ]


def fetch() -> int:
    """Download the pinned wheels for CPython 3.12 x86-64 into bench/wheels (never torch)."""
    WHEELS.mkdir(parents=True, exist_ok=True)
    binary = [f"{n}=={v}" for n, v in PINS.items() if n not in SDIST_ONLY]
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    cmds = [
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            "--abi",
            "cp312",
            *plat,
            "-d",
            str(WHEELS),
            *binary,
        ]
    ]
    cmds += [
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(WHEELS), f"{n}=={PINS[n]}"] for n in SDIST_ONLY
    ]
    for cmd in cmds:
        say("$ " + shlex.join(cmd))
        if subprocess.run(cmd).returncode != 0:
            say("FAILED: the download above did not complete")
            return 1
    keep = {f for f in find_wheels().values() if f}
    for f in WHEELS.glob("*.whl"):  # one version of each: two would stop the install
        if f not in keep and any(_norm(f.name.split("-")[0]) == _norm(n) for n in PINS):
            f.unlink()
    return report_wheels()


def report_wheels() -> int:
    found = find_wheels()
    total = sum(f.stat().st_size for f in found.values() if f)
    for name, f in found.items():
        note = f" (installed only if the box's {name} < {ONLY_IF_OLDER[name]})" if name in ONLY_IF_OLDER else ""
        say(f"  {name}=={PINS[name]}: " + (f"{f.name} {f.stat().st_size / 2**20:.2f} MiB{note}" if f else "MISSING"))
    missing = [n for n, f in found.items() if not f]
    say(
        f"wheels in {WHEELS.relative_to(REPO)}: {total / 2**20:.2f} MiB in all (carry limit 64 MiB)"
        + (f"; missing: {', '.join(missing)} (run --fetch here first)" if missing else "")
    )
    return 1 if missing else 0


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the step's process group (the orchestrator stops its ranks on it), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def run_step(
    name: str, cmd: List[str], timeout: float, env: Dict[str, str], log: Path
) -> Tuple[Optional[int], List[str]]:
    """Run ``cmd`` in its own process group, echoing and logging its output; rc None on timeout."""
    say(f"{name}: $ {shlex.join(cmd)}  (timeout {timeout:.0f} s)")
    if timeout < 15:
        say(f"SKIPPED: {name}: only {timeout:.0f} s of the {TOTAL_S} s budget left")
        return None, []
    lines: List[str] = []
    t0 = time.monotonic()
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,
        )

        def pump() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                fh.write(line)
                lines.append(line.rstrip("\n"))
                print(f"  {name}| {line}", end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
            _kill_group(proc)
        reader.join(10)
    took = time.monotonic() - t0
    if rc != 0:
        why = f"timed out after {took:.0f} s" if rc is None else f"exit code {rc} after {took:.0f} s"
        say(f"FAILED: {name} {why}; its last lines:\n    " + "\n    ".join(lines[-40:]))
    else:
        say(f"{name}: done in {took:.0f} s")
    return rc, lines


RUN_IMPORTS = [n for n in ON_THE_BOX if n != "einops"] + [
    "megatron.core",
    "hydra",
    "omegaconf",
    "antlr4",
    "submitit",
    "packaging",
    "orchestrator",
]
"""Every top-level module the device run imports (the box's own, then the carried wheels, then this checkout);
not einops: megatron-core imports it optionally (this machine trains without it)."""


def missing_imports(paths: List[str]) -> List[str]:
    """The modules of RUN_IMPORTS ``importlib.util.find_spec`` cannot find with ``paths`` in front (seconds:
    nothing is imported)."""
    saved = list(sys.path)
    sys.path[:0] = paths
    importlib.invalidate_caches()
    try:
        return [n for n in RUN_IMPORTS if importlib.util.find_spec(n) is None]
    finally:
        sys.path[:] = saved


def _import_first(*names: str):
    """The first importable module of ``names`` (the package is being restructured)."""
    errors = []
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ImportError("; ".join(errors))


def orchestrator_overrides(a: argparse.Namespace, root: str) -> List[str]:
    return [
        f"model={a.model}",
        "parallelism=none",
        "data=mock",
        "cluster=local",
        "cluster.gpus_per_node=1",
        "cluster.timeout_min=7",
        "training.device=cuda",
        "training.precision=bf16",
        f"training.train_iters={a.iters}",
        f"training.timing_warmup_iters={a.warmup}",
        f"training.micro_batch_size={a.mbs}",
        f"training.global_batch_size={a.gbs}",
        "training.log_interval=1",
        "checkpoint.save_at_end=false",
        "checkpoint.save_interval=null",
        "optimizer.lr_warmup_iters=0",
        "logging.tensorboard=false",  # needs the tensorboard package, which the box may lack
        f"run.root={root}",
        "run.name=gpu_smoke",
        "gpu=H200",
    ]


OVERLAPPED = [
    "optimizer.use_distributed_optimizer=true",
    "parallelism.overlap_grad_reduce=true",
    "parallelism.overlap_param_gather=true",
]
"""The cycle's optimizer: megatron-core's DistributedOptimizer with both overlaps, the forced gather before its
save and the pre-hooks after (runtime/rank/param_sync.py) on a GPU; at DP 1 it shards nothing, so its losses
must equal step 3's plain optimizer's within CYCLE_TOL (tests/test_distopt.py holds DP 2 and 4 on CPU)."""


def cycle_steps(a: argparse.Namespace, root: str) -> List[Tuple[str, List[str]]]:
    """Save -> resume -> continue with :data:`OVERLAPPED`: the orchestrator run's config in ``<root>/gpu_cycle``,
    stopped after half its iterations (a checkpoint there), then the same command again (it resumes and
    finishes)."""
    half = a.iters // 2
    new = ["run.name=gpu_cycle", f"checkpoint.save_interval={half}", *OVERLAPPED]
    keys = {n.split("=", 1)[0] for n in new}  # each key once on the command line
    overrides = [o for o in orchestrator_overrides(a, root) if o.split("=", 1)[0] not in keys] + new
    base = [sys.executable, "-m", "orchestrator", *overrides]
    return [("cycle-save", base + [f"training.exit_after_iters={half}"]), ("cycle-resume", base)]


def fp8_step(a: argparse.Namespace, root: str) -> Optional[List[str]]:
    """The orchestrator run's config with ``training.fp8=hybrid`` (Transformer Engine's delayed-scaling recipe,
    Megatron-LM's defaults) in ``<root>/gpu_fp8``, 20 iterations; None when Transformer Engine is not importable
    (the orchestrator refuses fp8 without it, in one line)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    new = ["run.name=gpu_fp8", "training.fp8=hybrid", "training.train_iters=20", "training.timing_warmup_iters=5"]
    keys = {n.split("=", 1)[0] for n in new}
    return [
        sys.executable,
        "-m",
        "orchestrator",
        *[o for o in orchestrator_overrides(a, root) if o.split("=", 1)[0] not in keys],
        *new,
    ]


def read_losses(run_dir: Path) -> Dict[int, float]:
    """lm loss per iteration from metrics.jsonl (a resumed run's later record wins)."""
    path, out = run_dir / "metrics.jsonl", {}
    for rec in (json.loads(x) for x in path.read_text().splitlines()) if path.is_file() else ():
        if "event" not in rec:
            out[rec["iteration"]] = rec["lm_loss"]
    return out


def compare_cycle(reference: Path, cycled: Path, after: int) -> dict:
    """The resumed run's losses after ``after`` vs the uninterrupted run's (max relative difference)."""
    ref, got = read_losses(reference), read_losses(cycled)
    its = [i for i in sorted(ref) if i > after]
    if not its or any(i not in got for i in its):
        return {"ok": False, "why": f"missing iterations (reference {len(ref)}, resumed {len(got)})"}
    rel = max(abs(got[i] - ref[i]) / max(abs(ref[i]), 1e-12) for i in its)
    return {"ok": rel <= CYCLE_TOL, "max_rel_diff": rel, "iterations": [its[0], its[-1]], "tolerance": CYCLE_TOL}


def plan_and_spec(a: argparse.Namespace, root: str) -> Tuple[dict, dict]:
    """Compose the same config in-process, plan it on the H200 preset; (plan numbers, bare-loop spec)."""
    overrides = orchestrator_overrides(a, root) + [f"run.dir={root}/gpu_smoke"]
    if importlib.util.find_spec("orchestrator.config") and importlib.util.find_spec("orchestrator.config.compose"):
        cfg = importlib.import_module("orchestrator.config.compose").compose_config(overrides)
    else:  # before the restructure: orchestrator/config.py
        from hydra import compose, initialize_config_dir

        schema = _import_first("orchestrator.config.schema", "orchestrator.config")
        schema.register_configs()
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
            cfg = schema.to_job_config(compose("config", overrides=overrides))
    memory = _import_first("orchestrator.plan.memory", "orchestrator.planner")
    p = memory.plan(cfg, gpu="H200")
    tokens = p.layout.tokens_per_step
    numbers = {
        "gpu_preset": p.gpu.name,
        "peak_flops": p.gpu.peak_flops("bf16"),
        "params_total": p.params_total,
        "padded_vocab_size": p.padded_vocab_size,
        "tokens_per_step": tokens,
        "model_flops_per_step": p.model_flops,
        "model_flops_per_token": p.model_flops / tokens,
        "predicted_peak_mb": p.peak_bytes / 2**20,
        "predicted_overhead_mb": p.worst.overhead / 2**20,
        "predicted_tokens_per_s_at_mfu_0.4": p.tokens_per_s,
    }
    spec = {
        "model": dataclasses.asdict(cfg.model),
        "optimizer": dataclasses.asdict(cfg.optimizer),
        "padded_vocab_size": p.padded_vocab_size,
        "mbs": cfg.training.micro_batch_size,
        "gbs": cfg.training.global_batch_size,
        "iters": a.iters,
        "warmup": a.warmup,
        "seed": cfg.training.seed,
    }
    return numbers, spec


# ---- the bare megatron-core loop (a subprocess: its own CUDA context, peak memory and timeout) -------


def _bare_model(spec: dict, device: str):
    """GPTModel (+ Float16Module) with the megatron config of Megatron-LM's own parser for gpt_125m on one GPU
    in bf16 (bench/golden_bare.py: tests/golden/megatron/gpt_125m_1gpu_bf16.json), not the orchestrator's."""
    from golden_bare import bare_configs, load_golden
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs
    from megatron.core.transformer.module import Float16Module

    golden = load_golden()
    configs = bare_configs(golden, device)
    config, m = configs["transformer"], spec["model"]
    impl = "local"
    if device == "cuda" and importlib.util.find_spec("transformer_engine") is not None:
        impl = "transformer_engine"  # Megatron-LM's --transformer-impl default
    layer = (
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
        if impl == "transformer_engine"
        else gpt_layer_specs.get_gpt_layer_local_spec(normalization=m["normalization"])
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer,
        vocab_size=golden["gpt_model"]["vocab_size"],
        max_sequence_length=m["max_position_embeddings"],
        share_embeddings_and_output_weights=not m["untie_embeddings_and_output_weights"],
        position_embedding_type=m["position_embedding_type"],
    )
    if device == "cuda":
        model = Float16Module(config, model.cuda())
    return configs, model, impl


def bare_worker(spec: dict, out: Path, device: str) -> None:
    """One rank: nccl (gloo on CPU), DDP, megatron Adam, get_forward_backward_func, fixed token batches."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 500), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if device == "cuda":
        torch.cuda.set_device(0)
    else:  # only to check this code here: the CPU compatibility layer, fp32, gloo
        from orchestrator.runtime.rank import cpu

        cpu.activate()
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    torch.manual_seed(spec["seed"])
    tensor_parallel.model_parallel_cuda_manual_seed(spec["seed"])
    configs, model, impl = _bare_model(spec, device)
    config = configs["transformer"]
    ddp = DistributedDataParallel(config=config, module=model, ddp_config=configs["ddp"])
    opt = get_megatron_optimizer(configs["optimizer"], [ddp])
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    config.grad_scale_func = opt.scale_loss
    mbs, seq = spec["mbs"], spec["model"]["seq_length"]
    tokens = torch.randint(0, 258, (mbs, seq), device=device)
    labels, mask = torch.roll(tokens, -1, 1), torch.ones(mbs, seq, device=device)
    positions = torch.arange(seq, device=device).expand(mbs, seq)

    def step(_it, mdl):
        out_t = mdl(tokens, positions, None, labels=labels)
        return out_t, lambda o_t: ((o_t.float() * mask).sum() / mask.sum(), {})

    fb, n_micro, times = get_forward_backward_func(), spec["gbs"] // mbs, []
    for i in range(spec["iters"]):
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        opt.zero_grad()
        fb(
            forward_step_func=step,
            data_iterator=iter([None] * n_micro),
            model=[ddp],
            num_microbatches=n_micro,
            seq_length=seq,
            micro_batch_size=mbs,
            forward_only=False,
        )
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    out.write_text(
        json.dumps(
            {
                "step_time_median_s": statistics.median(times),
                "timed_iterations": len(times),
                "tokens_per_step": spec["gbs"] * seq,
                "peak_gpu_mem_mb": peak,
                "transformer_impl": impl,
                "megatron_config": {
                    "source": "Megatron-LM golden",
                    "active": configs["active"],
                    "turned_off_here": configs["turned_off"],
                    "golden_fields_not_in_this_line": len(configs["dropped"]),
                },
                "torch": torch.__version__,
                "device_name": torch.cuda.get_device_name(0) if peak else "cpu",
            }
        )
    )
    ps.destroy_model_parallel()
    torch.distributed.destroy_process_group()


# ---- the device run ----------------------------------------------------------------------------------


def read_summary(run_dir: Path) -> Optional[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return next((r for r in reversed(records) if r.get("event") == "summary"), None)


def print_rank_logs(run_dir: Path) -> None:
    for log in sorted((run_dir / "submitit").glob("*_log.*"))[:4]:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        say(f"tail of {log}:\n    " + "\n    ".join(tail))


def table(plan: dict, orch: Optional[dict], bare: Optional[dict]) -> dict:
    """Print the comparison; returns the derived numbers."""

    def derive(r: Optional[dict], mem_key: str) -> Optional[dict]:
        if not r or not r.get("step_time_median_s"):
            return None
        tps = r["tokens_per_step"] / r["step_time_median_s"]
        mem = r.get(mem_key)
        mem = mem[0] if isinstance(mem, list) else mem
        return {
            "tokens_per_s": tps,
            "step_time_ms": 1e3 * r["step_time_median_s"],
            "peak_gpu_mem_mb": mem,
            "mfu": tps * plan["model_flops_per_token"] / PEAK_BF16,
        }

    rows = {
        "orchestrator": derive(orch, "peak_gpu_mem_mb_per_rank"),
        "bare megatron-core": derive(bare, "peak_gpu_mem_mb"),
    }
    pred, pred_no_ovh = plan["predicted_peak_mb"], plan["predicted_peak_mb"] - plan["predicted_overhead_mb"]
    say(f"{'':<22}{'tokens/s':>12}{'step ms':>10}{'MFU':>8}{'peak MiB':>11}{'/planner':>10}")
    for name, d in rows.items():
        if d is None:
            say(f"{name:<22}{'(no result)':>12}")
            continue
        ratio = f"{d['peak_gpu_mem_mb'] / pred_no_ovh:.2f}" if d["peak_gpu_mem_mb"] else "-"
        say(
            f"{name:<22}{d['tokens_per_s']:>12,.0f}{d['step_time_ms']:>10.1f}{d['mfu']:>8.1%}"
            f"{d['peak_gpu_mem_mb'] or 0:>11,.0f}{ratio:>10}"
        )
    say(
        f"planner (H200 preset): peak {pred:,.0f} MiB = {pred_no_ovh:,.0f} weights+grads+optimizer+activations "
        f"+ {plan['predicted_overhead_mb']:,.0f} assumed framework overhead ('/planner' divides by the former: "
        "max_memory_allocated excludes the CUDA context); model FLOPs/token "
        f"{plan['model_flops_per_token']:.4g}; MFU against {PEAK_BF16 / 1e12:g} TFLOP/s (H200 datasheet, dense bf16)"
    )
    o, b = rows["orchestrator"], rows["bare megatron-core"]
    ratio = o["tokens_per_s"] / b["tokens_per_s"] if o and b else None
    say("ratio orchestrator/bare (tokens/s): " + (f"{ratio:.3f}" if ratio else "n/a"))
    say_active(orch.get("megatron_active") if orch else None, (bare or {}).get("megatron_config"))
    return {"rows": rows, "ratio_orchestrator_over_bare_tokens_per_s": ratio}


def say_active(ours: Optional[dict], bare: Optional[dict]) -> None:
    """Which fusions and overlaps each side ran with (ours: its megatron_config.json; bare: the golden's)."""
    say(f"fusions/overlaps on, orchestrator (megatron_config.json): {ours if ours else 'n/a'}")
    if bare:
        say(
            f"fusions/overlaps on, bare (Megatron-LM's own config): {bare['active']}; turned off on this machine "
            f"(Megatron-LM would refuse them here): {bare['turned_off_here'] or 'none'}"
        )
    else:
        say("fusions/overlaps on, bare: n/a")


def device_run(a: argparse.Namespace) -> int:
    deadline = time.monotonic() + TOTAL_S

    def left(cap):
        return min(cap, deadline - time.monotonic())

    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu_smoke_out_"))
    work = Path(tempfile.mkdtemp(prefix="gpu_smoke_"))
    env = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        ORCHESTRATOR_CACHE=str(work / "cache"),
        PYTHONPATH=os.pathsep.join([str(REPO), str(SITE), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    result: dict = {"ok": False, "python": sys.version.split()[0], "pins": PINS, "args": vars(a)}

    def finish(code: int) -> int:
        (out / "gpu_smoke.json").write_text(json.dumps(result, indent=1, default=str))
        say(f"results: {out / 'gpu_smoke.json'} ({'ok' if code == 0 else 'FAILED'})")
        return code

    if report_wheels():
        return finish(1)
    rc, _ = run_step("install", install_command(), left(BUDGET_S["install"]), env, out / "install.log")
    if rc != 0:
        return finish(1)
    result["missing_imports"] = missing = missing_imports([str(REPO), str(SITE)])
    if missing:
        say(f"FAILED: the run would not import {', '.join(missing)} (carry a wheel of each in bench/wheels)")
        return finish(1)
    sys.path[:0] = [str(REPO), str(SITE)]
    try:
        result["plan"], spec = plan_and_spec(a, str(work))
    except Exception as exc:  # noqa: BLE001 - report any composition/planner failure and stop
        say(f"FAILED: composing the config / planning: {type(exc).__name__}: {exc}")
        return finish(1)
    cmd = [sys.executable, "-m", "orchestrator", *orchestrator_overrides(a, str(work))]
    rc, _ = run_step("orchestrator", cmd, left(BUDGET_S["orchestrator"]), env, out / "orchestrator.log")
    result["orchestrator"] = read_summary(work / "gpu_smoke")
    megatron_json = work / "gpu_smoke" / "megatron_config.json"
    if result["orchestrator"] and megatron_json.is_file():
        from golden_bare import active_of

        result["orchestrator"]["megatron_active"] = active_of(json.loads(megatron_json.read_text()))
    if rc != 0 or not result["orchestrator"]:
        print_rank_logs(work / "gpu_smoke")
    spec_file, bare_file = work / "bare_spec.json", work / "bare.json"
    spec_file.write_text(json.dumps(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--bare", str(spec_file), "--bare-out", str(bare_file)]
    rc, _ = run_step("bare", cmd, left(BUDGET_S["bare"]), env, out / "bare.log")
    result["bare"] = json.loads(bare_file.read_text()) if bare_file.is_file() else None
    result.update(table(result["plan"], result["orchestrator"], result["bare"]))
    cycle_deadline = time.monotonic() + left(BUDGET_S["cycle"])
    for name, cmd in cycle_steps(a, str(work)):
        rc, _ = run_step(name, cmd, max(1.0, cycle_deadline - time.monotonic()), env, out / f"{name}.log")
        if rc != 0:
            break
    result["cycle"] = compare_cycle(work / "gpu_smoke", work / "gpu_cycle", after=a.iters // 2)
    say(f"save -> resume -> continue (distributed optimizer, both overlaps): {result['cycle']}")
    fp8 = fp8_step(a, str(work))
    if fp8 is None:
        say("fp8: skipped, Transformer Engine is not importable here")
    else:
        rc, _ = run_step("fp8", fp8, left(BUDGET_S["fp8"]), env, out / "fp8.log")
        result["fp8"] = read_summary(work / "gpu_fp8")
        losses = read_losses(work / "gpu_fp8")
        say(
            f"fp8 hybrid: rc {rc}, {len(losses)} losses, last {losses.get(max(losses)) if losses else None}, "
            f"summary {result['fp8']}"
        )
    result["ok"] = bool(result["orchestrator"] and result["bare"] and result["cycle"]["ok"])
    return finish(0 if result["ok"] else 1)


def dry_run(a: argparse.Namespace) -> int:
    """What the device run would do, and the checks this machine can make (no GPU, no install)."""
    root = "/tmp/gpu_smoke_XXXX"
    say(f"python here {sys.version.split()[0]}; the GPU box has 3.12.3 (megatron-core's wheel is cp312) and torch 2.11")
    say(f"step 0: total budget {TOTAL_S} s; per step caps {BUDGET_S} (each also cut to the time left)")
    say("step 1: wheels")
    wheels_missing = report_wheels()
    say("        $ " + shlex.join(install_command()))
    say(f"        then PYTHONPATH={REPO}:{SITE}; expected in the GPU image already: {', '.join(ON_THE_BOX)}")
    say(
        f"        import check (find_spec, before anything runs; stops naming what is missing): {', '.join(RUN_IMPORTS)}"
    )
    here = missing_imports([str(REPO)])
    say("        of those, missing on this machine: " + (", ".join(here) if here else "none"))
    say("step 2: compose + plan (torch-free), checked here with plan=true:")
    with tempfile.TemporaryDirectory() as d:  # Hydra creates the run directory even with plan=true
        cmd = [sys.executable, "-m", "orchestrator", *orchestrator_overrides(a, d), "plan=true"]
        rc, _ = run_step("plan", cmd, 90, dict(os.environ, PYTHONPATH=str(REPO)), Path(d) / "plan.log")
        try:
            plan, spec = plan_and_spec(a, d)
            say(f"        planner: {json.dumps(plan)}")
            m = spec["model"]
            say(
                f"        bare-loop spec: {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} "
                f"heads, seq {m['seq_length']}, vocab {spec['padded_vocab_size']}, MBS {spec['mbs']}, GBS {spec['gbs']}"
            )
        except Exception as exc:  # noqa: BLE001
            say(f"        FAILED in-process compose/plan: {type(exc).__name__}: {exc}")
            rc = rc or 1
    say(
        f"step 3 (<= {BUDGET_S['orchestrator']} s): $ "
        + shlex.join([sys.executable, "-m", "orchestrator", *orchestrator_overrides(a, root)])
    )
    say(
        f"        then reads {root}/gpu_smoke/metrics.jsonl (last {{'event': 'summary'}}: step_time_median_s, "
        "tokens_per_step, peak_gpu_mem_mb_per_rank)"
    )
    say(
        f"step 4 (<= {BUDGET_S['bare']} s): $ {sys.executable} {Path(__file__).resolve()} --bare "
        f"{root}/bare_spec.json --bare-out {root}/bare.json   (megatron config: Megatron-LM's own, "
        f"tests/golden/megatron/gpt_125m_1gpu_bf16.json; MBS {a.mbs}, GBS {a.gbs}, {a.iters} iterations, "
        f"{a.warmup} warm-up)"
    )
    rc = dry_run_configs(a, root) or rc
    say(
        f"step 5 (<= {BUDGET_S['cycle']} s): save -> resume -> continue with the distributed optimizer and both overlaps, losses after iteration {a.iters // 2} vs "
        f"step 3's (relative {CYCLE_TOL}):"
    )
    for name, cmd in cycle_steps(a, root):
        say(f"        {name}: $ " + shlex.join(cmd))
    fp8 = fp8_step(a, root)
    say(
        f"step 5b (<= {BUDGET_S['fp8']} s): fp8 hybrid, 20 iterations: "
        + ("$ " + shlex.join(fp8) if fp8 else "skipped here (no Transformer Engine); runs where TE imports")
    )
    say(
        "step 6: table (tokens/s and MFU orchestrator vs bare and their ratio; peak torch.cuda.max_memory_allocated "
        "vs the planner) + $OUT/gpu_smoke.json, $OUT/{install,orchestrator,bare,cycle-save,cycle-resume}.log"
    )
    say(
        "dry run: "
        + ("config and plan OK" if rc == 0 else "config/plan check FAILED")
        + ("; wheels missing (python bench/gpu_smoke.py --fetch)" if wheels_missing else "; wheels present")
    )
    return 0 if rc == 0 else 1


def dry_run_configs(a: argparse.Namespace, root: str) -> int:
    """Both megatron configs, built here as the device would build them (no CUDA call): the orchestrator's
    (``megatron-config``, this machine's packages) and the bare loop's (the golden's)."""
    try:
        from golden_bare import active_of, bare_configs, load_golden

        from orchestrator.config.compose import compose_config
        from orchestrator.convert.megatron_config_cli import megatron_json

        ours, device, _ = megatron_json(compose_config(orchestrator_overrides(a, root)))
        golden = load_golden()
        bare = bare_configs(golden, "cuda")
        say(f"        megatron config, orchestrator (device={device}, this machine's packages): on {active_of(ours)}")
        say(
            f"        megatron config, bare: Megatron-LM {golden['megatron_lm']['commit'][:7]}'s own "
            f"(megatron-core {golden['megatron_lm']['megatron_core']}): on {bare['active']}; turned off here "
            f"(kernels missing): {bare['turned_off'] or 'none'}; {len(bare['dropped'])} golden fields not in this "
            "megatron-core line"
        )
        return 0
    except Exception as exc:  # noqa: BLE001 - the dry run reports, it does not crash
        say(f"        FAILED building the megatron configs: {type(exc).__name__}: {exc}")
        return 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--fetch", action="store_true", help="download the wheels into bench/wheels (needs PyPI)")
    mode.add_argument("--dry-run", action="store_true", help="print the steps and check what a CPU machine can")
    mode.add_argument("--bare", metavar="SPEC_JSON", help=argparse.SUPPRESS)
    ap.add_argument("--bare-out", help=argparse.SUPPRESS)
    ap.add_argument("--bare-device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    ap.add_argument("--model", default="gpt_125m")
    ap.add_argument("--iters", type=int, default=55, help="iterations per run (warm-up included: >= 50 timed)")
    ap.add_argument("--warmup", type=int, default=5, help="iterations left out of the medians")
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--gbs", type=int, default=32)
    a = ap.parse_args()
    if a.fetch:
        return fetch()
    if a.dry_run:
        return dry_run(a)
    if a.bare:
        bare_worker(json.loads(Path(a.bare).read_text()), Path(a.bare_out), a.bare_device)
        return 0
    return device_run(a)


if __name__ == "__main__":
    sys.exit(main())
