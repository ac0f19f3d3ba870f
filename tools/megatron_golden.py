"""Write the golden megatron configs: Megatron-LM's own, for the flags ``convert to-megatron`` prints.

    python tools/megatron_golden.py --megatron-lm /tmp/megatron-lm [--python /opt/mcore-0.19.2/bin/python]

For each experiment of :data:`EXPERIMENTS` it composes our config, takes the ``pretrain_gpt.py`` flags,
world size and ``export`` lines of ``convert to-megatron`` (orchestrator/convert/from_config.py), runs
``tools/megatron_lm_config.py`` under ``--python`` with the Megatron-LM checkout first on PYTHONPATH
(its ``megatron/core`` too, not the installed one) and writes ``tests/golden/megatron/<name>.json``:
the overrides, flags, world size, environment, the checkout's commit and megatron-core version, the
padded vocabulary and eod of the tokenizer Megatron-LM builds, and every field of ``transformer``,
``ddp`` and ``optimizer``. ``tests/test_megatron_config.py`` compares our builder with these files
(no network, no Megatron-LM checkout needed there).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "golden" / "megatron"

LLAMA_8B = [
    "model=gpt_6.7b",
    "model.num_query_groups=8",
    "model.ffn_hidden_size=14336",
    "model.activation=swiglu",
    "model.normalization=RMSNorm",
    "model.position_embedding_type=rope",
    "model.add_bias_linear=false",
    "model.untie_embeddings_and_output_weights=true",
    "model.seq_length=8192",
    "model.max_position_embeddings=8192",
    "data=mock",
    "data.tokenizer=NullTokenizer",
    "data.vocab_size=128256",
]
"""A Llama-3-8B shape written inline (32 layers, hidden 4096, 32 heads in 8 groups, SwiGLU 14336, RMSNorm,
RoPE, no biases, untied embeddings, 128,256 ids)."""

LLAMA_8B_TP2_DISTOPT = [
    *LLAMA_8B,
    "parallelism=none",
    "parallelism.tensor_model_parallel_size=2",
    "parallelism.sequence_parallel=true",
    "parallelism.data_parallel_size=null",
    "cluster=slurm_a100_4x8",
    "training.precision=bf16",
    "training.micro_batch_size=1",
    "training.global_batch_size=128",
    "optimizer.use_distributed_optimizer=true",
]
"""The Llama-style 8B at TP2 (sequence parallel) with the distributed optimizer on 4 x 8 A100 (DP16)."""

EXPERIMENTS = {
    "gpt_125m_1gpu_bf16": [
        "model=gpt_125m",
        "parallelism=none",
        "data=mock",
        "cluster=local",
        "cluster.gpus_per_node=1",
        "training.device=cuda",
        "training.precision=bf16",
        "training.micro_batch_size=4",
        "training.global_batch_size=32",
    ],
    "gpt_6.7b_pp2_vpp2_dp16_a100_4x8": [
        "model=gpt_6.7b",
        "parallelism=pp2_vpp2_dp2",
        "parallelism.data_parallel_size=null",
        "cluster=slurm_a100_4x8",
        "training.precision=bf16",
        "training.micro_batch_size=4",
        "training.global_batch_size=256",
    ],
    "llama_8b_tp2_distopt_a100_4x8": LLAMA_8B_TP2_DISTOPT,
    "llama_8b_tp2_fp8_hybrid_4x8": [
        *LLAMA_8B_TP2_DISTOPT,
        "training.fp8=hybrid",
        "training.fp8_amax_history_len=1024",
        "training.fp8_amax_compute_algo=max",
    ],
}
"""The experiments of issue 27: gpt_125m on 1 GPU in bf16; the seed's 6.7B PP2 x DP16 interleaved on
4 x 8 A100; a Llama-style 8B, TP2 (sequence parallel) with the distributed optimizer, DP16. Issue 37: that
8B with FP8 (hybrid, delayed scaling, the amax history of Megatron-LM's examples/llama script: 1024, max) on
the same 4 x 8 nodes (FP8 needs H100s; Megatron-LM's parser reads the GPU's architecture only for the
TP/CP connection rule, so the node file's A100 shape gives the same config)."""


def launch(overrides):
    """(flags, world size, exported environment) of ``convert to-megatron`` for ``overrides``."""
    from orchestrator.convert.cli import check
    from orchestrator.convert.experiment_file import compose
    from orchestrator.convert.from_config import export, flags

    cfg = compose(list(overrides))
    layout, _ = check(cfg)
    script = export(cfg, list(overrides), layout.world_size)
    env = dict(line[len("export ") :].split("=", 1) for line in script.splitlines() if line.startswith("export "))
    env = {k: shlex.split(v)[0] if v else "" for k, v in env.items()}
    return [w for group in flags(cfg) for w in group], layout.world_size, env


def commit_of(checkout: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (subprocess.CalledProcessError, OSError):
        return (checkout / "COMMIT").read_text().strip() if (checkout / "COMMIT").is_file() else "unknown"


def golden(name, overrides, checkout: Path, python: str, commit: str) -> dict:
    """Run Megatron-LM's parser and config construction for one experiment; the golden record."""
    words, world, env = launch(overrides)
    with tempfile.TemporaryDirectory(prefix="megatron-golden-") as tmp:
        out = Path(tmp) / "config.json"
        cmd = [
            python,
            str(REPO / "tools" / "megatron_lm_config.py"),
            "--world-size",
            str(world),
            "--out",
            str(out),
            *[f"--env={k}={v}" for k, v in env.items()],
            "--",
            *words,
        ]
        run_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(REPO)])}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env)
        if proc.returncode != 0:
            raise SystemExit(f"{name}: Megatron-LM refused or failed:\n{proc.stderr[-3000:]}")
        fields = json.loads(out.read_text())
    return {
        "experiment": name,
        "overrides": list(overrides),
        "world_size": world,
        "env": env,
        "flags": words,
        "megatron_lm": {"commit": commit, "megatron_core": fields.pop("megatron_core")},
        **fields,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", required=True, type=Path, help="a Megatron-LM checkout")
    parser.add_argument("--python", default=sys.executable, help="the Python to run Megatron-LM's code with")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", action="append", help="experiment names (default: all)")
    a = parser.parse_args(argv)
    commit = commit_of(a.megatron_lm)
    a.out.mkdir(parents=True, exist_ok=True)
    for name, overrides in EXPERIMENTS.items():
        if a.only and name not in a.only:
            continue
        record = golden(name, overrides, a.megatron_lm, a.python, commit)
        path = a.out / f"{name}.json"
        path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(
            f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: Megatron-LM {commit[:7]} "
            f"(megatron-core {record['megatron_lm']['megatron_core']}), "
            + ", ".join(f"{s} {len(record[s])} fields" for s in ("transformer", "ddp", "optimizer"))
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
