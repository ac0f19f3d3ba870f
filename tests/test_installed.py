"""From an installed wheel, in an empty directory, as a Megatron-LM user meets it on day one.

The wheel is built from this checkout and installed into a venv that reuses this interpreter's
packages (torch, megatron-core); nothing on ``PYTHONPATH``, so the installed package is what runs.
Then: convert a Megatron-LM launch script (it goes to ``./conf/experiment/``), plan it with
``+experiment=<name>`` and nothing else, see its GPU job refused by validate in one line (this
machine has no GPU) with the fix, and train it with that fix — the one thing the script could not
say. And a Megatron-LM user's own data: GPT-2 BPE vocab/merges with ``.bin/.idx`` datasets written by
megatron-core's ``IndexedDatasetBuilder`` train a gpt_pp2_dp2 run with the padded 50304 vocabulary
(rank 0's parameters equal the plan's), and a dataset holding an id beyond the vocabulary is refused
in one line before anything is queued or written.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import GPT2_EOD, REPO, gpt2_args, make_gpt2_assets

SCRIPT = """#!/bin/bash
# A small Megatron-LM GPT run: PP=2 on 2 GPUs of one node, synthetic data.
torchrun --nproc_per_node 2 --nnodes 1 pretrain_gpt.py \\
    --pipeline-model-parallel-size 2 \\
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
    --seq-length 64 --max-position-embeddings 64 \\
    --micro-batch-size 2 --global-batch-size 4 \\
    --train-iters 3 --lr 1e-3 --log-interval 1 --eval-iters 0 \\
    --tokenizer-type NullTokenizer --vocab-size 256 --mock-data
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """``bin/`` of a venv holding the wheel built from a copy of this checkout (never its build/)."""
    root = tmp_path_factory.mktemp("installed")
    source = root / "source"
    shutil.copytree(
        REPO,
        source,
        symlinks=True,
        ignore=shutil.ignore_patterns(
            ".git", "build", "*.egg-info", "runs", "tests", "__pycache__", ".pytest_cache", "wheels", ".venv", "*.whl"
        ),
    )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "wheel"), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    wheel = next((root / "wheel").glob("orchestrator-*.whl"))
    subprocess.run(
        [*pip, "--python", str(venv / "bin" / "python"), "install", "--no-deps", "--no-compile", str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return venv / "bin"


def _orchestrator(bin_dir: Path, args, cwd: Path, cache: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(ORCHESTRATOR_CACHE=str(cache), PYTHONUNBUFFERED="1")
    return subprocess.run(
        [str(bin_dir / "orchestrator"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow
def test_convert_plan_train_from_an_installed_wheel(installed, tmp_path, cache_dir):
    where = subprocess.run(
        [str(installed / "python"), "-c", "import orchestrator; print(orchestrator.__file__)"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"]},
    )
    assert str(installed.parent) in where.stdout, where  # the wheel runs, not this checkout
    (tmp_path / "train_gpt.sh").write_text(SCRIPT)

    convert = _orchestrator(installed, ["convert", "from-megatron", "train_gpt.sh"], tmp_path, cache_dir)
    assert convert.returncode == 0, convert.stdout[-3000:] + convert.stderr
    assert convert.stdout.startswith("wrote conf/experiment/train_gpt.yaml")
    assert "warning: to run it here: cluster.gpus_per_node=2: " in convert.stdout
    assert "next: python -m orchestrator +experiment=train_gpt plan=true" in convert.stdout

    plan = _orchestrator(installed, ["+experiment=train_gpt", "plan=true"], tmp_path, cache_dir)
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr
    first = plan.stdout.splitlines()[:2]  # composing ..., then the user's config directories
    assert first[0].startswith("[orchestrator] composing +experiment=train_gpt plan=true"), first
    assert first[1] == f"[orchestrator] configs: {tmp_path / 'conf'}, ahead of the shipped conf/"
    assert "world size 2 = TP 1 x PP 2 x CP 1 x DP 1" in plan.stdout

    from orchestrator.config.machine import local_gpu_count

    refused = _orchestrator(installed, ["+experiment=train_gpt"], tmp_path, cache_dir)
    if local_gpu_count() == 0:
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert (
            refused.stderr.startswith(
                "error: cluster.gpus_per_node=2: cluster=local runs the job on this machine, which has no GPU"
            )
            and "fix: training.device=cpu " in refused.stderr
        )
    assert not (tmp_path / "runs").exists()  # refused before anything was created

    trained = _orchestrator(installed, ["+experiment=train_gpt", "training.device=cpu"], tmp_path, cache_dir, 400)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    assert "completed: iteration 3 | lm loss" in trained.stdout
    assert (tmp_path / "runs" / "train_gpt" / "config.yaml").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conf", "runs", "train_gpt.sh"]


@pytest.mark.slow
def test_gpt2_bpe_and_indexed_data_train_from_the_installed_wheel(installed, tmp_path_factory, tmp_path):
    from orchestrator.config.compose import compose_config
    from orchestrator.plan.memory import plan

    gpt2 = make_gpt2_assets(tmp_path_factory.mktemp("gpt2"))
    cache = tmp_path_factory.mktemp("gpt2-cache") / "cache"
    refused = _orchestrator(installed, gpt2_args(gpt2, gpt2[4]) + ["+experiment=gpt_pp2_dp2"], tmp_path, cache)
    assert refused.returncode == 2, refused.stdout[-3000:] + refused.stderr
    assert refused.stderr.strip() == (
        f"error: data.paths[0]={gpt2[4]}: largest token id 50304 (uint16) does not fit the vocabulary of "
        "data.tokenizer=GPT2BPETokenizer (50257 ids); fix: the tokenizer that made this data (e.g. "
        "data.tokenizer=GPT2BPETokenizer data.vocab_file=... data.merge_file=...), or "
        "data.tokenizer=NullTokenizer data.vocab_size=50305"
    )
    assert list(tmp_path.iterdir()) == [] and not cache.exists()  # nothing queued, nothing written

    args = gpt2_args(gpt2, gpt2[3]) + [
        "+experiment=gpt_pp2_dp2",
        "training.train_iters=2",
        "training.eval_iters=0",
        "checkpoint.save_interval=null",
    ]
    trained = _orchestrator(installed, args, tmp_path, cache, timeout=600)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    params = int(re.search(r"params on rank 0: ([\d,]+)", trained.stdout).group(1).replace(",", ""))
    planned = plan(compose_config(args))
    assert planned.padded_vocab_size == 50304 and params == planned.params_per_stage[0] == 6_851_840
    manifest = json.loads(next((tmp_path / "runs" / "gpt_pp2_dp2-data=indexed").rglob("manifest.json")).read_text())
    assert manifest["model"]["padded_vocab_size"] == 50304 and manifest["tokenizer"]["eod"] == GPT2_EOD
    assert "completed: iteration 2 | lm loss" in trained.stdout
