"""The megatron config: our builder against Megatron-LM's own parser (golden files), the
``megatron-config`` tool, a broken Transformer Engine, and the resume rule for megatron config changes.

The golden files (tests/golden/megatron/*.json) were written by tools/megatron_golden.py from Megatron-LM
d98e8a6 (its megatron-core 0.20.0): parse_args -> validate_args -> core_transformer_config_from_args /
get_megatron_ddp_config / get_megatron_optimizer_config on the flags `convert to-megatron` prints (the FP8 one
with `--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max`; its parser needs no
Transformer Engine for them). FP8's own tests: tests/test_fp8.py. Each golden also holds where Megatron-LM carries
the batch and its ramp, which none of its config dataclasses has: the validated args (`batch`), the fields of the
OptimizerParamScheduler its get_optimizer_param_scheduler builds (`scheduler`) and megatron-core's
num-microbatches calculator as its set_global_variables builds it (`microbatches`); the ramp-up one
(gpt_125m_rampup_dp8) also the same with the `--step-batch-size-schedule` our export's comment gives in place of
`--rampup-batch-size` (`step_schedule`), which d98e8a6 parses but ignores. Ramp-up's own tests: tests/test_rampup.py.
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


def test_five_goldens_are_there():
    assert {p.stem for p in GOLDEN} == {
        "gpt_125m_1gpu_bf16",
        "gpt_6.7b_pp2_vpp2_dp16_a100_4x8",
        "llama_8b_tp2_distopt_a100_4x8",
        "llama_8b_tp2_fp8_hybrid_4x8",
        "gpt_125m_rampup_dp8",
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


SCHEDULER_BY_DESIGN = {
    "override_opt_param_scheduler": "ours True: on resume the config's schedule wins (README); Megatron-LM's default "
    "False refuses a schedule that differs from the checkpoint's",
    "wd_incr_steps": "read only by a non-constant wd_incr_style; ours is constant (start_wd = end_wd = "
    "optimizer.weight_decay): ours the LR decay length, Megatron-LM's the training length",
    "lr_wsd_decay_style": "read only by lr_decay_style=WSD, which optimizer.lr_decay_style does not offer",
}
"""OptimizerParamScheduler fields that differ from Megatron-LM's get_optimizer_param_scheduler, and why."""

STEP_FIELDS = {"lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "num_steps"}
"""Lengths in the scheduler's steps: Megatron-LM's always count samples; ours iterations without a ramp (x GBS)."""


def _our_batch(cfg, layout) -> dict:
    """Our batch settings in Megatron-LM's arg names: the manifest's ``batch`` record, the layout's DP, and the LR
    schedule's lengths the runtime builds (in samples with a ramp, as the export's ``--*-samples``)."""
    from orchestrator.ckpt.manifest import batch_and_format
    from orchestrator.config.ramp import samples_after
    from orchestrator.config.schedule import lr_schedule

    t, o, lr = cfg.training, cfg.optimizer, lr_schedule(cfg)
    record = batch_and_format(cfg, layout)["batch"]
    ramp = record["rampup_batch_size"]
    return {
        **{k: record[k] for k in ("micro_batch_size", "global_batch_size", "rampup_batch_size")},
        "data_parallel_size": layout.data_parallel_size,
        "seq_length": cfg.model.seq_length,
        "step_batch_size_schedule": None,  # megatron-core 0.19's ramp: BatchRamp's own, from rampup_batch_size
        "decrease_batch_size_if_needed": False,  # BatchRamp's
        "eval_global_batch_size": t.global_batch_size,  # evaluation keeps the full batch
        "train_iters": None if ramp else t.train_iters,  # with a ramp Megatron-LM counts samples: ours consumed
        "train_samples": samples_after(ramp, t.global_batch_size, t.train_iters) if ramp else None,
        "lr_warmup_iters": 0 if ramp else o.lr_warmup_iters,
        "lr_warmup_samples": lr.lr_warmup_steps if ramp else 0,
        "lr_warmup_fraction": None,
        "lr_decay_iters": None if ramp else o.lr_decay_iters,
        "lr_decay_samples": lr.lr_decay_steps if ramp else None,
    }


WITH_BATCH = [p for p in GOLDEN if "scheduler" in json.loads(p.read_text())]
"""The goldens with ``batch`` / ``scheduler`` / ``microbatches``: the ramp-up one (the four older files predate them
and are kept as written; tools/megatron_golden.py would add them, and --log-interval 10 for their 1)."""


@pytest.mark.mcore_lines
@pytest.mark.parametrize("path", WITH_BATCH, ids=lambda p: p.stem)
def test_batch_lr_scheduler_and_ramp_equal_megatron_lm_s(path):
    """Our batch settings, the runtime's OptimizerParamScheduler (its own builder, on a one-parameter torch
    optimizer) and megatron-core's num-microbatches calculator as BatchRamp drives it, field by field against
    Megatron-LM's (golden ``batch`` / ``scheduler`` / ``microbatches``)."""
    import torch
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    from orchestrator.config.layout import layout_from_config
    from orchestrator.config.ramp import iterations_for
    from orchestrator.convert.ramp_flags import newer_megatron_comment
    from orchestrator.runtime.rank.model import lr_scheduler
    from orchestrator.runtime.training.batch_ramp import BatchRamp

    golden = json.loads(path.read_text())
    cfg = compose_config(golden["overrides"])
    layout, t = layout_from_config(cfg), cfg.training
    ours = _our_batch(cfg, layout)
    assert set(golden["batch"]) - set(ours) == {"gtp_weight_remat_size"}  # GTP weight remat: not a feature here
    assert golden["batch"]["gtp_weight_remat_size"] == 1
    assert {k: ours[k] for k in golden["batch"] if k in ours} == {k: v for k, v in golden["batch"].items() if k in ours}

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = lr_scheduler(cfg, optimizer)
    per = 1 if t.rampup_batch_size is not None else t.global_batch_size  # ours in its without a ramp
    mine = {k: v * per if k in STEP_FIELDS else v for k, v in vars(scheduler).items() if k != "optimizer"}
    theirs = {k: v for k, v in golden["scheduler"].items() if k != "lr_at"}
    assert len(set(mine) & set(theirs)) >= 15, set(theirs) - set(mine)
    differ = {k: (mine[k], theirs[k]) for k in set(mine) & set(theirs) if mine[k] != theirs[k]}
    assert set(differ) <= set(SCHEDULER_BY_DESIGN), differ
    for steps, lr, wd in golden["scheduler"]["lr_at"]:  # Megatron-LM's steps are samples, multiples of GBS
        scheduler.num_steps = steps // per
        assert scheduler.get_lr(optimizer.param_groups[0]) == pytest.approx(lr, rel=1e-12), steps
        assert scheduler.get_wd(optimizer.param_groups[0]) == pytest.approx(wd, rel=1e-12), steps

    ramp = BatchRamp(cfg, layout.data_parallel_size, rank=0)
    try:
        batches = {c: ramp.at(c) for c, _, _ in golden["microbatches"]["at"]}
        at = [[c, b.samples, b.num_microbatches] for c, b in batches.items()]
    finally:
        destroy_num_microbatches_calculator()
    if t.rampup_batch_size is None:
        assert at == golden["microbatches"]["at"]
        assert golden["microbatches"]["train_iters"] == t.train_iters
        return
    # d98e8a6 parses --rampup-batch-size and ignores it (set_global_variables never passes it to the calculator):
    # the full batch from sample 0, and update_train_iters' train_samples // GBS iterations. Ours ramps (README).
    assert {tuple(b) for _, *b in golden["microbatches"]["at"]} == {(t.global_batch_size, layout.num_microbatches)}
    assert golden["microbatches"]["train_iters"] == ours["train_samples"] // t.global_batch_size != t.train_iters
    # the ramp as the step schedule our export's comment gives for Megatron-LM on megatron-core 0.19+: equal
    step = golden["step_schedule"]
    assert f"--step-batch-size-schedule '{step['flags'][1]}'" in newer_megatron_comment(cfg)
    assert at == step["microbatches"]["at"]
    assert (
        step["microbatches"]["train_iters"]
        == t.train_iters
        == iterations_for(t.rampup_batch_size, t.global_batch_size, ours["train_samples"])
    )


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


def test_an_enum_field_passed_by_name_reaches_megatron_core_as_its_member():
    """``+model.megatron.attention_backend=flash`` was checked against AttnBackend's names, then handed to
    TransformerConfig as the string "flash": megatron-core's LanguageModule compares the field with the members, so
    it matched none and Transformer Engine's backend stayed its own choice without a word. Megatron-LM's parser
    makes the name its member (``AttnBackend[name]``); so does the build now."""
    from megatron.core.transformer.enums import AttnBackend

    from orchestrator.config.megatron_types import as_field
    from orchestrator.runtime.rank.mcore import version
    from orchestrator.runtime.rank.megatron_config import Installed, build

    cfg = compose_config(["+experiment=gpt_pp2_dp2", "training.device=cpu", "+model.megatron.attention_backend=local"])
    built = build(cfg, "cpu", Installed(False, False, version()), 2)
    assert built.transformer.attention_backend is AttnBackend.local
    assert built.as_json()["transformer"]["attention_backend"] == "local"
    assert as_field(AttnBackend, "flash") is AttnBackend.flash
    assert as_field(AttnBackend, AttnBackend.fused) is AttnBackend.fused
    import typing

    scope = typing.get_type_hints(built.transformer.__class__)["cuda_graph_scope"]  # Union[str, CudaGraphScope, ...]
    assert as_field(scope, "attn") == "attn" and type(as_field(scope, "attn")) is str  # a str is one of its types
    assert as_field(int, 3) == 3 and as_field(None, "x") == "x"
