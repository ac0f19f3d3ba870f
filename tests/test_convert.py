"""Issue 13: Megatron-LM launches <-> orchestrator experiments (``python -m orchestrator.convert``).

The seed article's four commands and its YAML files (tests/fixtures/megatron/seed_*), a multi-node
script with the flag list of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh
(gpt_multinode.sh, our own values), and the round trip from-megatron(to-megatron(cfg)) == cfg.
Pure Python: one subprocess checks that neither direction imports torch.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

FIX = REPO / "tests" / "fixtures" / "megatron"
SEED_GPUS = ["--nodes", "4", "--gpus-per-node", "8"]  # seed 000: 4 nodes x 8 A100-40GB = 32 GPUs


def from_megatron(capsys, tmp_path, fixture, *extra):
    """Run ``from-megatron`` in-process: (exit code, stdout, stderr, written file text)."""
    from orchestrator.convert.cli import main

    name = Path(fixture).stem
    code = main(["from-megatron", str(FIX / fixture), "--out", str(tmp_path), "--name", name, *extra])
    out, err = capsys.readouterr()
    written = tmp_path / "experiment" / f"{name}.yaml"
    return code, out, err, written.read_text() if written.exists() else ""


def section(text: str, title: str) -> str:
    """The lines of one findings section of the screen output."""
    m = re.search(rf"^{re.escape(title)}[^\n]*:\n((?:  .*\n?)*)", text, re.M)
    return m.group(1) if m else ""


# ---- the seed article -----------------------------------------------------------------------


def test_seed_first_run_with_1f1b_flags_plans_pp4_dp8_vpp2_and_flags_the_split_rank(capsys, tmp_path):
    code, out, err, yaml_text = from_megatron(capsys, tmp_path, "seed_1f1b.sh", *SEED_GPUS, "--gpu", "A100-40GB")
    assert code == 0, err
    assert "world size 32 = TP 1 x PP 4 x CP 1 x DP 8" in out
    assert "VPP = num_layers / (PP x layers per virtual stage) = 32 / (4 x 4) = 2" in out
    assert "num_microbatches = GBS / (MBS x DP) = 256 / (4 x 8) = 8" in out
    assert "(PP - 1) / (VPP × m) = (4 - 1) / (2 × 8) = 3/16" in out
    assert "schedule: interleaved 1F1B" in out and "verdict:" in out
    flagged = section(out, "flagged")
    assert "--pipeline-model-parallel-split-rank 1" in flagged and "a GPT model has no encoder" in flagged
    assert "virtual_pipeline_model_parallel_size: 2  # --num-layers-per-virtual-pipeline-stage 4" in yaml_text
    assert "#   --pipeline-model-parallel-split-rank 1:" in yaml_text  # in the file's header too
    # issue item 2: GPT-2 BPE vocabulary (Megatron-LM's GPT examples), padded by Megatron's rule
    assert "vocab 50257 -> padded 50304 (multiple of 128 x TP 1)" in out


def test_seed_hybrid_data_parallel_size_2_on_32_gpus_is_refused_with_the_arithmetic(capsys, tmp_path):
    code, out, err, yaml_text = from_megatron(capsys, tmp_path, "seed_hybrid.sh", *SEED_GPUS)
    assert code == 2
    assert "32 / (1 × 2) = 16, not 2" in section(out, "flagged")
    assert err.startswith("error: ") and err.count("\n") == 1  # one line
    assert "parallelism.data_parallel_size=2" in err and "= 16" in err
    assert "data_parallel_size: 2  # --data-parallel-size 2" in yaml_text  # written, then refused
    assert "32 / (2 x 8) = 2" in out  # its 8 layers per virtual stage on PP 2 -> VPP 2


def test_seed_final_config_gives_vpp2_from_8_layers_per_virtual_stage_on_pp2(capsys, tmp_path):
    code, out, err, yaml_text = from_megatron(capsys, tmp_path, "seed_final.yaml")
    assert code == 0, err
    assert "VPP = num_layers / (PP x layers per virtual stage) = 32 / (2 x 8) = 2" in out
    assert "world size 4 = TP 1 x PP 2 x CP 1 x DP 2" in out  # no launcher: the smallest world, said so
    assert "assumed the smallest" in section(out, "assumed")
    assert "(PP - 1) / (VPP × m) = (2 - 1) / (2 × 32) = 1/64" in out
    assert "precision: 'bf16'  # --bf16" in yaml_text
    code, out, err, _ = from_megatron(capsys, tmp_path, "seed_final.yaml", *SEED_GPUS, "--force")
    assert code == 2 and "32 / (1 × 2) = 16" in out


def test_seed_yaml_config_converts(capsys, tmp_path):
    code, out, err, yaml_text = from_megatron(capsys, tmp_path, "seed_megatron_gpt_config.yaml", *SEED_GPUS)
    assert code == 0, err
    assert "15 Megatron-LM flags: 15 mapped, 0 flagged, 0 not converted" in out
    assert "world size 32 = TP 1 x PP 4 x CP 1 x DP 8" in out and "schedule: 1F1B" in out
    assert "lr_decay_style: 'cosine'  # --lr-decay-style cosine" in yaml_text


def test_seed_checkpoint_flags_and_resume_command(capsys, tmp_path):
    code, out, err, yaml_text = from_megatron(capsys, tmp_path, "seed_checkpoint.sh")
    assert code == 0, err
    for line in (
        "save_interval: 2000  # --save-interval 2000",
        "auto_resume: true  # --load (same directory)",
        "save_at_end: true  # --save given",
        "root: '/path'",
        "name: 'to'  # --save /path/to/checkpoints",
    ):
        assert line in yaml_text
    code, out, err, yaml_text = from_megatron(capsys, tmp_path, "seed_resume.sh", *SEED_GPUS)
    assert code == 2 and "32 / (1 × 2) = 16" in out  # the same --data-parallel-size mistake
    assert "auto_resume: true" in yaml_text and "save_at_end: false  # no --save" in yaml_text
    assert "--num-layers, --hidden-size" in section(out, "assumed")  # Megatron-LM's required flags are missing


# ---- a public multi-node example --------------------------------------------------------------


def _array_flags(text: str):
    """Every ``--flag`` inside the script's ``*_ARGS=( ... )`` arrays except the launcher's."""
    flags = []
    for name, body in re.findall(r"^(\w+_ARGS)=\((.*?)^\)", text, re.S | re.M):
        if name != "DISTRIBUTED_ARGS":
            flags += re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", re.sub(r"#.*", "", body))
    return flags


def test_multinode_example_converts_with_no_flag_dropped_silently(capsys, tmp_path):
    from orchestrator.convert.read import read_source
    from orchestrator.convert.to_config import convert

    text = (FIX / "gpt_multinode.sh").read_text()
    flags = _array_flags(text)
    assert len(flags) == 36
    conv = convert(read_source(str(FIX / "gpt_multinode.sh")), "gpt_multinode")
    assert set(conv.status) == set(flags)
    code, out, err, yaml_text = from_megatron(capsys, tmp_path, "gpt_multinode.sh")
    assert code == 0, err
    listed = section(out, "flagged") + section(out, "not converted")
    for flag, status in conv.status.items():
        if status == "mapped":  # a value carries it as its comment (or the header: a key this schema lacks)
            assert re.search(rf"[#(] ?{re.escape(flag)}\b", yaml_text), flag
        else:
            assert flag in listed and f"#   {flag}" in yaml_text, flag  # on screen and in the header
    assert "--attention-backend auto" in section(out, "not converted")
    # Megatron-LM's ramp (which it allows only with --train-samples) converts, iteration-based, and says so
    assert "rampup_batch_size: [32, 32, 2000000]  # --rampup-batch-size 32 32 2000000" in yaml_text
    assert "--rampup-batch-size 32 32 2000000 with --train-iters: Megatron-LM refuses the pair" in out
    assert "world size 16 = TP 4 x PP 2 x CP 1 x DP 2" in out
    assert "vocab 50257 -> padded 50688 (multiple of 128 x TP 4)" in out
    assert "0.01 x 200000 = 2000" in out  # --lr-warmup-fraction
    for line in (
        "weights: [0.7, 0.3]",
        "nodes: 2  # torchrun --nnodes 2",
        "cpus_per_task: 12",
        "timeout_min: 2880",
        "additional_parameters: {'exclusive': true}",
        "srun_args: ['--cpu-bind=none']",
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "root: '/lustre/llm'",
        "name: 'gpt13b'",
        "split: '969,30,1'",
        "eval_interval: 1000  # --eval-interval 1000",
        "tensorboard: true  # --tensorboard-dir",
    ):
        assert line in yaml_text, line


def test_shell_reading_variables_arrays_arithmetic_and_vars(tmp_path):
    from orchestrator.convert.read import read_source

    script = tmp_path / "launch.sh"
    script.write_text(
        "#!/bin/bash\n#SBATCH -N 2\nexport NCCL_IB_DISABLE=0\nG=4\nN=$((G*2))\nCKPT=${1:-/ckpt/x}\n"
        'ARGS=(\n  --num-layers $N  # eight ( layers )\n  --save "$CKPT"\n)\n'
        "python -m torch.distributed.run --nproc_per_node=$G --nnodes 2 \\\n"
        '  pretrain_gpt.py "${ARGS[@]}" --lr=1e-4 \\\n'
        "  --data-path $DATA\n"
    )
    src = read_source(str(script), {"1": "/given"})
    assert [a.text for a in src.args] == [
        "--num-layers 8",
        "--save /given [run time: $1 (--var here)]",
        "--lr 1e-4",
        "--data-path $DATA [run time: $DATA (unknown here)]",
    ]
    assert src.launcher.option("nproc-per-node")[0] == "4" and src.launcher.option("nodes")[0] == "2"
    assert src.env == {"NCCL_IB_DISABLE": "0"}
    assert any("$DATA is not defined" in n for n in src.notes)


LLAMA_EXAMPLE = """#!/bin/bash
# The shapes of Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh: arrays, +=, if blocks, $PWD
TOKENIZER_ARG=${3:-"MOCK"}
DTYPE="fp8"
CACHE="${PWD}/cache"
MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64
    --swiglu --disable-bias-linear --rotary-percent 1.0 --apply-layernorm-1p
)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 8 --train-iters 10 --lr 1e-4 --bf16)
DTYPE_ARGS=()
if [[ "$DTYPE" == "fp8" ]]; then
    DTYPE_ARGS+=(
        "--fp8-format hybrid" "--fp8-param-gather"
        "--fp8-amax-history-len 1024" "--fp8-amax-compute-algo max"
    )
elif [[ "$DTYPE" == "bf16" ]]; then
    DTYPE_ARGS+=("--num-layers 99")
else
    DTYPE_ARGS+=("--num-layers 98")
fi
MODEL_PARALLEL_ARGS=(--tensor-model-parallel-size 1 --sequence-parallel)
DDP_ARGS=(--use-distributed-optimizer --overlap-grad-reduce)
TRAINING_ARGS+=("${DDP_ARGS[@]}")
DATA_ARGS_LIST=()
if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ -z "$TOKENIZER_ARG" ]]; then
    DATA_ARGS_LIST+=("--mock-data" "--tokenizer-type NullTokenizer" "--vocab-size 1000" "--data-cache-path ${CACHE}")
else
    DATA_ARGS_LIST+=("--data-path $DATA_ARG" "--tokenizer-type HuggingFaceTokenizer" "--tokenizer-model $TOKENIZER_ARG")
fi
if [ ! -f "$CHECKPOINT_PATH/latest" ]; then
    EXTRA=(--hidden-dropout 0.5)
fi
torchrun --nproc_per_node 8 pretrain_gpt.py ${MODEL_ARGS[@]} ${TRAINING_ARGS[@]} ${DTYPE_ARGS[@]} \\
    ${MODEL_PARALLEL_ARGS[@]} ${DATA_ARGS_LIST[@]} ${EXTRA[@]}
"""


def test_megatron_lm_example_shapes_arrays_appends_and_if_blocks_convert(capsys, tmp_path, monkeypatch):
    """Flags built in arrays, appended with +=, inside if blocks bash would take (and not the others): read; an if the
    reader cannot decide (a file test) is named with its lines; --sequence-parallel at TP 1 is turned off as
    Megatron-LM does; every flag is mapped or listed with its reason."""
    from orchestrator.convert.read import read_source

    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train_llama.sh"
    script.write_text(LLAMA_EXAMPLE)
    src = read_source(str(script), {})
    flags = [a.text for a in src.args]
    assert (
        "--fp8-format hybrid" in flags and "--use-distributed-optimizer" in flags and "--overlap-grad-reduce" in flags
    )
    mock = "[run time: $3 (its default here)]"  # the mock-data branch is taken on the script's default for $3
    assert f"--vocab-size 1000 {mock}" in flags
    assert f"--data-cache-path {tmp_path}/cache [run time: $3 (its default here), $PWD (this shell's here)]" in flags
    data_if = '`if [[ "$TOKENIZER_ARG" == "MOCK" ]] || [[ -z "$TOKENIZER_ARG" ]]` (line 26)'
    file_if = '`if [ ! -f "$CHECKPOINT_PATH/latest" ]` (line 31)'
    assert [(a.text, where) for a, where in src.undecided] == [  # the branch not taken on $3's default: listed
        ("--data-path $DATA_ARG [run time: $3 (its default here), $DATA_ARG (unknown here)]", data_if),
        (f"--tokenizer-type HuggingFaceTokenizer {mock}", data_if),
        (f"--tokenizer-model MOCK {mock}", data_if),
        ("--hidden-dropout 0.5 [run time: $CHECKPOINT_PATH (unknown here)]", file_if),
    ]
    assert not any(f.startswith("--num-layers 9") or f.startswith("--data-path") or "dropout" in f for f in flags)
    (undecided,) = [n for n in src.notes if "cannot be decided here" in n]
    assert undecided.startswith('lines 31-33: `if [ ! -f "$CHECKPOINT_PATH/latest" ]`'), undecided
    code, out, err, written = from_megatron(capsys, tmp_path, str(script))
    assert code == 0, err + out[-2000:]
    assert "use_distributed_optimizer: true" in written and "overlap_grad_reduce: true" in written
    assert "sequence_parallel: false  # --sequence-parallel at TP 1" in written
    assert "Megatron-LM warns and turns sequence parallelism off" in section(out, "flagged")
    for key in (
        "fp8: 'hybrid'",
        "fp8_amax_history_len: 1024",
        "fp8_amax_compute_algo: 'max'",
    ):  # training.fp8 (issue 37)
        assert key in written, written
    listed = section(out, "not converted")
    assert not any(x.strip().startswith(("--fp8-format", "--fp8-amax")) for x in listed.splitlines()), listed
    for flag in ("--fp8-param-gather", "--rotary-percent 1.0", "--apply-layernorm-1p"):
        (line,) = [x for x in listed.splitlines() if x.strip().startswith(flag)]
        assert "not a flag this converter knows" not in line, line  # each with its own reason


def test_json_args_with_underscored_names(tmp_path):
    from orchestrator.convert.read import read_source
    from orchestrator.convert.to_config import convert

    path = tmp_path / "args.json"
    path.write_text(
        '{"num_layers": 24, "hidden_size": 2048, "num_attention_heads": 16, "swiglu": true,'
        ' "fp16": false, "tokenizer_type": "NullTokenizer", "vocab_size": 256, "data_path": ["/d/x"]}'
    )
    conv = convert(read_source(str(path)), "args")
    got = {k: s.value for k, s in conv.settings.items()}
    assert got["model.num_layers"] == 24 and got["model.activation"] == "swiglu"
    assert got["model.ffn_hidden_size"] == 5440  # Megatron-LM's --swiglu width: int(4 x 2048 x 2/3 / 64) x 64
    assert got["data.tokenizer"] == "byte" and got["data.paths"] == ["/d/x"] and got["data.weights"] is None
    assert got["training.precision"] == "fp32" and "--fp16" not in conv.status


def test_vpp_that_does_not_divide_is_refused_in_one_line(capsys, tmp_path):
    from orchestrator.convert.cli import main

    script = tmp_path / "bad.sh"
    script.write_text("--num-layers 32 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 3\n")
    assert main(["from-megatron", str(script), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: parallelism.virtual_pipeline_model_parallel_size: ")
    assert "fix: --num-layers-per-virtual-pipeline-stage one of [1, 2, 4, 8]" in err


def test_user_errors(capsys, tmp_path, monkeypatch):
    from orchestrator.convert.cli import main

    monkeypatch.chdir(tmp_path)  # no ./conf here: the experiment goes to ./conf/experiment, found from here
    assert main(["from-megatron", str(FIX / "seed_checkpoint.sh")]) == 0
    assert (tmp_path / "conf" / "experiment" / "seed_checkpoint.yaml").is_file()
    assert "next: python -m orchestrator +experiment=seed_checkpoint plan=true" in capsys.readouterr().out
    assert main(["from-megatron", str(FIX / "seed_checkpoint.sh"), "--out", "o"]) == 0
    assert main(["from-megatron", str(FIX / "seed_checkpoint.sh"), "--out", "o"]) == 2
    assert "exists; fix: --force" in capsys.readouterr().err
    assert main(["to-megatron", "parallelism=nope"]) == 2
    assert capsys.readouterr().err.startswith("error: parallelism=nope: ")


def test_rampup_with_train_samples_counts_megatron_lm_iterations_and_a_bad_ramp_is_one_line(capsys, tmp_path):
    """--rampup-batch-size 4 4 16 (GBS 12, MBS 1, 2 ranks): batches 4, 4, 8, 12, 12 ... consume 4, 8, 16, 28, 40;
    Megatron-LM's update_train_iters counts 5 iterations for --train-samples 40 and 6 for 41; its decay
    (no --lr-decay-*) runs over the train samples: ceil(40 / 12) = 4 iterations of GBS samples."""
    from orchestrator.convert.cli import main
    from orchestrator.convert.shell import parse_shell
    from orchestrator.convert.to_config import convert

    base = "torchrun --nproc_per_node 2 pretrain_gpt.py --micro-batch-size 1 --global-batch-size 12 --mock-data "
    for samples, iters in ((40, 5), (41, 6)):
        conv = convert(parse_shell(base + f"--rampup-batch-size 4 4 16 --train-samples {samples}", "r.sh", {}), "r")
        assert conv.get("training.rampup_batch_size") == [4, 4, 16] and conv.get("training.train_iters") == iters
        assert conv.get("optimizer.lr_decay_iters") == 4
    script = tmp_path / "bad.sh"
    script.write_text(base + "--rampup-batch-size 4 4 --train-iters 3\n")
    assert main(["from-megatron", str(script), "--out", str(tmp_path / "conf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --rampup-batch-size: expects three integers <start> <increment> <samples>, got 4 4; "
        "fix: write `--rampup-batch-size START INCREMENT SAMPLES`"
    ], err


# ---- export and round trip ----------------------------------------------------------------

ROUND_TRIPS = (
    [["+experiment=gpt_pp2_dp2"]]
    + [[f"parallelism={p}"] for p in ("none", "pp2_dp2", "pp2_vpp2_dp2", "pp4", "tp2_pp2")]
    + [
        [
            "model=gpt_6.7b",
            "parallelism=pp2_vpp2_dp2",
            "parallelism.data_parallel_size=null",
            "cluster=slurm_a100_4x8",
            "training.precision=bf16",
            "training.micro_batch_size=4",
            "training.global_batch_size=256",
        ],
        [
            "+experiment=gpt_pp2_dp2",
            "data=indexed",
            "data.paths=[/d/a,/d/b]",
            "data.weights=[0.3,0.7]",
            "optimizer=sgd",
            "cluster=slurm_dev",
        ],
        [
            "data=mock",
            "model.activation=swiglu",
            "model.ffn_hidden_size=256",
            "model.num_query_groups=2",
            "model.normalization=RMSNorm",
            "model.position_embedding_type=rope",
            "model.recompute_granularity=selective",
        ],
        [
            "model=moe_tiny",
            "parallelism.data_parallel_size=2",
            "parallelism.expert_model_parallel_size=2",
            "training.spike.factor=null",
        ],
        ["+experiment=mixtral_8x7b_a100x32"],
        [  # the ramp: exported with the sample-based flags Megatron-LM needs with it, and back
            "+experiment=gpt_pp2_dp2",
            "training.micro_batch_size=1",
            "training.global_batch_size=12",
            "training.rampup_batch_size=[4,4,16]",
            "optimizer.lr_warmup_iters=2",
        ],
        [
            "+experiment=llama3_8b_a100x32",
            "training.fp8=e4m3",
            "training.fp8_recipe=tensorwise",
            "training.fp8_amax_history_len=16",
            "training.fp8_amax_compute_algo=max",
        ],
    ]
)


@pytest.mark.parametrize("overrides", ROUND_TRIPS, ids=lambda o: " ".join(o))
def test_round_trip_from_megatron_of_to_megatron_composes_to_the_same_config(overrides):
    from orchestrator.convert import megatron_args as M
    from orchestrator.convert.cli import check
    from orchestrator.convert.experiment_file import compose
    from orchestrator.convert.from_config import export, flags, leaves, reimport

    cfg = compose(overrides)
    text = export(cfg, overrides, check(cfg)[0].world_size)
    back = leaves(reimport(text))
    assert {k: (v, back.get(k)) for k, v in leaves(cfg).items() if k != "run.dir" and back.get(k) != v} == {}
    # Megatron-LM flags carry every key they can say; `# orchestrator:` lines only the rest
    printed = {group[0] for group in flags(cfg)}
    said = {r.key for r in M.TABLE if r.export and r.key and r.flag in printed}
    extras = [
        line.split(":", 1)[1].split("=")[0].strip()
        for line in text.splitlines()
        if line.startswith("# orchestrator:") and not line.startswith("# orchestrator: defaults")
    ]
    # (a null the job derives — overlaps on a GPU, save at the end only — is printed as its value and said null)
    # (byte data under a preset that carries its tokenizer's vocabulary: --tokenizer-type NullTokenizer --vocab-size V
    # builds the model's embedding, and `data.tokenizer="byte"` says which ids the job feeds it)
    preset_vocab = {"data.tokenizer"} if cfg.data.tokenizer == "byte" and cfg.model.vocab_size else set()
    assert not {k for k in said & set(extras) if leaves(cfg)[k] is not None} - preset_vocab, text
    if preset_vocab:
        assert f"--vocab-size {cfg.model.vocab_size} " in text.replace("\\\n", " "), text


def test_to_megatron_prints_the_launch(capsys):
    from orchestrator.convert.cli import main

    assert main(["to-megatron", "+experiment=gpt_pp2_dp2"]) == 0
    out = capsys.readouterr().out
    assert "torchrun --nnodes 1 --nproc-per-node 4 pretrain_gpt.py \\\n" in out
    for flag in (
        "--pipeline-model-parallel-size 2",
        "--global-batch-size 16",
        "--save-interval 50",
        "--save runs/gpt_pp2_dp2/checkpoints",
        "--tokenizer-type NullTokenizer",
    ):
        assert f"    {flag} \\\n" in out or out.rstrip().endswith(flag), flag


def test_flag_table_is_complete():
    from orchestrator.convert import megatron_args as M
    from orchestrator.convert.from_config import EXPORTERS
    from orchestrator.convert.to_config import schema_keys

    pending = {"data.vocab_file", "data.merge_file", "data.tokenizer_model", "data.vocab_size"}  # the schema patch
    keys = set(schema_keys()) | pending
    assert [r.key for r in M.TABLE if r.key and r.key not in keys] == []
    assert [r.flag for r in M.TABLE if r.kind == "special" and r.export and r.flag not in EXPORTERS] == []
    assert len({r.flag for r in M.TABLE}) == len(M.TABLE)
    assert M.swiglu_ffn_hidden_size(4096) == 10880  # Megatron-LM: int(4 * 4096 * 2 / 3 / 64) * 64


def test_megatron_name_for_virtual_stages_in_the_schema():
    from orchestrator.convert.experiment_file import compose
    from orchestrator.convert.to_config import schema_keys
    from orchestrator.errors import ConfigError

    if "parallelism.num_layers_per_virtual_pipeline_stage" not in schema_keys():
        pytest.skip("needs /tmp/convert_schema.patch (parallelism.num_layers_per_virtual_pipeline_stage)")
    cfg = compose(["model=gpt_6.7b", "parallelism=pp2_dp2", "parallelism.num_layers_per_virtual_pipeline_stage=8"])
    assert cfg.parallelism.virtual_pipeline_model_parallel_size == 2  # 32 / (2 x 8)
    with pytest.raises(ConfigError, match=r"num_layers_per_virtual_pipeline_stage=3: .*fix: one of \[1, 2, 4, 8, 16\]"):
        compose(["model=gpt_6.7b", "parallelism=pp2_dp2", "parallelism.num_layers_per_virtual_pipeline_stage=3"])


def test_neither_direction_imports_torch(tmp_path):
    code = "\n".join(
        [
            "import runpy, sys",
            "from orchestrator.convert.cli import main",
            f"assert main(['from-megatron', {str(FIX / 'seed_1f1b.sh')!r}, '--out', {str(tmp_path)!r}, '--nodes', '4',"
            " '--gpus-per-node', '8']) == 0",
            "sys.argv = ['orchestrator.convert', 'to-megatron', 'parallelism=pp4']",
            "try:",
            "    runpy.run_module('orchestrator.convert', run_name='__main__')",
            "except SystemExit as exc:",
            "    assert exc.code == 0, exc.code",
            "print('IMPORTED', sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'megatron'}))",
        ]
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "IMPORTED []" in proc.stdout and "--pipeline-model-parallel-size 4" in proc.stdout
