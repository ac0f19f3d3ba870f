"""Checkpoint integrity cost vs the save itself: gpt_125m with Adam (~1.5-2 GB on disk), on CPU.

Builds the model and optimizer through the runtime (one rank: ``init_distributed``, megatron
parallel state, ``build_model_and_optimizer``; one optimizer step on zero gradients creates
Adam's moments), then, for each ``checkpoint.digest`` mode, saves through
``runtime.checkpoint.save`` — megatron ``dist_checkpointing`` (torch_dist), then the manifest —
and times:

* save      the dist_checkpointing save (wall time of ``checkpoint.save`` minus the manifest),
* manifest  building and writing the manifest on rank 0, plus (``sha256`` mode) the ranks' parallel
            hashing right after the save,
* verify    the in-job resume check (``ckpt.resume.preflight``: find, read and verify the latest),
* deep      ``manifest check --deep`` (re-hash every recorded file; offline, not at resume).

Prints one line per mode and the ratio (manifest + verify) / save; target <= 0.05 for the default.

    python bench/ckpt_integrity.py                    # both modes, vocab 50257 (GPT-2), ~125M params
    python bench/ckpt_integrity.py --modes size --dir /scratch/ckpt_bench
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _config(run_dir: Path, digest: str):
    from orchestrator.config.compose import compose_config

    cfg = compose_config(
        [
            "model=gpt_125m",
            "parallelism=none",
            "optimizer=adam",
            f"run.dir={run_dir}",
            "training.device=cpu",
            f"data.cache_dir={run_dir / 'cache'}",
        ]
    )
    cfg.checkpoint.digest = digest
    return cfg


def _save_once(cfg, built, layout, vocab: int) -> dict:
    from orchestrator.ckpt import manifest as mf
    from orchestrator.ckpt import resume
    from orchestrator.runtime.training import checkpoint as ckpt

    timings = {}

    def write_manifest(path: Path) -> None:
        t0 = time.perf_counter()
        manifest = mf.build_manifest(
            cfg,
            layout,
            iteration=1,
            consumed_samples=cfg.training.global_batch_size,
            checkpoint_dir=str(path),
            vocab_size=vocab,
            padded_vocab_size=built.padded_vocab_size,
            tokenizer={"type": "bench", "vocab_size": vocab},
            data={"fingerprint": "bench"},
            hosts=[os.uname().nodename],
        )
        mf.write_manifest(str(path), manifest)
        timings["manifest"] = time.perf_counter() - t0

    hash_in_parallel = ckpt._hash_in_parallel  # timed apart: in sha256 mode it runs inside save()

    def timed_hash(path: Path) -> None:
        t0 = time.perf_counter()
        hash_in_parallel(path)
        timings["hash"] = time.perf_counter() - t0

    ckpt._hash_in_parallel = timed_hash
    timings["hash"] = 0.0
    t0 = time.perf_counter()
    try:
        path = ckpt.save(
            cfg,
            built.model,
            built.optimizer,
            built.scheduler,
            iteration=1,
            consumed_samples=cfg.training.global_batch_size,
            manifest_fn=write_manifest,
        )
    finally:
        ckpt._hash_in_parallel = hash_in_parallel
    total = time.perf_counter() - t0
    timings["save"] = total - timings["manifest"] - timings["hash"]
    timings["manifest"] += timings["hash"]
    t0 = time.perf_counter()
    info = resume.preflight(cfg, layout, tokenizer={"type": "bench", "vocab_size": vocab})
    timings["verify"] = time.perf_counter() - t0
    assert info is not None and info.path == path, info
    t0 = time.perf_counter()
    mf.read_manifest(path, deep=True)
    timings["deep"] = time.perf_counter() - t0
    timings["bytes"] = sum(f.stat().st_size for f in path.iterdir())
    timings["files"] = len(list(path.iterdir()))
    return timings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="size,sha256", help="checkpoint.digest modes, comma-separated")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary (GPT-2's: ~125M parameters)")
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))

    import torch

    from orchestrator.config.checks import validate
    from orchestrator.runtime.rank import cpu as cpu_backend
    from orchestrator.runtime.rank.distributed import init_distributed, shutdown
    from orchestrator.runtime.rank.model import build_model_and_optimizer, count_parameters, initialize_parallel_state

    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt_integrity_"))
    modes = args.modes.split(",")
    cfg = _config(root / modes[0], modes[0])
    init_distributed(cfg)
    cpu_backend.activate()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    layout = validate(cfg)
    initialize_parallel_state(cfg, cfg.training.seed, "cpu")
    built = build_model_and_optimizer(cfg, args.vocab, "cpu", layout)
    for chunk in built.model:
        chunk.zero_grad_buffer()
    built.optimizer.step()  # zero gradients: creates Adam's exp_avg / exp_avg_sq, as after a real step
    print(f"gpt_125m: {count_parameters(built.model):,} parameters, Adam; saving into {root}", flush=True)
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs", flush=True)
    print(
        f"{'digest':<7} {'GB':>6} {'files':>5} {'save s':>8} {'manifest s':>10} {'verify s':>9} "
        f"{'ratio':>7} {'deep s':>7}"
    )
    deep = save = None
    try:
        for mode in modes:
            run_cfg = _config(root / mode, mode)
            t = _save_once(run_cfg, built, layout, args.vocab)
            ratio = (t["manifest"] + t["verify"]) / t["save"]
            print(
                f"{mode:<7} {t['bytes'] / 1e9:6.2f} {t['files']:5d} {t['save']:8.2f} {t['manifest']:10.3f} "
                f"{t['verify']:9.3f} {ratio:7.4f} {t['deep']:7.2f}",
                flush=True,
            )
            if mode == "sha256":
                deep, save = t["deep"], t["save"]
    finally:
        shutdown()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print("ratio = (manifest + verify) / save; target <= 0.05 (checkpoint.digest=size, the default)")
    if deep is not None:
        print(
            f"before (whole-checkpoint sha256 on rank 0 at save and again at resume, ~2 x deep): "
            f"{2 * deep:.2f} s, ratio {2 * deep / save:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
