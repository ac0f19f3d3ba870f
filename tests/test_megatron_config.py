"""The megatron config: our builder against Megatron-LM's own parser (golden files), the
``megatron-config`` tool, a broken Transformer Engine, and the resume rule for megatron config changes.

The golden files (tests/golden/megatron/*.json) were written by tools/megatron_golden.py from Megatron-LM
d98e8a6 (its megatron-core 0.20.0): parse_args -> validate_args -> core_transformer_config_from_args /
get_megatron_ddp_config / get_megatron_optimizer_config on the flags `convert to-megatron` prints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config.compose import compose_config
from orchestrator.config.layout import padded_vocab_size
from orchestrator.config.megatron_fields import PERFORMANCE_FIELDS, UNUSED_FIELDS, split_diff
from orchestrator.config.tokenizer import tokenizer_facts

GOLDEN = sorted((Path(__file__).parent / "golden" / "megatron").glob("*.json"))

LINE_DEFAULTS = {section: set(names) for section, names in UNUSED_FIELDS.items()}
"""Defaults of another megatron-core line, in features no job here turns on (README table)."""

DELIBERATE = {"ddp": {"check_for_nan_in_grad"}}
"""Our choice, not Megatron-LM's (README table): the NaN check is training.nan_policy's guard."""


def _ours(overrides, device="cuda", te=True):
    from orchestrator.config.layout import layout_from_config
    from orchestrator.runtime.rank.mcore import version
    from orchestrator.runtime.rank.megatron_config import Installed, build

    cfg = compose_config(list(overrides))
    dp = layout_from_config(cfg).data_parallel_size  # the layout a launcher validates and the ranks carry
    return cfg, build(cfg, device, Installed(te, te, version()), dp).as_json()


def test_three_goldens_are_there():
    assert {p.stem for p in GOLDEN} == {
        "gpt_125m_1gpu_bf16",
        "gpt_6.7b_pp2_vpp2_dp16_a100_4x8",
        "llama_8b_tp2_distopt_a100_4x8",
    }


@pytest.mark.mcore_lines
@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.stem)
def test_gpu_config_equals_megatron_lm_field_by_field(path):
    golden = json.loads(path.read_text())
    assert golden["megatron_lm"]["commit"].startswith("d98e8a6")
    cfg, ours = _ours(golden["overrides"])
    for section in ("transformer", "ddp", "optimizer"):
        common = set(ours[section]) & set(golden[section])
        assert len(common) > {"transformer": 200, "ddp": 20, "optimizer": 40}[section], section
        differ = {k for k in common if ours[section][k] != golden[section][k]}
        allowed = LINE_DEFAULTS[section] | DELIBERATE.get(section, set())
        assert differ <= allowed, {k: (ours[section][k], golden[section][k]) for k in differ - allowed}
        assert not differ - set(PERFORMANCE_FIELDS[section]) - LINE_DEFAULTS[section]  # no math field
    # the same embedding: Megatron-LM's tokenizer from the exported flags, padded as pretrain_gpt.py pads it
    facts = tokenizer_facts(cfg.data)
    assert golden["gpt_model"]["vocab_size"] == padded_vocab_size(
        facts.vocab_size, cfg.model.make_vocab_size_divisible_by, cfg.parallelism.tensor_model_parallel_size
    )
    assert golden["gpt_model"]["eod"] == facts.eod


def test_cpu_math_is_megatron_lm_s_and_speed_fields_stay_cpu():
    golden = json.loads((Path(__file__).parent / "golden" / "megatron" / "gpt_125m_1gpu_bf16.json").read_text())
    _, cpu = _ours(
        [o for o in golden["overrides"] if not o.startswith(("cluster.gpus", "training.device", "training.precision"))]
        + ["training.device=cpu"],
        device="cpu",
        te=False,
    )
    _, gpu = _ours(golden["overrides"])
    perf, math = split_diff(gpu, cpu)
    precision = {
        "transformer.bf16",
        "transformer.autocast_dtype",
        "transformer.params_dtype",
        "transformer.pipeline_dtype",
        "ddp.grad_reduce_in_fp32",
    }  # and the optimizer's (a carried section: precision is the layout check's)
    assert {k for k, _, _ in math} == precision  # fp32 on CPU; every other math field as on the GPU
    assert cpu["transformer"]["bias_activation_fusion"] is True  # the tanh GELU of the fused bias-GELU
    assert cpu["transformer"]["attention_softmax_in_fp32"] is False
    assert {k for k, _, _ in perf} == {
        "transformer.gradient_accumulation_fusion",
        "transformer.masked_softmax_fusion",
        "transformer.bias_dropout_fusion",
        "transformer.persist_layer_norm",
        "transformer.use_cpu_initialization",
        "transformer.deallocate_pipeline_outputs",
        "optimizer.bf16",
        "optimizer.params_dtype",
    }


def _cli(capsys, *overrides):
    from orchestrator.convert.megatron_config_cli import main

    code = main(list(overrides))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_megatron_config_tool_slurm_gpu_and_local_cpu(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli(
        capsys,
        "+experiment=gpt_pp2_dp2",
        "cluster=slurm_a100_4x8",
        "parallelism.data_parallel_size=null",
        "training.precision=bf16",
        "training.global_batch_size=64",
    )
    assert code == 0, err
    gpu = json.loads(out)
    assert all(
        gpu["transformer"][k]
        for k in (
            "bias_activation_fusion",
            "masked_softmax_fusion",
            "bias_dropout_fusion",
            "gradient_accumulation_fusion",
        )
    )
    assert gpu["ddp"]["overlap_grad_reduce"] is True and "assumed on the GPU nodes" in err
    code, out, err = _cli(capsys, "+experiment=gpt_pp2_dp2")
    cpu = json.loads(out)
    assert code == 0 and cpu["ddp"]["overlap_grad_reduce"] is False
    assert not cpu["transformer"]["masked_softmax_fusion"] and cpu["transformer"]["use_cpu_initialization"]
    code, out, err = _cli(capsys, "parallelism=pp2_dp2", "parallelism.pipeline_model_parallel_size=3")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("error: model.num_layers=4 does not split evenly")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_broken_transformer_engine_is_one_line_before_anything(capsys, tmp_path, monkeypatch):
    """A TE whose import raises RuntimeError (a broken install: a real package on sys.path, not a mock)."""
    fake = tmp_path / "site" / "transformer_engine"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise RuntimeError('libtransformer_engine.so: undefined symbol: nvte_x\\nmore detail')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'site'}:{Path(__file__).parents[1]}")
    monkeypatch.chdir(tmp_path)
    code, out, err = _cli(capsys, "cluster.gpus_per_node=1", "training.device=cuda", "training.precision=bf16")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [
        "error: model.transformer_impl=auto: Transformer Engine is installed but its import fails (RuntimeError: "
        "libtransformer_engine.so: undefined symbol: nvte_x); fix: repair it (pip install --force-reinstall "
        "transformer-engine[pytorch]) or model.transformer_impl=local"
    ]
    code, _, err = _cli(
        capsys,
        "cluster.gpus_per_node=1",
        "training.device=cuda",
        "training.precision=bf16",
        "model.transformer_impl=local",
    )
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]


def test_resume_carries_speed_changes_and_refuses_math_changes():
    from orchestrator.ckpt.megatron_resume import check_megatron_config
    from orchestrator.errors import ResumeMismatchError

    _, saved = _ours(
        [
            "+experiment=gpt_pp2_dp2",
            "cluster=slurm_a100_4x8",
            "parallelism.data_parallel_size=null",
            "training.precision=bf16",
        ]
    )
    manifest = {"megatron_config": saved}
    said = []
    assert check_megatron_config(manifest, saved, "ckpt", said.append) is None and said == []
    faster = json.loads(json.dumps(saved))
    faster["ddp"]["overlap_grad_reduce"] = False
    faster["transformer"]["masked_softmax_fusion"] = False
    perf = check_megatron_config(manifest, faster, "ckpt", said.append)
    assert [k for k, _, _ in perf] == ["transformer.masked_softmax_fusion", "ddp.overlap_grad_reduce"]
    assert len(said) == 1 and "leave the model's function as it was" in said[0]
    lower_lr = json.loads(json.dumps(saved))
    lower_lr["optimizer"]["lr"] /= 10  # a rerun with a lower learning rate, as the spike hint says
    lower_lr["transformer"]["pipeline_model_parallel_size"] = 1  # the layout check's (reshard opt-in)
    assert [k for k, _, _ in check_megatron_config(manifest, lower_lr, "ckpt", said.append)] == ["optimizer.lr"]
    other = json.loads(json.dumps(faster))
    other["transformer"]["apply_residual_connection_post_layernorm"] = True
    with pytest.raises(ResumeMismatchError) as exc:
        check_megatron_config(manifest, other, "ckpt", said.append)
    text = str(exc.value)
    assert "apply_residual_connection_post_layernorm" in text.splitlines()[0]
    assert any(
        line.startswith("megatron.transformer.apply_residual_connection_post_layernorm") and "| refused" in line
        for line in text.splitlines()
    )
    assert "apply_residual_connection_post_layernorm" not in PERFORMANCE_FIELDS["transformer"]


@pytest.mark.mcore_lines
def test_any_megatron_field_passes_through_and_a_bad_one_is_one_line(capsys, tmp_path, monkeypatch):
    """model/parallelism/optimizer.megatron set fields the schema does not name (both megatron-core lines have
    these three); a name the class lacks gets the closest names, a schema-owned one the key that owns it, a value
    megatron-core refuses its own reason: each one error line, exit 2, nothing written."""
    from orchestrator.ckpt.megatron_resume import check_megatron_config
    from orchestrator.errors import ResumeMismatchError

    monkeypatch.chdir(tmp_path)
    passed = [
        "+model.megatron.apply_residual_connection_post_layernorm=true",
        "+parallelism.megatron.bucket_size=1000000",
        "+optimizer.megatron.loss_scale_window=500",
    ]
    base = ["+experiment=gpt_pp2_dp2", "training.device=cpu"]
    _, plain = _ours(base, device="cpu", te=False)
    _, built = _ours(base + passed, device="cpu", te=False)
    field = "apply_residual_connection_post_layernorm"
    assert (plain["transformer"][field], built["transformer"][field]) == (False, True)
    assert built["ddp"]["bucket_size"] == 1000000 and built["optimizer"]["loss_scale_window"] == 500
    from orchestrator.convert.from_config import flags

    exported = flags(compose_config(base + passed + ["+model.megatron.tp_comm_overlap=true"]))
    for flag in (
        ["--apply-residual-connection-post-layernorm"],
        ["--bucket-size", "1000000"],
        ["--loss-scale-window", "500"],
    ):
        assert flag in exported, exported  # Megatron-LM's flags of the same names
    assert ["--tp-comm-overlap"] in exported
    said = []  # on resume: the residual's place is math (refused), the bucket size speed (carried)
    with pytest.raises(ResumeMismatchError, match=field):
        check_megatron_config({"megatron_config": plain}, built, "ckpt", said.append)
    faster = json.loads(json.dumps(plain))
    faster["ddp"]["bucket_size"] = 1000000
    assert [k for k, _, _ in check_megatron_config({"megatron_config": plain}, faster, "ckpt", said.append)] == [
        "ddp.bucket_size"
    ]
    for override, words in (
        (
            "+model.megatron.qk_layernormm=true",
            "has no field qk_layernormm; fix: did you mean qk_layernorm",
        ),
        # typed without + (or as a whole mapping): merged, so the field's own check answers in the first run
        ("model.megatron.qk_layernormm=true", "has no field qk_layernormm; fix: did you mean qk_layernorm"),
        ("model.megatron={qk_layernormm: true}", "has no field qk_layernormm; fix: did you mean qk_layernorm"),
        (
            "+model.megatron.num_layers=8",
            "model.megatron.num_layers=8: model.num_layers sets megatron-core's num_layers",
        ),
        ("+optimizer.megatron.lr=0.1", "optimizer.megatron.lr=0.1: optimizer.lr sets"),
        ("+model.megatron.layernorm_epsilon=1e-6", "model.norm_epsilon sets megatron-core's layernorm_epsilon"),
        ("+model.megatron.cpu_offloading=true", "megatron-core refused the pass-through fields"),  # with PP 2
    ):
        code, out, err = _cli(capsys, *base, override)
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert code == 2 and len(lines) == 1 and words in lines[0], (override, err)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_gpu_job_without_transformer_engine_says_the_unfused_attention_cost():
    """The warning of a GPU job whose ``model.transformer_impl=auto`` found no Transformer Engine: the activation
    memory per layer and micro-batch of the unfused attention against flash's, from the planner's formula."""
    from orchestrator.config.checks import validate
    from orchestrator.config.compose import compose_config
    from orchestrator.plan.activations import layer_activation_bytes
    from orchestrator.plan.inputs import ModelShape
    from orchestrator.runtime.rank.model import without_te

    cfg = compose_config(["+experiment=llama3_8b_a100x32"])
    layout = validate(cfg)
    shape = ModelShape.from_model_config(cfg.model, 128256)
    unfused, flash = (layer_activation_bytes(shape, layout, 2, attention=k) for k in ("unfused", "flash"))
    line = without_te(cfg, layout, 128256)
    assert unfused > 2 * flash  # seq 8192: the a·s² scores dominate
    assert f"({unfused / 2**20:,.1f} MiB of activations per layer" in line and f"{flash / 2**20:,.1f} MiB" in line
    assert "fix: install Transformer Engine" in line and "model.transformer_impl=local" in line
