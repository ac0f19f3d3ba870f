"""Refusals a fresh-eyes tester met: each names the key, the values and a fix that works (one ``error:`` line,
exit 2, nothing created), and an experiment of the user's names its run. Compose + validate, in-process, except
one ``plan=true`` subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config.compose import compose_config
from orchestrator.errors import ConfigError, OrchestratorError

REPO = Path(__file__).resolve().parents[1]


def test_megatron_passthrough_values_are_checked_against_the_field_annotations():
    """``+model.megatron.kv_channels=abc`` was queued and failed in rank 0's forward (a TypeError inside
    SelfAttention); ``apply_query_key_layer_scaling=notabool`` trained and recorded "notabool"."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from orchestrator.config.megatron_types import value_problem

    t, key = TransformerConfig, "model.megatron.kv_channels"
    line = value_problem(key, t, "kv_channels", "abc")
    assert line.startswith("model.megatron.kv_channels='abc': TransformerConfig.kv_channels is Optional[int]"), line
    assert "; fix: model.megatron.kv_channels=<an integer or null>" in line
    bad = value_problem("model.megatron.apply_query_key_layer_scaling", t, "apply_query_key_layer_scaling", "notabool")
    assert "is bool, not str; fix: model.megatron.apply_query_key_layer_scaling=<true or false>" in bad
    assert value_problem("k", t, "qk_layernorm", 1) is not None  # Hydra typed 1 an int: not a bool
    assert value_problem("k", DistributedDataParallelConfig, "bucket_size", 1.5) is not None
    assert "'allgather' or 'alltoall' or 'flex'" in value_problem("k", t, "moe_token_dispatcher_type", "all2all")
    assert value_problem("k", t, "attention_backend", "bogus") is not None  # an enum: its members' names
    for cls, name, value in (
        (t, "kv_channels", 16),
        (t, "kv_channels", None),
        (t, "apply_query_key_layer_scaling", True),
        (t, "attention_backend", "flash"),
        (t, "moe_token_dispatcher_type", "alltoall"),
        (t, "moe_layer_freq", [1, 0]),  # Union[int, List[int]]
        (t, "cuda_graph_scope", ["attn"]),
        (OptimizerConfig, "loss_scale_window", 500),  # an int for a float field
        (t, "init_method", "anything"),  # a Callable: not checkable, nothing said
    ):
        assert value_problem("k", cls, name, value) is None, (name, value)


def test_a_mistyped_megatron_value_is_one_line_before_anything_is_created(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "orchestrator",
            "+model.megatron.kv_channels=abc",
            "plan=true",
            f"run.root={tmp_path}/R",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stdout + proc.stderr
    assert lines[0].startswith("error: model.megatron.kv_channels='abc': TransformerConfig.kv_channels is "), lines
    assert list(tmp_path.iterdir()) == []


def _experiment(tmp_path: Path, text: str) -> str:
    (tmp_path / "experiment").mkdir(exist_ok=True)
    (tmp_path / "experiment" / "mine.yaml").write_text(text)
    return f"hydra.searchpath=[file://{tmp_path}]"


def test_an_experiment_without_run_name_names_its_run(tmp_path):
    """It was ``gpt_tiny_none``: a run of another config's directory (resumed, or refused as its resume)."""
    searched = _experiment(
        tmp_path, "# @package _global_\ndefaults:\n  - override /model: gpt_tiny\ntraining:\n  train_iters: 7\n"
    )
    assert compose_config(["+experiment=mine", searched]).run.name == "mine"
    chosen = compose_config(["+experiment=mine", "parallelism=pp2_dp2", searched])
    assert chosen.run.name == "mine-parallelism=pp2_dp2"
    twice = compose_config(["+experiment=gpt_pp2_dp2", "model=gpt_125m", "model=gpt_tiny"])  # the last one trains
    assert (twice.run.name, twice.model.name) == ("gpt_pp2_dp2-model=gpt_tiny", "gpt_tiny")  # was both in the name
    assert compose_config(["+experiment=mine", "run.name=x", searched]).run.name == "x"
    assert compose_config(["+experiment=gpt_pp2_dp2"]).run.name == "gpt_pp2_dp2"  # shipped: their own names
    assert compose_config([]).run.name == "gpt_tiny_none"
    named = _experiment(tmp_path, "# @package _global_\nrun:\n  name: other\n")
    assert compose_config(["+experiment=mine", named]).run.name == "other"


def test_data_split_fixes_name_forms_that_work():
    with pytest.raises(ConfigError) as bare:
        compose_config(["data.split=98,2"])
    fix = str(bare.value).split("; fix: ", 1)[1]
    quoted = re.search(r"\"(data\.split='98,2')\"", fix).group(1)  # bash passes it without the double quotes
    assert compose_config([quoted]).data.split == "98,2"
    listed = re.search(r"(data\.split=\[98,2\])", fix).group(1)
    assert compose_config([listed]).data.split == "98,2"
    assert compose_config(["data.split=[98,2,0]"]).data.split == "98,2,0"
    with pytest.raises(ConfigError, match=r"training\.train_iters=\[5,6\] for a list value"):
        compose_config(["training.train_iters=5,6"])


def test_layout_refusals_carry_a_fix():
    from orchestrator.config.checks import validate

    with pytest.raises(OrchestratorError) as groups:
        validate(compose_config(["model.num_query_groups=3"]))
    assert (
        "model.num_attention_heads=4 is not divisible by model.num_query_groups=3; fix: model.num_query_groups=2 (one of [1, 2, 4])"
        in str(groups.value)
    )
    validate(compose_config(["model.num_query_groups=2"]))  # the fix, as printed
    from orchestrator.config.layout import ParallelLayout

    base = dict(world_size=8, num_layers=4, num_attention_heads=4, micro_batch_size=1, global_batch_size=8)
    moe = ParallelLayout(**base, expert_model_parallel_size=4, num_moe_experts=6)
    vpp = ParallelLayout(**base, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=0)
    problems = moe.problems() + vpp.problems()
    assert len(problems) == 2 and all("; fix: " in p for p in problems), problems
    assert "fix: parallelism.expert_model_parallel_size one of [1, 2, 3, 6]" in problems[0]


def test_an_experiment_given_twice_is_told_to_give_it_once():
    with pytest.raises(ConfigError) as twice:
        compose_config(["+experiment=gpt_pp2_dp2", "+experiment=gpt_pp2_dp2"])
    assert "experiment is chosen more than once" in str(twice.value)
    assert "fix: give experiment once, e.g. +experiment=gpt_pp2_dp2 alone" in str(twice.value)


def test_the_space_refusal_names_what_binds_and_a_fix_that_can_work(tmp_path):
    """``model=llama3_8b`` (one save, at the end) was told to lower checkpoint.keep_last=3 (minimum 2)."""
    from orchestrator.ckpt.space import disk_space, space_refusal

    cfg = compose_config([f"run.root={tmp_path}", "run.name=r"])
    free = disk_space(tmp_path)[0]
    one = space_refusal(cfg, 4 * free, 1, 10)
    assert one.startswith(f"run.root={tmp_path}: one checkpoint of this run is ") and "keep_last" not in one, one
    kept = space_refusal(cfg, free // 2 + 1, 4, 10)  # keep_last=3 + the one written; one fits: keep_last cannot help
    assert (
        kept.startswith("checkpoint.keep_last=3: this run keeps up to 4 checkpoints")
        and "checkpoint.keep_last=" not in kept.split("; fix: ")[1]
    ), kept
    cfg.checkpoint.keep_last = 8
    lower = space_refusal(cfg, free // 5 + 1, 9, 10)  # four fit (under load: three to five): keep_last=2..4 does
    assert re.search(r"; fix: .*checkpoint\.keep_last=[2-4],", lower), lower
    cfg.checkpoint.keep_last = None
    saves = space_refusal(cfg, free // 2 + 1, 5, 10)
    assert saves.startswith("checkpoint.save_interval=null: ") and "a larger checkpoint.save_interval" in saves, saves
