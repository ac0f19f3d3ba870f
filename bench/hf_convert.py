"""Hugging Face import and export at >= 1 B parameters: time and peak memory (issue 38 item 3).

Builds a synthetic Llama-shaped directory on disk -- TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads,
4 KV groups, FFN 5632, vocabulary 32,000, untied embeddings: 1.10 B parameters), random fp32 weights (the dtype a
CPU job trains in), written tensor by tensor with the product's shard writer (``runtime.rank.hf_files.ShardWriter``),
never the whole model in memory -- then

(a) imports it: ``convert from-hf``, then a one-rank CPU job (``parallelism=none``: the cheapest layout, nothing
    held twice) with ``training.train_iters=0`` and ``checkpoint.hf_verify=false`` (transformers' reference model
    would be a second copy of the weights), which loads the weights one layer at a time and saves iteration 0;
(b) exports that checkpoint with ``convert to-hf`` (one layer at a time, shards written tensor by tensor);

and prints, against the target ``peak <= 1.5 x the largest single tensor + 1 GiB`` (the conversion's own memory):
the import's time and its memory beyond the model (the rank's peak during the load over its resident set before,
as the job says it), the rank's peak over the whole job and the model's own size (the job holds its model and
optimizer: the target is about what the conversion adds), the export's time and its process's peak RSS
(``getrusage`` of a wrapper's children, so the import's processes do not count), and whether the exported tensors
equal the source's bit for bit.

    python bench/hf_convert.py                          # ~13 GB of disk in a temporary directory, ~10 GB of memory
    python bench/hf_convert.py --dir /scratch/b         # the directories are kept there
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPE = dict(hidden=2048, layers=22, heads=32, groups=4, ffn=5632, vocab=32000)
"""TinyLlama-1.1B's shape."""
GIB = 2**30

WRAP = (
    "import json, resource, subprocess, sys, time; t = time.perf_counter(); rc = subprocess.call(sys.argv[1:]); "
    "print(json.dumps({'rc': rc, 'wall_s': time.perf_counter() - t, "
    "'peak_rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}), file=sys.stderr)"
)
"""Runs a command as its only child and says its wall time and largest process's peak RSS (``ru_maxrss``, KiB)."""


def _tensors(s: dict) -> list:
    """(name, shape) of every tensor of the Llama directory, in writing order."""
    h, d = s["hidden"], s["hidden"] // s["heads"]
    out = [("model.embed_tokens.weight", (s["vocab"], h))]
    for i in range(s["layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (s["groups"] * d, h)),
            (p + "self_attn.v_proj.weight", (s["groups"] * d, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (s["ffn"], h)),
            (p + "mlp.up_proj.weight", (s["ffn"], h)),
            (p + "mlp.down_proj.weight", (h, s["ffn"])),
        ]
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (s["vocab"], h))]


def build(path: Path, s: dict, shard_gb: float) -> tuple:
    """Write the synthetic directory; returns (parameters, largest tensor's bytes)."""
    import torch
    import transformers

    from orchestrator.runtime.rank.hf_files import ShardWriter

    path.mkdir(parents=True)
    transformers.LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["ffn"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["groups"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        torch_dtype="float32",
    ).save_pretrained(path)
    plan = [(n, shape, torch.float32) for n, shape in _tensors(s)]
    writer = ShardWriter(str(path), plan, int(shard_gb * 10**9))
    gen = torch.Generator().manual_seed(0)
    for name, shape, _ in plan:  # one tensor in memory at a time
        t = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
        writer.add(name, t)
    writer.close()
    numels = [torch.Size(shape).numel() for _, shape, _ in plan]
    return sum(numels), 4 * max(numels)


def _measured(cmd: list, env: dict, log: Path) -> dict:
    with open(log, "w") as out:
        proc = subprocess.run(
            [sys.executable, "-c", WRAP, *cmd], cwd=REPO, env=env, stdout=out, stderr=subprocess.PIPE, text=True
        )
    lines = proc.stderr.strip().splitlines()
    with open(log, "a") as out:
        out.write("\n".join(lines[:-1]))
    result = json.loads(lines[-1])
    if result["rc"] != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed ({result['rc']}); see {log}:\n{log.read_text()[-3000:]}")
    return result


def _same(a: Path, b: Path) -> tuple:
    """(tensors bitwise equal, tensors) between two directories, one tensor in memory at a time."""
    import torch
    from safetensors import safe_open

    from orchestrator.ckpt.hf_dir import weight_map

    fa, fb = weight_map(str(a)), weight_map(str(b))
    equal = 0
    for name in sorted(fa):
        if name in fb:
            with safe_open(fa[name], "pt") as x, safe_open(fb[name], "pt") as y:
                equal += torch.equal(x.get_tensor(name), y.get_tensor(name))
    return equal, len(fa)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temporary one, removed after)")
    parser.add_argument("--shard-gb", type=float, default=2.0, help="the source directory's shard size, GB")
    args = parser.parse_args()
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hf_convert_"))
    env = dict(os.environ, ORCHESTRATOR_CACHE=str(root / "cache"), PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    try:
        t0 = time.perf_counter()
        params, largest = build(root / "source", SHAPE, args.shard_gb)
        target = 1.5 * largest + GIB
        shards = len(list((root / "source").glob("*.safetensors")))
        print(f"synthetic Llama ({', '.join(f'{k} {v}' for k, v in SHAPE.items())}, untied, fp32):")
        print(
            f"  {params / 1e9:.3f} B parameters, {4 * params / GIB:.2f} GiB in {shards} shard(s), written in "
            f"{time.perf_counter() - t0:.0f} s; largest tensor {largest / GIB:.3f} GiB"
        )
        print(f"target: peak <= 1.5 x {largest / GIB:.3f} GiB + 1 GiB = {target / GIB:.2f} GiB", flush=True)
        orch = [sys.executable, "-m", "orchestrator"]
        conf = root / "conf"
        from_hf = [*orch, "convert", "from-hf", str(root / "source"), "--name", "synth", "--out", str(conf)]
        _measured([*from_hf, "--seq-length", "128"], env, root / "from_hf.log")
        job = ["--config-dir", str(conf), "+experiment=synth", "parallelism=none", "training.train_iters=0"]
        job += ["checkpoint.hf_verify=false", "training.eval_iters=0", "logging.tensorboard=false"]
        job += ["data.stdlib_max_mb=2", f"run.root={root}", "run.name=imported"]
        imp = _measured([*orch, *job], env, root / "import.log")
        said = "".join(p.read_text() for p in (root / "imported" / "submitit").glob("*_log.out"))
        m = re.search(
            r"initialised from Hugging Face \S+ in (\S+) s.*?resident before the load, its peak "
            r"(at most )?(\S+) GiB \(\+(\S+) GiB",
            said,
        )
        summary = [json.loads(x) for x in (root / "imported" / "metrics.jsonl").read_text().splitlines()]
        peak_mb = max(max(r["peak_rss_mb_per_rank"]) for r in summary if r.get("event") == "summary")
        extra = float(m.group(4)) * GIB
        print(
            f"import (one CPU rank, train_iters=0, hf_verify=false): job {imp['wall_s']:.0f} s wall, load "
            f"{float(m.group(1)):.1f} s"
        )
        print(
            f"  the load's memory beyond the model: +{extra / GIB:.2f} GiB (rank's peak {m.group(2) or ''}"
            f"{m.group(3)} GiB during it) -> {'meets' if extra <= target else 'MISSES'} the target"
        )
        print(
            f"  the rank's peak over the whole job {peak_mb / 1024:.2f} GiB; the model's own weights "
            f"{4 * params / GIB:.2f} GiB (fp32; its gradient buffer and optimizer come on top)"
        )
        out = root / "exported"
        exp = _measured([*orch, "convert", "to-hf", str(root / "imported"), str(out)], env, root / "export.log")
        print(
            f"export (convert to-hf): {exp['wall_s']:.0f} s wall, peak RSS {exp['peak_rss'] / GIB:.2f} GiB -> "
            f"{'meets' if exp['peak_rss'] <= target else 'MISSES'} the target; "
            f"{len(list(out.glob('*.safetensors')))} shard(s)"
        )
        equal, total = _same(root / "source", out)
        print(f"round trip: {equal} of {total} tensors bitwise equal to the source")
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
