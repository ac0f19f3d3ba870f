"""The planner: closed forms from the papers, the seed's model on 4 x 8 A100-40GB, suggestions, speed.

Plain pytest, no torch. Sources: Narayanan et al. 2021 (bubble, FLOPs), Korthikanti et al. 2022
(activations), Megatron-Core's distributed-optimizer guide (bytes per parameter).
"""

import dataclasses
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from orchestrator.config.layout import ParallelLayout
from orchestrator.config.schema import (
    ClusterConfig,
    JobConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelismConfig,
    TrainingConfig,
)
from orchestrator.errors import ConfigError, LayoutError
from orchestrator.plan import memory as planner
from orchestrator.plan import suggest
from orchestrator.plan.activations import in_flight
from orchestrator.plan.inputs import host_memory_bytes
from orchestrator.plan.memory import GiB, ModelShape, Recipe
from orchestrator.plan.report import format_plan

CONF = Path(__file__).resolve().parents[1] / "conf"
SEED_VOCAB = 51200  # GPT-2's 50257 padded as Megatron did at TP 8 (128 x 8)


def seed_cfg(mbs: int, **opt) -> JobConfig:
    """The seed's model (32 layers, hidden 4096, 32 heads, seq 2048), TP1 PP2, bf16, on 4 x 8 GPUs."""
    return JobConfig(
        parallelism=ParallelismConfig(name="seed", pipeline_model_parallel_size=2),
        model=ModelConfig(
            name="gpt_6.7b",
            num_layers=32,
            hidden_size=4096,
            num_attention_heads=32,
            seq_length=2048,
            max_position_embeddings=2048,
        ),
        optimizer=OptimizerConfig(**opt),
        training=TrainingConfig(micro_batch_size=mbs, global_batch_size=256, precision="bf16"),
        cluster=ClusterConfig(name="slurm", kind="slurm", nodes=4, gpus_per_node=8),
        gpu="A100-40GB",
    )


def apply_overrides(cfg: JobConfig, overrides) -> JobConfig:
    """Apply ``group.key=value`` strings the way Hydra would (enough for the planner's keys)."""
    cfg = dataclasses.replace(
        cfg,
        **{
            f.name: dataclasses.replace(getattr(cfg, f.name))
            for f in dataclasses.fields(cfg)
            if dataclasses.is_dataclass(getattr(cfg, f.name))
        },
    )
    for item in overrides:
        key, value = item.split("=", 1)
        group, name = key.split(".")
        parsed = {"null": None, "true": True, "false": False}.get(value, value)
        if isinstance(parsed, str) and parsed.isdigit():
            parsed = int(parsed)
        setattr(getattr(cfg, group), name, parsed)
    return cfg


def shape(**kw) -> ModelShape:
    base = dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        seq_length=2048,
        vocab_size=SEED_VOCAB,
        max_position_embeddings=2048,
    )
    base.update(kw)
    return ModelShape(**base)


def layout(**kw) -> ParallelLayout:
    base = dict(
        world_size=32,
        pipeline_model_parallel_size=2,
        micro_batch_size=4,
        global_batch_size=256,
        num_layers=32,
        num_attention_heads=32,
        seq_length=2048,
        max_position_embeddings=2048,
    )
    base.update(kw)
    return ParallelLayout(**base)


# ---- parameters ---------------------------------------------------------------------------


def test_vocab_padding_follows_megatron():
    assert planner.padded_vocab_size(50257, 128, 1) == 50304
    assert planner.padded_vocab_size(50257, 128, 8) == 51200
    assert planner.padded_vocab_size(258, 128, 1) == 384
    assert planner.padded_vocab_size(258, 128, 2) == 512
    assert planner.BYTE_TOKENIZER_VOCAB == 258


def test_gpt_125m_has_about_124m_parameters():
    model = ModelConfig(**OmegaConf.to_container(OmegaConf.load(CONF / "model" / "gpt_125m.yaml")))
    lay = ParallelLayout(
        world_size=1, num_layers=12, num_attention_heads=12, seq_length=2048, max_position_embeddings=2048
    )
    plan = planner.plan_layout(
        lay, ModelShape.from_model_config(model, 50257), Recipe(), planner.gpu_preset("A100-80GB")
    )
    assert abs(plan.params_total - 124e6) / 124e6 < 0.02
    h = 768
    assert plan.params_per_layer == 12 * h * h + 13 * h  # Megatron GPT layer: 12h^2 + 13h


def test_stage_parameters_embedding_first_output_last():
    sh = shape()
    per_stage = planner._stage_params(sh, layout(), SEED_VOCAB)
    layer = 12 * 4096**2 + 13 * 4096
    emb, pos, final_norm = SEED_VOCAB * 4096, 2048 * 4096, 2 * 4096
    assert per_stage[0][0] == 16 * layer + emb + pos
    assert per_stage[1][0] == 16 * layer + final_norm + emb  # tied: the last stage keeps its own copy
    plan = planner.plan_layout(layout(), sh, Recipe(), planner.gpu_preset("A100-40GB"))
    assert plan.params_total == 32 * layer + emb + pos + final_norm  # the copy is not a new parameter
    untied = planner._stage_params(
        dataclasses.replace(sh, untie_embeddings_and_output_weights=True),
        layout(world_size=1, pipeline_model_parallel_size=1),
        SEED_VOCAB,
    )
    assert untied[0][0] == 32 * layer + 2 * emb + pos + final_norm


def test_tensor_parallel_shards_all_but_norms_and_row_biases():
    one = planner._stage_params(shape(), layout(), SEED_VOCAB)[0][3]
    two = planner._stage_params(shape(), layout(tensor_model_parallel_size=2), SEED_VOCAB)[0][3]
    h = 4096
    replicated = 16 * (4 * h + 2 * h) + 2048 * h  # per layer: two LayerNorms, two row-parallel biases; positions
    assert two == (one - replicated) // 2 + replicated


# ---- memory -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "precision,grads32,plain,fixed,sharded",
    [
        ("fp32", True, 16, 8, 8),  # Megatron-Core distributed optimizer guide: 16 / 8 + 8/d
        ("bf16", True, 18, 6, 12),  # 18 / 6 + 12/d
        ("bf16", False, 20, 4, 16),  # 20 / 4 + 16/d
    ],
)
def test_bytes_per_parameter_match_distributed_optimizer_guide(precision, grads32, plain, fixed, sharded):
    r = Recipe(precision=precision, grad_reduce_in_fp32=grads32)
    assert r.param_bytes + r.grad_bytes + r.optimizer_bytes == plain
    assert r.param_bytes + r.grad_bytes == fixed and r.optimizer_bytes == sharded
    d = 16
    plan = planner.plan_layout(
        layout(), shape(), dataclasses.replace(r, use_distributed_optimizer=True), planner.gpu_preset("H200")
    )
    st = plan.stages[0]
    assert st.optimizer == pytest.approx(st.params * sharded / d)
    assert st.optimizer_unsharded == st.params * sharded


def test_activations_match_korthikanti_closed_forms():
    # 2-byte activations, dropout on, f = 4h, GELU: the paper's setting (Korthikanti et al. 2022, sec. 4).
    sh = shape(hidden_dropout=0.1, attention_dropout=0.1)
    s, b, h, a = 2048, 4, 4096, 32
    sbh = s * b * h
    f = planner.layer_activation_bytes
    assert f(sh, layout(), 2) == pytest.approx(sbh * (34 + 5 * a * s / h))
    t = 4
    assert f(sh, layout(tensor_model_parallel_size=t), 2) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = layout(tensor_model_parallel_size=t, sequence_parallel=True)
    assert f(sh, sp, 2) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert f(sh, sp, 2, selective=True) == pytest.approx(34 * sbh / t)


def test_microbatches_in_flight_1f1b_and_interleaved():
    one_f = layout(world_size=4, pipeline_model_parallel_size=4, micro_batch_size=1, global_batch_size=8)
    assert [in_flight(one_f, r) for r in range(4)] == [4, 3, 2, 1]  # first stage holds p
    few = dataclasses.replace(one_f, global_batch_size=2)
    assert in_flight(few, 0) == 2  # never more than m
    inter = dataclasses.replace(one_f, virtual_pipeline_model_parallel_size=2)
    chunks = in_flight(inter, 0)
    p, v, L = 4, 2, 32
    # Korthikanti sec. 4.2.3: the first stage keeps L (1 + (p-1)/(p v)) layers' worth.
    assert Fraction(chunks * inter.layers_per_virtual_stage) == L * (1 + Fraction(p - 1, p * v))


def test_recomputation_shrinks_activations():
    plan = planner.plan_layout(layout(), shape(), Recipe(), planner.gpu_preset("A100-40GB"))
    a = plan.activations_by_recompute
    assert a["full"] < a["selective"] < a["none"]
    assert plan.worst.activations == a["none"]


# ---- time ---------------------------------------------------------------------------------


def test_bubble_closed_forms():
    # Narayanan et al. 2021 sec. 2.2: bubble/ideal = (p-1)/(v m); idle share = (p-1)/(v m + p - 1).
    assert planner.bubble(4, 8) == (pytest.approx(3 / 8), pytest.approx(3 / 11))
    assert planner.bubble(4, 8, 2) == (pytest.approx(3 / 16), pytest.approx(3 / 19))
    assert planner.bubble(1, 8) == (0.0, 0.0)
    plan = planner.plan_layout(
        layout(
            world_size=4,
            pipeline_model_parallel_size=4,
            micro_batch_size=1,
            global_batch_size=8,
            virtual_pipeline_model_parallel_size=2,
        ),
        shape(),
        Recipe(),
        planner.gpu_preset("H100"),
    )
    assert plan.bubble_fraction == pytest.approx(3 / 19)


def test_flops_match_narayanan():
    B, s, l, h, V = 256, 2048, 32, 4096, SEED_VOCAB
    model, hardware, _ = planner.flops_per_step(shape(), layout(), Recipe(), V)
    assert model == pytest.approx(72 * B * s * l * h * h * (1 + s / (12 * h) + V / (12 * l * h)), rel=1e-12)
    assert hardware == model
    full = Recipe(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    _, hw_full, _ = planner.flops_per_step(shape(), layout(), full, V)
    assert hw_full == pytest.approx(96 * B * s * l * h * h * (1 + s / (12 * h) + V / (16 * l * h)), rel=1e-12)


def test_step_time_without_pipeline_or_communication_is_flops_over_mfu():
    lay = layout(world_size=1, pipeline_model_parallel_size=1, global_batch_size=8)
    plan = planner.plan_layout(lay, shape(), Recipe(), planner.gpu_preset("H100"), mfu=0.5)
    assert plan.step_time_s == pytest.approx(plan.model_flops / (989e12 * 0.5))
    assert plan.mfu_predicted == pytest.approx(0.5)


# ---- the seed's model on 4 x 8 A100-40GB ---------------------------------------------------


@pytest.mark.parametrize("mbs", [4, 8])
def test_seed_plan_as_configured_does_not_fit(mbs):
    plan = planner.plan(seed_cfg(mbs), vocab_size=SEED_VOCAB)
    assert plan.layout.data_parallel_size == 16 and plan.layout.num_microbatches == 256 // (mbs * 16)
    assert not plan.fits
    st = plan.worst
    # Model states alone (2 + 4 + 12 bytes x 3.44 B parameters) exceed the 40 GiB.
    assert st.weights + st.gradients + st.optimizer > 40 * GiB
    assert plan.reason.startswith("does not fit: stage 0 needs") and "A100-40GB" in plan.reason
    text = format_plan(plan)
    for needle in (
        "world size 32 = TP 1 x PP 2 x CP 1 x DP 16",
        "layers per stage = 32 / 2 = 16",
        "with distributed optimizer (/DP 16)",
        "pipeline bubble (1F1B",
        "verdict: does not fit",
    ):
        assert needle in text


def test_seed_plan_with_distributed_optimizer_and_recompute_fits_at_both_micro_batches():
    fits = {}
    for mbs in (4, 8):
        cfg = seed_cfg(mbs, use_distributed_optimizer=True)
        cfg.model.recompute_granularity, cfg.model.recompute_method, cfg.model.recompute_num_layers = (
            "full",
            "uniform",
            1,
        )
        plan = planner.plan(cfg, vocab_size=SEED_VOCAB)
        fits[mbs] = plan.fits
        # fits within the device (MBS 8: 96% of it, above plan_headroom=0.85 -> said "tight")
        assert plan.reason.startswith("tight" if plan.peak_bytes > 0.85 * plan.gpu.memory_bytes else "fits")
    assert fits == {4: True, 8: True}


@pytest.mark.parametrize("mbs", [4, 8])
def test_seed_suggestions_are_valid_fit_and_reproduce(mbs):
    cfg = seed_cfg(mbs)
    suggestions = suggest.suggest(cfg, vocab_size=SEED_VOCAB, limit=5)
    assert len(suggestions) == 5
    times = [s.plan.step_time_s for s in suggestions]
    assert times == sorted(times)
    for s in suggestions:
        lay = s.plan.layout
        assert lay.problems() == [] and planner.recipe_problems(s.plan.recipe, lay) == []
        assert s.plan.fits and lay.world_size == 32 and lay.global_batch_size == 256
        assert lay.tensor_model_parallel_size <= 8
        again = planner.plan(apply_overrides(cfg, s.overrides), vocab_size=SEED_VOCAB)
        assert again.fits and again.step_time_s == pytest.approx(s.plan.step_time_s)
    text = suggest.format_suggestions(suggestions)
    assert suggestions[0].overrides[0] in text and "fastest first" in text


# ---- entry-point behaviour ------------------------------------------------------------------


def test_unknown_gpu_names_the_key_and_presets():
    with pytest.raises(ConfigError) as info:
        planner.plan(seed_cfg(4), gpu="V100")
    msg = str(info.value)
    assert "gpu='V100'" in msg and all(name in msg for name in ("A100-40GB", "A100-80GB", "H100", "H200"))
    assert planner.gpu_preset("h200").name == "H200"


def test_a_cpu_job_is_planned_on_this_machine_unless_gpu_names_a_preset():
    cfg = JobConfig()  # gpt_tiny on one CPU process, byte tokenizer, no gpu=
    plan = planner.plan(cfg)
    assert plan.gpu.name == "cpu" and plan.gpu.memory_bytes == host_memory_bytes()  # one rank: all of it
    assert plan.padded_vocab_size == 384 and plan.fits and plan.profile is not None  # the CPU's profile prices it
    assert any(n.startswith("planned for this machine's CPU (the job runs on CPU; gpu=NAME") for n in plan.notes)
    on_gpu = planner.plan(dataclasses.replace(cfg, gpu="A100-80GB"))
    assert on_gpu.gpu.name == "A100-80GB" and on_gpu.gpu.memory_bytes == 80 * 2**30 and on_gpu.profile is None
    assert any("runs on CPU; memory and time are for the A100-80GB preset" in n for n in on_gpu.notes)
    assert on_gpu.step_time_s < plan.step_time_s / 100  # an A100's step, not this machine's
    for c in (cfg, dataclasses.replace(cfg, gpu="A100-80GB")):
        assert suggest.suggest(c) == []  # fits, no bubble: nothing to suggest
        assert all(not s.plan.recipe.use_distributed_optimizer for s in suggest.suggest(c, always=True))


@pytest.mark.parametrize(
    "parallelism,model,training,numbers",
    [
        (dict(pipeline_model_parallel_size=4), dict(num_layers=30), dict(global_batch_size=4), ["30 % 4"]),
        (
            dict(pipeline_model_parallel_size=16, virtual_pipeline_model_parallel_size=2),
            dict(num_layers=80),
            dict(global_batch_size=32),
            ["32 chunks"],
        ),
        (
            dict(pipeline_model_parallel_size=6, virtual_pipeline_model_parallel_size=2),
            dict(num_layers=24),
            dict(global_batch_size=3),
            ["num_microbatches >= 6", "= 3"],
        ),
        (dict(), dict(), dict(global_batch_size=24), ["24 % 16 = 8", "[16, 32, 48]"]),
        (
            dict(pipeline_model_parallel_size=2, expert_model_parallel_size=8),
            dict(num_moe_experts=8),
            dict(global_batch_size=8),
            ["expert grid", "= 16 does not divide world size 8"],
        ),
        (
            dict(pipeline_model_parallel_size=2, data_parallel_size=2),
            dict(num_layers=32),
            dict(global_batch_size=16),
            ["data_parallel_size=2 disagrees"],
        ),
    ],
)
def test_field_notes_cases_end_in_layout_error(parallelism, model, training, numbers):
    tasks = {16: 16, 32: 16, 24: 16, 8: 8, 4: 4, 3: 6}[training["global_batch_size"]]
    if parallelism.get("data_parallel_size"):
        tasks = 32
    cfg = JobConfig(
        parallelism=ParallelismConfig(**parallelism),
        model=ModelConfig(num_attention_heads=8, **model),
        training=TrainingConfig(micro_batch_size=1, **training),
        cluster=ClusterConfig(name="slurm", kind="slurm", nodes=1, gpus_per_node=tasks),
    )
    with pytest.raises(LayoutError) as info:
        planner.plan(cfg)
    assert all(n in str(info.value) for n in numbers), str(info.value)


def test_suggest_repairs_an_invalid_layout():
    cfg = JobConfig(
        parallelism=ParallelismConfig(pipeline_model_parallel_size=4),
        model=ModelConfig(num_layers=30),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=4),
        cluster=ClusterConfig(name="slurm", kind="slurm", nodes=1, gpus_per_node=4),
    )
    suggestions = suggest.suggest(cfg, limit=3)
    assert suggestions and all(30 % s.plan.layout.pipeline_model_parallel_size == 0 for s in suggestions)


def test_a_100_point_grid_plans_quickly():
    sh, rec, gpu = shape(), Recipe(), planner.gpu_preset("A100-80GB")
    grid = [
        layout(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            micro_batch_size=mbs,
            sequence_parallel=tp > 1,
            world_size=128,
            global_batch_size=2048,
        )
        for tp in (1, 2, 4, 8)
        for pp in (1, 2, 4, 8, 16)
        for mbs in (1, 2, 4, 8, 16)
    ]
    assert len(grid) == 100
    start = time.perf_counter()
    plans = [planner.plan_layout(lay, sh, rec, gpu) for lay in grid]
    assert time.perf_counter() - start < 5.0  # loose sanity bound; the real figure is in bench/
    assert len(plans) == 100


def test_planning_imports_neither_torch_nor_megatron():
    code = (
        "import sys, orchestrator.config.schema, orchestrator.config.layout, orchestrator.config.checks, orchestrator.plan.memory, orchestrator.plan.report, orchestrator.plan.suggest, "
        "orchestrator.errors;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_local_suggestions_keep_the_world_size():
    # cluster=local without tasks_per_node: world = TP x PP x CP x DP, so DP must stay stated.
    cfg = JobConfig(parallelism=ParallelismConfig(pipeline_model_parallel_size=2, data_parallel_size=2))
    suggestions = suggest.suggest(cfg, always=True)
    assert suggestions
    for s in suggestions:
        again = planner.plan(apply_overrides(cfg, s.overrides))
        assert again.layout.world_size == 4
        assert again.step_time_s == pytest.approx(s.plan.step_time_s)
