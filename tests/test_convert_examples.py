"""Issue 38 item 0: every flag of Megatron-LM's ``examples/mixtral`` and ``examples/llama`` launch scripts is
mapped or listed with its reason, and a value only the running script knows says so on its row.

The scripts here are our own, written in the shapes of ``examples/mixtral/train_mixtral_8x7b_distributed.sh``
(Megatron-LM d98e8a6: positional ``$1..$3``, ``${VAR:-"default"}`` rendezvous, arrays with ``\\`` continuations,
``+=`` inside an ``if`` on ``$WANDB_API_KEY``, ``torchrun ${DISTRIBUTED_ARGS[@]}``) with small values; the Llama
shapes are tests/test_convert.py's. Pure Python, in-process: nothing is run.
"""

from __future__ import annotations

import re

MOE_SCRIPT = """#!/bin/bash

# Runs a small mixture-of-experts model

export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=4
# Change for multinode config
MASTER_ADDR=${MASTER_ADDR:-"localhost"}
MASTER_PORT=${MASTER_PORT:-"29500"}
NNODES=${SLURM_NNODES:-"1"}
NODE_RANK=${RANK:-"0"}
WORLD_SIZE=$(($GPUS_PER_NODE*$NNODES))

CHECKPOINT_PATH=$1
TOKENIZER_MODEL=$2
DATA_PATH=$3

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE
    --nnodes $NNODES
    --node_rank $NODE_RANK
    --master_addr $MASTER_ADDR
    --master_port $MASTER_PORT
)

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 128
    --max-position-embeddings 1024
    --num-layers 4
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 8
    --init-method-std 0.02
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 2
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 4
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)

DATA_ARGS=(
    --tokenizer-type Llama2Tokenizer
    --tokenizer-model ${TOKENIZER_MODEL}
    --data-path $DATA_PATH
    --split 98,1,1
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 16
    --lr 3e-4
    --train-iters 100
    --lr-decay-iters 80
    --lr-decay-style cosine
    --min-lr 3.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 10
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 2
    --expert-model-parallel-size 2
    --use-distributed-optimizer
    --sequence-parallel
)

LOGGING_ARGS=(
    --log-interval 1 \\
    --save-interval 50 \\
    --eval-interval 20 \\
    --eval-iters 5 \\
    --save $CHECKPOINT_PATH \\
    --load $CHECKPOINT_PATH \\
    --tensorboard-dir "${CHECKPOINT_PATH}/tensorboard" \\
    --no-load-optim \\
    --no-load-rng
)

if [ -n "${WANDB_API_KEY}" ]; then
    LOGGING_ARGS+=(
        --wandb-project ${WANDB_PROJECT:-"Moe"}
        --wandb-exp-name ${WANDB_NAME:-"Moe_small"}
    )
fi


torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \\
    ${MODEL_ARGS[@]} \\
    ${MOE_ARGS[@]} \\
    ${DATA_ARGS[@]} \\
    ${TRAINING_ARGS[@]} \\
    ${MODEL_PARALLEL_ARGS[@]} \\
    ${LOGGING_ARGS[@]}
"""
TORCHRUN = {"--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port"}


def _convert(capsys, tmp_path, *extra):
    from orchestrator.convert.cli import main

    script = tmp_path / "train_moe.sh"
    script.write_text(MOE_SCRIPT)
    out_dir = tmp_path / "conf"
    code = main(["from-megatron", str(script), "--out", str(out_dir), "--name", "moe", "--force", *extra])
    out, err = capsys.readouterr()
    written = out_dir / "experiment" / "moe.yaml"
    return code, out, err, written.read_text() if written.exists() else ""


def _listed(out: str) -> dict:
    """Each listed flag of the screen's flagged / not converted sections -> its line."""
    lines = re.findall(r"^  (--[a-z][\w-]*.*)$", out.split("read notes:")[0], re.M)
    return {re.match(r"--[\w-]+", line).group(0): line for line in lines}


def test_mixtral_shaped_script_every_flag_mapped_or_listed_and_run_time_values_said(capsys, tmp_path):
    """$1..$3 undefined: one line naming them and the command that defines them, nothing written. With them (and
    $SLURM_NNODES for a world the expert grid fits): every flag of the script is a setting or listed with its reason
    (none unknown to the converter), the Mixtral values are the settings, and each value that only the running
    script knows ($1, ${SLURM_NNODES:-1}, the wandb if) says so on its row."""
    code, out, err, written = _convert(capsys, tmp_path)
    assert code == 2 and written == "" and err.count("error:") == 1, err
    assert "$1 (CHECKPOINT_PATH: --save, --load), $2 (TOKENIZER_MODEL: --tokenizer-model)" in err
    assert "--var '1=<CHECKPOINT_PATH>' --var '2=<TOKENIZER_MODEL>' --var '3=<DATA_PATH>'" in err

    given = ["--var", f"1={tmp_path}/run", "--var", "2=tok.model", "--var", "3=data/moe_text_document"]
    code, out, err, written = _convert(capsys, tmp_path, *given, "--var", "SLURM_NNODES=2")
    assert code == 0, err + out[-3000:]
    var = "[run time: $SLURM_NNODES (--var here)]"
    for line in (
        "num_layers: 4  # --num-layers 4",
        "num_query_groups: 2  # --group-query-attention --num-query-groups 2",
        "ffn_hidden_size: 224  # --ffn-hidden-size 224",
        "rotary_base: 1000000  # --rotary-base 1000000",
        "normalization: 'RMSNorm'  # --normalization RMSNorm",
        "untie_embeddings_and_output_weights: true",
        "num_moe_experts: 4  # --num-experts 4",
        "moe_router_topk: 2  # --moe-router-topk 2",
        "moe_aux_loss_coeff: 0.01  # --moe-aux-loss-coeff 1e-2",
        "moe_grouped_gemm: true  # --moe-grouped-gemm",
        "pipeline_model_parallel_size: 2  # --pipeline-model-parallel-size 2",
        "expert_model_parallel_size: 2  # --expert-model-parallel-size 2",
        "sequence_parallel: false  # --sequence-parallel at TP 1",
        "overlap_grad_reduce: true  # --overlap-grad-reduce",
        "overlap_param_gather: true  # --overlap-param-gather",
        "use_distributed_optimizer: true  # --use-distributed-optimizer",
        "tokenizer: 'Llama2Tokenizer'  # --tokenizer-type Llama2Tokenizer",
        "tokenizer_model: 'tok.model'  # --tokenizer-model tok.model [run time: $2 (--var here)]",
        "paths: ['data/moe_text_document']  # --data-path (paths) [run time: $3 (--var here)]",
        "split: '98,1,1'  # --split 98,1,1",
        "lr_decay_iters: 80  # --lr-decay-iters 80",
        "min_lr: 3.0e-05  # --min-lr 3.0e-5",
        "precision: 'bf16'  # --bf16",
        f"nodes: 2  # torchrun --nnodes 2 {var}",
        f"name: 'run'  # --save {tmp_path}/run [run time: $1 (--var here)]",
    ):
        assert line in written, line
    assert "world size 8 = TP 1 x PP 2 x CP 1 x DP 4" in out

    flags = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", MOE_SCRIPT)) - TORCHRUN
    listed = _listed(out)
    assert not [f for f in flags if f not in written], "every flag is named in the written file"
    assert "not a flag this converter knows" not in out  # none unhandled
    for flag in (
        "--use-mcore-models",
        "--no-masked-softmax-fusion",
        "--no-position-embedding",
        "--moe-router-load-balancing-type",
        "--moe-token-dispatcher-type",
        "--no-load-optim",
        "--no-load-rng",
    ):
        assert re.fullmatch(rf"{flag}( \S+)?: \S.{{10,}}", listed[flag]), listed[flag]  # with its reason
    assert listed["--wandb-project"].startswith(
        "--wandb-project Moe [run time: $WANDB_API_KEY (unknown here), $WANDB_PROJECT (its default here)]: inside "
        '`if [ -n "${WANDB_API_KEY}" ]` (line 102), which bash decides only when the script runs'
    ), listed["--wandb-project"]
    assert "--wandb-exp-name Moe_small [run time:" in listed["--wandb-exp-name"]
    assert re.search(
        r"^  torchrun --node-rank 0 --master-addr localhost --master-port 29500 \[run time: \$MASTER_ADDR \(its "
        r"default here\), \$MASTER_PORT \(its default here\), \$RANK \(its default here\)\]: rendezvous",
        out,
        re.M,
    )
    counts = re.search(r"(\d+) Megatron-LM flags: (\d+) mapped, (\d+) flagged, (\d+) not converted", out).groups()
    assert tuple(map(int, counts)) == (len(flags), len(flags) - 9, 0, 9), counts

    code, out, err, written = _convert(capsys, tmp_path, *given, "--var", "SLURM_NNODES=2", "--var", "WANDB_API_KEY=k")
    assert code == 0, err
    assert "project: 'Moe'  # --wandb-project Moe [run time: $WANDB_API_KEY (--var here), $WANDB_PROJECT" in written
    assert "name: 'Moe_small'  # --wandb-exp-name Moe_small [run time:" in written


def test_reader_functions_heredocs_commands_and_comments_inside_arrays(tmp_path):
    """A function definition reaches cluster.setup as one line (its body not read as flags or branches); a
    here-document's text and its command are not carried; $(command) values stay unknown and say so; a comment
    inside an array and a commented-out flag are not flags; an if on ${KEY:-} not taken here still lists its
    flags."""
    from orchestrator.convert.read import read_source

    script = tmp_path / "train.sh"
    script.write_text(
        "#!/bin/bash\nset -euo pipefail\nSTAMP=$(date +%s)\nCACHE=/tmp/c\n"
        'say() {\n    if [ -n "$1" ]; then\n        echo "$1"\n    fi\n}\n'
        "cat > notes.txt <<EOF\n--num-layers 99\nEOF\n"
        "ARGS=(\n    --num-layers 2  # two ( layers )\n    # --hidden-size 999\n    --hidden-size 64 \\\n"
        "    --run-tag $STAMP\n)\n"
        'if [ -n "${KEY:-}" ]; then\n    ARGS+=(--wandb-project p)\nfi\n'
        'say "go"\nmkdir -p "$CACHE" "${SLURM_JOB_ID:-x}" "$(hostname)" "$PWD/$1"\ntorchrun --nproc_per_node 2 pretrain_gpt.py ${ARGS[@]}\n'
    )
    src = read_source(str(script), {})
    assert [a.text for a in src.args] == [
        "--num-layers 2",
        "--hidden-size 64",
        "--run-tag $STAMP [run time: $STAMP = $(command) (not run here)]",
    ]
    assert src.setup == [  # the script's own variables written in; the job's environment read where it runs
        "set -euo pipefail",
        'say() { if [ -n "$1" ]; then echo "$1"; fi; }',
        'say "go"',
        'mkdir -p "/tmp/c" "${SLURM_JOB_ID:-x}" "$(hostname)" "$PWD/$1"',
    ]
    assert [(a.text, where) for a, where in src.undecided] == [
        ("--wandb-project p [run time: $KEY (its default here)]", '`if [ -n "${KEY:-}" ]` (line 19)')
    ]
    assert any(n.startswith("lines 10-12: here-document not read, nor carried into cluster.setup") for n in src.notes)
    assert "lines 5-9: function say carried into cluster.setup as one line; its body is not read for flags" in src.notes
