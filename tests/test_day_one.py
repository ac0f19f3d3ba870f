"""Issue 31, items 4 and 5: what a Megatron-LM user hits on day one.

* ``convert from-megatron`` on the shape of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh
  (tests/fixtures/megatron/gpt3_175b_positional.sh): every undefined variable named in one error with
  the one command that defines them; given them, it converts in one run and its printed next command
  exits 0 (the data files not here are a warning); mock data needs no vocabulary file; every "not
  converted" has a reason; no derived key among the defaults written out.
* The plan: "tight" with suggestions above ``plan_headroom`` (0.85), "fits" only below; a no-op VPP key
  is said; no distributed optimizer suggested at DP 1; the vocabulary's source is printed.
* Hydra habits: ``hydra/launcher=`` says how sweeps run here; hints print ``+experiment=``; ``status`` with
  no runs says so (exit 0); the sweep's own progress replaces Hydra's ``[HYDRA] Launching`` lines.

Pure Python: the planner in-process, the CLI cases in one interpreter (``run_batch``), no training.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

from conftest import REPO
from test_cli import assert_one_error_line, run_batch

EXAMPLE = REPO / "tests" / "fixtures" / "megatron" / "gpt3_175b_positional.sh"


def _convert(tmp_path: Path, *args: str):
    from orchestrator.convert.cli import main

    return main(["from-megatron", str(EXAMPLE), "--out", str(tmp_path / "conf"), "--name", "g175", *args])


def _given(tmp_path: Path) -> list:
    return [
        "--var",
        f"1={tmp_path / 'ckpt' / 'g175'}",
        "--var",
        "3=/data/gpt2-vocab.json",
        "--var",
        "4=/data/gpt2-merges.txt",
        "--var",
        "5=/data/my_text_document",
        "--var",
        "NUM_NODES=16",
        "--gpu",
        "A100-80GB",
    ]


def test_every_undefined_variable_is_named_in_one_error_with_the_command_that_defines_them(tmp_path, capsys):
    assert _convert(tmp_path, "--gpu", "A100-80GB") == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: --var: ")
    for said in (
        "$1 (CHECKPOINT_PATH: --save, --load)",
        "$3 (VOCAB_FILE: --vocab-file)",
        "$4 (MERGE_FILE: --merge-file)",
        "$5 (DATA_PATH: --data-path)",
    ):
        assert said in err, err
    assert "$2" not in err  # --tensorboard-dir's value is never read: events go to <run dir>/tensorboard
    fix = err.split("; fix: ", 1)[1].strip()
    assert fix.endswith(
        "--gpu A100-80GB --var '1=<CHECKPOINT_PATH>' --var '3=<VOCAB_FILE>' "
        "--var '4=<MERGE_FILE>' --var '5=<DATA_PATH>'"
    ), fix
    assert not (tmp_path / "conf").exists()  # nothing written


def test_the_175b_example_converts_in_one_run_and_its_next_command_exits_0(tmp_path, capsys):
    code = _convert(tmp_path, *_given(tmp_path))  # in-process; then the printed next command through the CLI
    out, err = capsys.readouterr()
    assert code == 0, err + out[-3000:]
    nxt = shlex.split(re.search(r"^next: python -m orchestrator (.*?)(   \(|$)", out, re.M).group(1))
    assert nxt[-2:] == ["+experiment=g175", "plan=true"], nxt
    local = nxt + ["model.transformer_impl=local"]  # megatron-core's unfused attention: the a*s^2 scores stored
    planned, unfused, roomy = run_batch([nxt, local, local + ["plan_headroom=1.0"]], tmp_path)
    assert planned["code"] == 0, planned["stderr"] + planned["stdout"][-2000:]
    assert (
        "warning: data.paths[0]='/data/my_text_document': /data/my_text_document.bin and .idx not found"
        in planned["stdout"]
    )  # a warning, as convert's own plan says it
    assert f"would start fresh: no checkpoint in {tmp_path / 'ckpt' / 'g175' / 'checkpoints'}" in planned["stdout"]
    for text in (out, planned["stdout"]):  # the script's default layer spec: Transformer Engine, flash attention
        verdict = re.search(r"^verdict: (.*)$", text, re.M).group(1)
        assert verdict.startswith("fits: stage 0 needs 56.5 GiB <= 80.0 GiB on A100-80GB (71%)"), verdict
        assert "attention: flash/fused (Transformer Engine's TEDotProductAttention" in text, text[-3000:]
    verdict = re.search(r"^verdict: (.*)$", unfused["stdout"], re.M).group(1)
    assert verdict.startswith(
        "tight: stage 0 needs 79.2 GiB of 80.0 GiB on A100-80GB (99%), above plan_headroom=0.85 (68.0 GiB"
    ), verdict
    rows = re.findall(r"^  #\d+: (.*)$", unfused["stdout"], re.M)
    assert rows and "suggestions (fastest first; each fits within plan_headroom)" in unfused["stdout"]
    assert re.search(r"^verdict: fits: stage 0 needs 79.2 GiB <= 80.0 GiB", roomy["stdout"], re.M)
    # no contradictory defaults: the derived warm-up is not also "written out" at Megatron-LM's 0
    assert "optimizer.lr_warmup_iters = lr_warmup_fraction x lr_decay_iters = 0.001 x 430000 = 430" in out
    defaults = re.search(r"^Megatron-LM defaults written out.*\n  (.*)$", out, re.M).group(1)
    assert "--lr-warmup-iters" not in defaults and "--adam-eps 1e-08" in defaults
    # every "not converted" line has its reason after the flag
    lines = re.search(r"^not converted[^\n]*:\n((?:  .*\n)*)", out, re.M).group(1).splitlines()
    # (--rampup-batch-size 16 16 5859375 maps to training.rampup_batch_size since the ramp landed)
    assert len(lines) == 2 and all(re.match(r"  \S.*?: \w.{20,}", line) for line in lines), lines
    assert (
        "vocab 50257 -> padded 51200 (multiple of 128 x TP 8); from data.vocab_size=50257 "
        "(data.tokenizer=GPT2BPETokenizer's files are not on this machine)" in planned["stdout"]
    )


def test_mock_data_needs_no_vocabulary_file_and_unknown_flags_say_why(tmp_path, capsys):
    script = tmp_path / "mock.sh"
    script.write_text(
        "VOCAB_FILE=$1\nMERGE_FILE=$2\n"
        "torchrun --nproc_per_node 2 pretrain_gpt.py --num-layers 2 --hidden-size 64 "
        "--num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 "
        "--global-batch-size 4 --train-iters 3 --lr 1e-3 --mock-data --vocab-file $VOCAB_FILE "
        "--merge-file $MERGE_FILE --step-batch-size-schedule '0:2 100:4' --frobnicate-level 3 "
        "--num-layers-per-virtual-pipeline-stage 2\n"
    )
    from orchestrator.convert.cli import main

    code = main(["from-megatron", str(script), "--out", str(tmp_path / "conf")])
    out, err = capsys.readouterr()
    assert code == 0, err + out[-3000:]
    written = (tmp_path / "conf" / "experiment" / "mock.yaml").read_text()
    assert "tokenizer: 'NullTokenizer'" in written and "vocab_size: 50257" in written
    assert "vocab_file" not in written and "merge_file" not in written
    assert "vocab 50257 -> padded 50304" in out
    lines = re.search(r"^not converted[^\n]*:\n((?:  .*\n)*)", out, re.M).group(1)
    assert (
        "--vocab-file $1 [run time: $1 (unknown here)]: mock data reads no text; the vocabulary is GPT-2 BPE's 50257"
        in lines
    )
    assert "--step-batch-size-schedule 0:2 100:4: no arbitrary batch-size schedule here" in lines
    assert "--frobnicate-level 3: not a flag this converter knows" in lines
    flagged = re.search(r"^flagged[^\n]*:\n((?:  .*\n)*)", out, re.M).group(1)
    assert "--num-layers-per-virtual-pipeline-stage 2: VPP = 1, one model chunk per rank" in flagged


def test_plan_says_a_no_op_vpp_its_vocabulary_and_never_suggests_a_distributed_optimizer_at_dp_1():
    from orchestrator.config.compose import compose_config
    from orchestrator.plan import memory as planner
    from orchestrator.plan import suggest
    from orchestrator.plan.report import format_plan

    cfg = compose_config(["parallelism=pp2_dp2", "parallelism.num_layers_per_virtual_pipeline_stage=2"])
    notes = planner.plan(cfg).notes
    assert (
        "parallelism.num_layers_per_virtual_pipeline_stage=2 leaves VPP = num_layers / (PP x 2) = 4 / (2 x 2) "
        "= 1: one model chunk per rank, no interleaving (a no-op; fix: one of [1] for VPP > 1, or null)"
    ) in notes
    big = compose_config(
        [
            "model=gpt_6.7b",
            "cluster=slurm_a100_4x8",
            "training.precision=bf16",
            "gpu=A100-40GB",
            "cluster.nodes=1",
            "cluster.gpus_per_node=4",
            "cluster.tasks_per_node=4",
            "parallelism.data_parallel_size=null",
            "training.micro_batch_size=1",
            "training.global_batch_size=64",
        ]
    )
    text = format_plan(planner.plan(big))
    assert (
        "vocab 258 -> padded 384 (multiple of 128 x TP 1); from data.tokenizer=byte of data=stdlib: 256 byte "
        "ids + eod + pad, not a model's tokenizer"
    ) in text
    found = suggest.suggest(big, limit=50, always=True)
    assert found and all(s.plan.layout.data_parallel_size > 1 for s in found if s.plan.recipe.use_distributed_optimizer)
    assert any(s.plan.layout.data_parallel_size == 1 for s in found)  # DP 1 layouts are offered, without it
    tiny = dataclasses.replace(compose_config([]), gpu="A100-80GB")  # gpt_tiny: 2.0 GiB of the A100-80GB preset (3%)
    tight = planner.plan(dataclasses.replace(tiny, plan_headroom=0.02))
    assert tight.fits and tight.tight and tight.reason.startswith("tight: stage 0 needs 2.0 GiB of 80.0 GiB")
    assert planner.plan(tiny).reason.startswith("fits: ")  # the default 0.85


def test_hydra_habits_get_the_override_that_works_and_the_sweep_says_its_own_progress(tmp_path):
    (tmp_path / "empty").mkdir()
    launcher, local, typo, status, missing, sweep = run_batch(
        [
            ["-m", "+experiment=gpt_pp2_dp2", "hydra/launcher=submitit_slurm", "training.micro_batch_size=1,2"],
            ["+experiment=gpt_pp2_dp2", "hydra/launcher=submitit_local"],
            ["+experiment=gpt_pp2", "plan=true"],
            ["status", "runs"],
            ["status", str(tmp_path / "nonexistent")],
            [
                "-m",
                "+experiment=gpt_pp2_dp2",
                "training.micro_batch_size=1,2",
                "plan=true",
                f"run.root={tmp_path}/runs",
            ],
        ],
        tmp_path,
    )
    assert_one_error_line(
        launcher,
        "hydra/launcher=submitit_slurm: Hydra's launcher plugins are not used here",
        "cluster=slurm",
        "fix: python -m orchestrator -m +experiment=gpt_pp2_dp2 training.micro_batch_size=1,2 cluster=slurm",
    )
    assert_one_error_line(
        local, "hydra/launcher=submitit_local: drop it: local is the default", "fix: python -m orchestrator "
    )
    assert_one_error_line(typo, "did you mean +experiment=gpt_pp2_dp2?")
    assert status["code"] == 0 and status["stdout"].startswith("no runs under runs: no such directory yet")
    assert_one_error_line(missing, f"runs_root={tmp_path / 'nonexistent'}: no such directory")
    assert sweep["code"] == 0, sweep["stderr"] + sweep["stdout"][-2000:]
    said = sweep["stdout"]
    assert "[sweep] 2 points (training.micro_batch_size=1,2), one after another on this machine" in said
    assert "[sweep] point 1 (2 of 2): +experiment=gpt_pp2_dp2 training.micro_batch_size=2" in said
    assert "HYDRA" not in said + sweep["stderr"] and "Launching" not in said
