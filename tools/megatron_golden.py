"""Write the golden megatron configs: Megatron-LM's own, for the flags ``convert to-megatron`` prints.

    python tools/megatron_golden.py --megatron-lm /tmp/megatron-lm [--python /opt/mcore-0.19.2/bin/python]

For each experiment of :data:`EXPERIMENTS` it composes our config, takes the ``pretrain_gpt.py`` flags,
world size and ``export`` lines of ``convert to-megatron`` (orchestrator/convert/from_config.py), runs
``tools/megatron_lm_config.py`` under ``--python`` with the Megatron-LM checkout first on PYTHONPATH
(its ``megatron/core`` too, not the installed one) and writes ``tests/golden/megatron/<name>.json``:
the overrides, flags, world size, environment, the checkout's commit and megatron-core version, the
padded vocabulary and eod of the tokenizer Megatron-LM builds, every field of ``transformer``,
``ddp`` and ``optimizer``, and where Megatron-LM carries the batch and its ramp: ``batch`` (the validated args),
``scheduler`` (its ``get_optimizer_param_scheduler``'s fields and LR / WD at a few steps) and ``microbatches``
(its num-microbatches calculator at :func:`probes`). For an experiment with ``training.rampup_batch_size`` the
child runs twice: the flags as exported, and with ``--rampup-batch-size`` and ``--global-batch-size`` replaced by
the ``--step-batch-size-schedule`` the export's comment gives for Megatron-LM on megatron-core 0.19+ (which ignores
``--rampup-batch-size``): that run's ``batch`` and ``microbatches`` are the record's ``step_schedule``.
``tests/test_megatron_config.py`` compares our builder, LR scheduler and batch ramp with these files (no network,
no Megatron-LM checkout needed there).
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
    "gpt_125m_rampup_dp8": [
        "model=gpt_125m",
        "parallelism=none",
        "parallelism.data_parallel_size=8",
        "data=mock",
        "cluster=local",
        "cluster.gpus_per_node=8",
        "training.device=cuda",
        "training.precision=bf16",
        "training.micro_batch_size=2",
        "training.global_batch_size=64",
        "training.rampup_batch_size=[16,16,1000]",
        "training.train_iters=40",
    ],
}
"""The experiments of issue 27: gpt_125m on 1 GPU in bf16; the seed's 6.7B PP2 x DP16 interleaved on
4 x 8 A100; a Llama-style 8B, TP2 (sequence parallel) with the distributed optimizer, DP16. Issue 37: that
8B with FP8 (hybrid, delayed scaling, the amax history of Megatron-LM's examples/llama script: 1024, max) on
the same 4 x 8 nodes (FP8 needs H100s; Megatron-LM's parser reads the GPU's architecture only for the
TP/CP connection rule, so the node file's A100 shape gives the same config); gpt_125m on 8 GPUs (DP8, MBS 2) with
the batch ramped 16 -> 64 in 3 steps over 1000 samples (333.3 each: megatron-core 0.16.1's float division) for 40
iterations, exported with ``--train-samples`` / ``--lr-warmup-samples`` / ``--lr-decay-samples``."""


def launch(overrides):
    """(flags, world size, exported environment, the step schedule its comment gives or None, the config) of
    ``convert to-megatron`` for ``overrides``."""
    from orchestrator.convert.cli import check
    from orchestrator.convert.experiment_file import compose
    from orchestrator.convert.from_config import export, flags

    cfg = compose(list(overrides))
    layout, _ = check(cfg)
    script = export(cfg, list(overrides), layout.world_size)
    env = dict(line[len("export ") :].split("=", 1) for line in script.splitlines() if line.startswith("export "))
    env = {k: shlex.split(v)[0] if v else "" for k, v in env.items()}
    schedule = re.search(r"--step-batch-size-schedule '([^']*)'", script)
    return (
        [w for group in flags(cfg) for w in group],
        layout.world_size,
        env,
        schedule.group(1) if schedule else None,
        cfg,
    )


def probes(training) -> list:
    """Consumed-sample counts to ask the calculators at: 0 and the full batch's, and with a ramp
    ``[start, increment, samples]`` (``n`` steps) each step's edge ``floor(k x samples / n)`` and its neighbours,
    ``samples + 1`` (megatron-core 0.16.1: the full batch once consumed > samples) and the end of the ramp's run."""
    from orchestrator.config.ramp import samples_after

    t = training
    counts = {0, t.global_batch_size}
    if t.rampup_batch_size is not None:
        start, inc, samples = t.rampup_batch_size
        n = (t.global_batch_size - start) // inc
        counts |= {k * samples // n + d for k in range(1, n + 1) for d in (-1, 0, 1)} | {samples + 1}
        counts.add(samples_after(t.rampup_batch_size, t.global_batch_size, t.train_iters))
    return sorted(counts)


def without_ramp(words, schedule) -> list:
    """``words`` with ``--rampup-batch-size S I N`` and ``--global-batch-size G`` replaced by
    ``--step-batch-size-schedule SCHEDULE`` (Megatron-LM refuses it beside ``--global-batch-size``)."""
    out, i = [], 0
    while i < len(words):
        skip = {"--rampup-batch-size": 4, "--global-batch-size": 2}.get(words[i], 0)
        out, i = (out, i + skip) if skip else (out + [words[i]], i + 1)
    return out + ["--step-batch-size-schedule", schedule]


def child(name, words, world, env, counts, checkout: Path, python: str) -> dict:
    """tools/megatron_lm_config.py's record for one command line (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="megatron-golden-") as tmp:
        out = Path(tmp) / "config.json"
        cmd = [
            python,
            str(REPO / "tools" / "megatron_lm_config.py"),
            "--world-size",
            str(world),
            "--out",
            str(out),
            "--probe-samples",
            ",".join(map(str, counts)),
            *[f"--env={k}={v}" for k, v in env.items()],
            "--",
            *words,
        ]
        run_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), str(REPO)])}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=run_env)
        if proc.returncode != 0:
            raise SystemExit(f"{name}: Megatron-LM refused or failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def commit_of(checkout: Path) -> str:
    try:
        return subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (subprocess.CalledProcessError, OSError):
        return (checkout / "COMMIT").read_text().strip() if (checkout / "COMMIT").is_file() else "unknown"


def golden(name, overrides, checkout: Path, python: str, commit: str) -> dict:
    """Run Megatron-LM's parser and config construction for one experiment; the golden record."""
    words, world, env, schedule, cfg = launch(overrides)
    counts = probes(cfg.training)
    fields = child(name, words, world, env, counts, checkout, python)
    record = {
        "experiment": name,
        "overrides": list(overrides),
        "world_size": world,
        "env": env,
        "flags": words,
        "megatron_lm": {"commit": commit, "megatron_core": fields.pop("megatron_core")},
        **fields,
    }
    if schedule is not None:
        replaced = child(name, without_ramp(words, schedule), world, env, counts, checkout, python)
        record["step_schedule"] = {
            "flags": ["--step-batch-size-schedule", schedule],
            "batch": replaced["batch"],
            "microbatches": replaced["microbatches"],
        }
    return record


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
            + ", ".join(
                f"{s} {len(record[s])} fields" for s in ("transformer", "ddp", "optimizer", "batch", "scheduler")
            )
            + (", and its step schedule" if "step_schedule" in record else "")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
