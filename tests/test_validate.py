"""The one validate against megatron-core itself: seeded random configs, accepted or refused in one line.

Configs are composed from conf/ (every group) and then perturbed field by field with valid, invalid
and edge values. Each must either be refused by ``validate`` with one ``ConfigError``/``LayoutError``
line (never another exception, never a traceback), or be accepted — and then megatron-core's own
``TransformerConfig`` (built by the runtime's own builder, ``runtime/rank/megatron_config.py``) and parallel-state
arithmetic (``initialize_model_parallel``'s divisibility rules and ``RankGenerator`` groups) accept it
too, and the planner (``plan=true``) prices it without crashing. In-process, CPU only, no process group.
"""

from __future__ import annotations

import copy
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from orchestrator.config.checks import runs_on_cpu, validate
from orchestrator.config.compose import compose_config
from orchestrator.errors import ConfigError, OrchestratorError

SEED = 20251201
COUNT = 600

BASES = [
    [],
    ["+experiment=gpt_pp2_dp2"],
    ["parallelism=tp2_pp2", "cluster.tasks_per_node=4"],
    ["parallelism=pp2_vpp2_dp2", "training.global_batch_size=32"],
    ["parallelism=pp4", "optimizer=sgd"],
    [
        "data=mock",
        "model=gpt_125m",
        "cluster=slurm",
        "parallelism.data_parallel_size=null",
        "training.precision=bf16",
        "training.micro_batch_size=1",
        "training.global_batch_size=64",
    ],
    [
        "model=gpt_1.3b",
        "cluster=slurm_a100_4x8",
        "parallelism=pp2_dp2",
        "parallelism.data_parallel_size=null",
        "training.precision=bf16",
        "training.micro_batch_size=2",
        "training.global_batch_size=256",
    ],
    ["+experiment=gpt_pp2_dp2", "cluster=slurm_dev"],
]

PARALLEL = [1, 1, 2, 2, 4, 8, 3, 0, -2]
PERTURB = {
    "parallelism.tensor_model_parallel_size": PARALLEL,
    "parallelism.pipeline_model_parallel_size": PARALLEL,
    "parallelism.virtual_pipeline_model_parallel_size": [None, None, 2, 4, 1, 0, -1],
    "parallelism.context_parallel_size": [1, 1, 1, 2, 0],
    "parallelism.expert_model_parallel_size": [1, 1, 1, 2, 4, 0],
    "parallelism.data_parallel_size": [None, None, 1, 2, 4, 8, 0, -2],
    "parallelism.sequence_parallel": [False, False, True],
    "parallelism.distributed_backend": ["auto", "gloo", "nccl", "mpi"],
    "model.num_layers": [1, 2, 4, 8, 12, 24, 30, 0, -1],
    "model.hidden_size": [64, 128, 256, 512, 96, 130, 0],
    "model.num_attention_heads": [1, 2, 4, 8, 16, 3, 0],
    "model.num_query_groups": [None, None, 1, 2, 4, 8, 3, 0],
    "model.ffn_hidden_size": [None, None, 256, 512, 300, 0],
    "model.seq_length": [64, 128, 256, 100, 0],
    "model.max_position_embeddings": [128, 256, 2048, 64, 0],
    "model.position_embedding_type": ["learned_absolute", "rope", "alibi"],
    "model.normalization": ["LayerNorm", "RMSNorm", "layernorm"],
    "model.activation": ["gelu", "swiglu", "relu"],
    "model.add_bias_linear": [True, False],
    "model.make_vocab_size_divisible_by": [128, 64, 1, 0],
    "model.hidden_dropout": [0.0, 0.1, 0.5, 0.999, 1.0, 1.5, -0.1, float("nan")],
    "model.attention_dropout": [0.0, 0.1, 1.0, -0.5],
    "model.init_method_std": [0.02, 0.006, 0.0, -1.0],
    "model.num_moe_experts": [None, None, None, 2, 4, 8, 1, 0],
    "model.recompute_granularity": [None, None, "full", "selective", "partial"],
    "model.recompute_method": [None, "uniform", "block", "all"],
    "model.recompute_num_layers": [None, 1, 2, 4, 100, 0],
    "model.transformer_impl": ["auto", "local", "transformer_engine", "te"],
    "optimizer.lr": [1e-3, 3e-4, 1.0, 0.0, -1e-3, float("inf")],
    "optimizer.min_lr": [0.0, 1e-5, 1e-4, 1.0, -1.0],
    "optimizer.weight_decay": [0.0, 0.01, 0.1, -3.0],
    "optimizer.adam_beta1": [0.9, 0.0, 0.99, 1.0, -0.1],
    "optimizer.adam_beta2": [0.95, 0.999, 1.0, 2.0],
    "optimizer.adam_eps": [1e-8, 1e-5, 0.0, -1e-8],
    "optimizer.clip_grad": [1.0, 0.0, 10.0, -1.0],
    "optimizer.lr_decay_style": ["cosine", "linear", "constant", "wsd"],
    "optimizer.lr_warmup_iters": [0, 10, 1000, -5],
    "optimizer.lr_decay_iters": [None, 100, 1, 0],
    "optimizer.use_distributed_optimizer": [False, True],
    "optimizer.name": ["adam", "sgd", "lamb"],
    "data.kind": ["stdlib", "jsonl", "indexed", "mock", "parquet"],
    "data.paths": [[], ["{jsonl}"], ["{jsonl}", "{jsonl2}"], ["{prefix}"], ["/nonexistent/a.jsonl"]],
    "data.weights": [None, [1.0], [0.5, 0.5], [0.7], [1.0, -1.0]],
    "data.tokenizer": ["byte", "byte", "{tokenizer}", "/nonexistent/tokenizer.json"],
    "data.split": ["98,2,0", "100,0,0", "99,1", "0,100,0", "a,b", "1,2,3,4"],
    "data.json_key": ["text", "content", ""],
    "training.micro_batch_size": [1, 2, 4, 8, 3, 0, -4],
    "training.global_batch_size": [1, 4, 8, 16, 32, 64, 256, 18, 0],
    "training.train_iters": [0, 1, 20, 200, -1],
    "training.log_interval": [1, 10, 0, -1],
    "training.eval_interval": [None, 1, 100, 0],
    "training.eval_iters": [0, 1, 10, -1],
    "training.seed": [0, 1234, 2**32 - 1, 2**32, -1],
    "training.precision": ["fp32", "bf16", "fp16", "fp8"],
    "training.device": ["auto", "cpu", "cuda", "tpu"],
    "training.exit_after_iters": [None, 1, 5, 0],
    "cluster.tasks_per_node": [None, None, 1, 2, 4, 8, 6, 0],
    "cluster.nodes": [1, 1, 2, 4, 0],
    "cluster.gpus_per_node": [0, 4, 8, -1],
    "cluster.timeout_min": [60, 15, 1, 0],
    "cluster.signal_delay_s": [90, 0, 3600, -1],
    "checkpoint.save_interval": [None, 0, 1, 50, -1],
    "run.name": ["ok", "gpt_pp2_dp2-parallelism=tp2_pp2", "../../x", "a/b", "", ".."],
}
"""Per key: values Megatron accepts, edge values, and values it must be protected from."""

ONE_LINE = re.compile(r"^\S.*[a-z_]+\.[a-z_]+")  # one line naming at least one config key


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """Real files for the data options: two JSONL files, an indexed prefix, a tokenizer.json."""
    root = tmp_path_factory.mktemp("data")
    (root / "a.jsonl").write_text('{"text": "hello"}\n')
    (root / "b.jsonl").write_text('{"text": "world"}\n')
    for ext in (".bin", ".idx"):
        (root / f"corpus{ext}").write_bytes(b"\0")
    (root / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0, "b": 1, "</s>": 2}}}')
    (root / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    return {
        "jsonl": str(root / "a.jsonl"),
        "jsonl2": str(root / "b.jsonl"),
        "prefix": str(root / "corpus"),
        "tokenizer": str(root / "tokenizer.json"),
    }


def _fill(value, files):
    if isinstance(value, str) and value.startswith("{"):
        return value.format(**files)
    if isinstance(value, list):
        return [_fill(v, files) for v in value]
    return value


def _set(cfg, key: str, value) -> None:
    section, field = key.rsplit(".", 1)
    node = cfg
    for part in section.split("."):
        node = getattr(node, part)
    setattr(node, field, value)


def megatron_parallel_groups(layout) -> int:
    """megatron-core's ``initialize_model_parallel`` arithmetic for ``layout``, without a process group.

    The same divisibility rules it raises on, then its own ``RankGenerator`` for the dense and the
    expert grids (which asserts on inconsistent sizes); returns the data-parallel size it derives.
    """
    from megatron.core.parallel_state import RankGenerator

    world, tp, pp = layout.world_size, layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    cp, ep = layout.context_parallel_size, layout.expert_model_parallel_size
    vpp = layout.virtual_pipeline_model_parallel_size if layout.vpp > 1 else None  # as runtime/rank/model.py passes it
    assert world % (tp * pp * cp) == 0, "world_size is not divisible by tp x pp x cp"
    assert vpp is None or pp > 1, "pipeline-model-parallel size should be greater than 1 with interleaved schedule"
    dp = world // (tp * pp * cp)
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order)
    assert world % (tp * ep * pp) == 0, "world_size is not divisible by expert tp x ep x pp"
    expert = RankGenerator(tp=tp, ep=ep, dp=world // (tp * ep * pp), pp=pp, cp=1, order=order)
    assert dense.get_ranks("pp") == expert.get_ranks("pp")
    for token, size in (("tp", tp), ("pp", pp), ("dp", dp), ("cp", cp)):
        groups = dense.get_ranks(token)
        assert sorted(r for g in groups for r in g) == list(range(world)) and {len(g) for g in groups} == {size}
    return dp


def test_random_configs_are_refused_in_one_line_or_accepted_by_megatron(files):
    from orchestrator.plan import memory as planner
    from orchestrator.runtime.rank.mcore import version
    from orchestrator.runtime.rank.megatron_config import Installed, build

    bases = [compose_config(b + ["run.root=/tmp/orchestrator-test-validate"]) for b in BASES]
    rng = random.Random(SEED)
    keys = sorted(PERTURB)
    outcomes: Counter = Counter()
    first_words: Counter = Counter()
    for i in range(COUNT):
        cfg = copy.deepcopy(rng.choice(bases))
        changes = {k: _fill(rng.choice(PERTURB[k]), files) for k in rng.sample(keys, rng.choice([1, 1, 2, 2, 3, 4]))}
        for key, value in changes.items():
            _set(cfg, key, value)
        where = f"config #{i}: {changes}"
        try:
            layout = validate(cfg)
        except ConfigError as exc:
            message = str(exc)
            assert "\n" not in message and ONE_LINE.match(message), f"{where}: not one line: {message!r}"
            outcomes["refused"] += 1
            first_words[message.split(":")[0].split("=")[0].split(" ")[0]] += 1
            continue
        except Exception as exc:  # pragma: no cover - the failure this test exists to catch
            pytest.fail(f"{where}: validate raised {type(exc).__name__}: {exc}")
        outcomes["accepted"] += 1
        device = "cpu" if runs_on_cpu(cfg) else "cuda"
        try:
            tf = build(
                cfg, device, Installed(device == "cuda", False, version()), layout.data_parallel_size
            ).transformer
            dp = megatron_parallel_groups(layout)
        except Exception as exc:
            pytest.fail(f"{where}: validate accepted it but megatron-core refuses: {type(exc).__name__}: {exc}")
        assert dp == layout.data_parallel_size, where
        assert (
            tf.num_layers == cfg.model.num_layers and tf.tensor_model_parallel_size == layout.tensor_model_parallel_size
        )
        assert layout.num_microbatches * layout.micro_batch_size * dp == cfg.training.global_batch_size, where
        try:
            planner.plan(cfg)
        except OrchestratorError as exc:  # the gpu preset: not a layout matter
            pytest.fail(f"{where}: validate accepted it but the planner refuses: {exc}")
    # Both sides are exercised, and refusals come from many different rules.
    assert outcomes["accepted"] >= COUNT // 5 and outcomes["refused"] >= COUNT // 5, outcomes
    assert len(first_words) >= 25, first_words
    print(f"{COUNT} configs: {dict(outcomes)}; refusals by first key: {len(first_words)} keys")


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.num_query_groups=0", "plan=true"], "model.num_query_groups=0: must be a positive integer"),
        (
            [
                "parallelism.overlap_param_gather=true",
                "cluster=slurm_a100_4x8",
                "parallelism.data_parallel_size=null",
                "training.global_batch_size=128",
            ],
            "parallelism.overlap_param_gather=true: only the distributed optimizer gathers parameters",
        ),
        (["parallelism.data_parallel_size=-2"], "parallelism.data_parallel_size=-2: must be a positive integer"),
        (["cluster.tasks_per_node=0"], "cluster.tasks_per_node=0: must be a positive integer"),
        (["training.log_interval=0"], "training.log_interval=0: must be a positive integer"),
        (["model.hidden_dropout=1.5"], "model.hidden_dropout=1.5: must be a finite number in [0, 1)"),
        (["optimizer.weight_decay=-3"], "optimizer.weight_decay=-3.0: must be a finite number >= 0"),
        (["model.recompute_granularity=full"], "model.recompute_method=null: recompute_granularity=full needs"),
        (
            ["model.transformer_impl=transformer_engine"],
            "model.transformer_impl=transformer_engine: Transformer Engine runs on GPUs only",
        ),
        (["data=jsonl"], "data.paths=[]: data=jsonl needs at least one JSONL file"),
        (
            ["parallelism=tp2_pp2", "parallelism.sequence_parallel=true"],
            "parallelism.sequence_parallel=true: megatron-core's sequence-parallel layers need GPUs",
        ),
        (["run.name=../../x"], "run.name='../../x': must be one directory name"),
        (["plan_picture=pp4.png"], "plan_picture='pp4.png': drawn only by the plan"),
        # Megatron-LM's ramp rules (MBS 4 x DP 2 = 8 per ramp step on gpt_pp2_dp2, GBS 16)
        (
            ["+experiment=gpt_pp2_dp2", "training.rampup_batch_size=[4,8,64]"],
            "training.rampup_batch_size=[4,8,64]: the start (4) is not divisible by training.micro_batch_size x DP "
            "= 4 x 2 = 8",
        ),
        (
            ["+experiment=gpt_pp2_dp2", "training.global_batch_size=32", "training.rampup_batch_size=[8,16,64]"],
            "training.rampup_batch_size=[8,16,64]: training.global_batch_size - start = 32 - 8 = 24 is not divisible",
        ),
        (
            ["+experiment=gpt_pp2_dp2", "training.rampup_batch_size=[16,8,64]"],
            "training.rampup_batch_size=[16,8,64]: the start batch 16 must be below training.global_batch_size=16",
        ),
        (
            ["+experiment=gpt_pp2_dp2", "training.rampup_batch_size=[8,0,64]"],
            "training.rampup_batch_size=[8,0,64]: must be null or three positive integers",
        ),
        (
            ["parallelism=pp2_vpp2_dp2", "training.global_batch_size=64", "training.rampup_batch_size=[8,8,64]"],
            "training.rampup_batch_size=[8,8,64]: the interleaved schedule needs every ramp batch's num_microbatches",
        ),
    ],
)
def test_the_issue_list_is_refused_by_validate(overrides, expected):
    cfg = compose_config(overrides + ["run.root=/tmp/orchestrator-test-validate"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert str(info.value).startswith(expected) and "; fix: " in str(info.value)


@pytest.mark.parametrize(
    "overrides,fix,fixed",
    [
        (
            ["model.seq_length=100000"],
            "model.max_position_embeddings=100000 (or model.seq_length=128)",
            True,
        ),
        (
            ["parallelism.tensor_model_parallel_size=3"],
            "parallelism.tensor_model_parallel_size=2 (one of [1, 2, 4])",
            False,  # TP=2 then wants 2 ranks: another rule's fix
        ),
        (
            ["model.num_attention_heads=5"],
            "model.hidden_size=130 (a multiple of 5) or model.num_attention_heads=4",
            True,
        ),
        (["model.hidden_size=130"], "model.hidden_size=132 (a multiple of 4) or model.num_attention_heads=5", True),
        (["parallelism.sequence_parallel=true"], "parallelism.sequence_parallel=false", True),
    ],
)
def test_a_layout_fix_names_the_full_key_and_a_value_typed_as_shown(overrides, fix, fixed):
    """README: a fix naming an override works in bash as printed (it said ``max_position_embeddings >= 100000``,
    ``tensor_model_parallel_size one of [1, 2, 4]``, ``hidden_size a multiple of 5``)."""
    base = overrides + ["run.root=/tmp/orchestrator-test-validate"]
    with pytest.raises(ConfigError) as info:
        validate(compose_config(base))
    assert fix in re.findall(r"; fix: (.*?)(?= \| |$)", str(info.value)), str(info.value)
    if fixed:  # the override as printed, appended: that rule holds
        validate(compose_config(base + [fix.split(" ")[0]]))


def test_recompute_rule_is_one_rule_for_validate_and_planner():
    from orchestrator.plan import memory as planner

    cfg = compose_config(
        [
            "+experiment=gpt_pp2_dp2",
            "model.recompute_granularity=full",
            "model.recompute_method=uniform",
            "model.recompute_num_layers=3",
        ]
    )
    with pytest.raises(ConfigError) as by_validate:
        validate(cfg)
    layout = planner.layout_from_config(cfg)
    assert planner.recipe_problems(planner.recipe_of(cfg), layout) == [str(by_validate.value)]
    assert "between 1 and the layers per pipeline rank (2)" in str(by_validate.value)


def test_transformer_engine_is_looked_up_where_the_job_runs():
    """A local GPU job needs Transformer Engine in this Python; a SLURM job's nodes have their own, so
    the launcher's lack of it refuses nothing there."""
    import importlib.util

    common = [
        "model=gpt_125m",
        "training.precision=bf16",
        "model.transformer_impl=transformer_engine",
        "training.micro_batch_size=1",
        "training.global_batch_size=64",
        "parallelism.data_parallel_size=null",
    ]
    assert validate(compose_config(common + ["cluster=slurm"])).world_size == 8
    local_gpu = compose_config(common + ["cluster.gpus_per_node=1", "cluster.tasks_per_node=1"])
    if importlib.util.find_spec("transformer_engine") is not None:
        assert validate(local_gpu).world_size == 1
    else:
        with pytest.raises(ConfigError, match="transformer_engine package is not installed here"):
            validate(local_gpu)


def test_data_options_name_the_path(tmp_path):
    a = tmp_path / "a.jsonl"
    a.write_text('{"text": "x"}\n')
    ok = compose_config(["data=jsonl", f"data.paths=[{a},{a}]", "data.weights=[0.5,0.5]"])
    assert validate(ok).world_size == 1
    cases = {
        (f"data.paths=[{a},{tmp_path}/b.jsonl]",): f"data.paths[1]='{tmp_path}/b.jsonl': no such file",
        (f"data.paths=[{a}]", "data.weights=[0.5,0.5]"): "data.weights=[0.5, 0.5]: 2 weights for 1 data.paths",
        (f"data.paths=[{a},{a}]", "data.weights=[1,0]"): "data.weights[1]=0.0: must be a finite number > 0",
        (f"data.paths=[{a}]", f"data.tokenizer={tmp_path}/tok.json"): f"data.tokenizer='{tmp_path}/tok.json': no such",
    }
    for overrides, expected in cases.items():
        with pytest.raises(ConfigError) as info:
            validate(compose_config(["data=jsonl", *overrides]))
        assert str(info.value).startswith(expected), (overrides, str(info.value))
    with pytest.raises(ConfigError, match=r"^data.paths\[0\]='.*corpus': .*corpus.bin and .idx not found"):
        validate(compose_config(["data=indexed", f"data.paths=[{tmp_path}/corpus]"]))


def test_experiment_runs_are_named_by_the_groups_chosen():
    base = compose_config(["+experiment=gpt_pp2_dp2"])
    other = compose_config(["+experiment=gpt_pp2_dp2", "parallelism=tp2_pp2", "cluster=slurm_dev"])
    kept = compose_config(["+experiment=gpt_pp2_dp2", "training.train_iters=300"])
    named = compose_config(["+experiment=gpt_pp2_dp2", "parallelism=tp2_pp2", "run.name=mine"])
    assert base.run.name == kept.run.name == "gpt_pp2_dp2"
    assert other.run.name == "gpt_pp2_dp2-parallelism=tp2_pp2"
    assert Path(other.run.dir) == Path("runs/gpt_pp2_dp2-parallelism=tp2_pp2").absolute()
    assert named.run.name == "mine" and compose_config([]).run.name == "gpt_tiny_none"


KEY_WORDS = ["x", "foo", "name", "env", "paths", "micro_batch", "trainng", "seq_len", "hydra", "experiment", "0", "_"]
"""Junk and near-miss names for the key fuzz (beside every real section, field and group name)."""


def _fuzzed_key(rng: random.Random, sections: dict, top: list, groups: list) -> str:
    """A random override key: real names, near misses and junk, 1-4 parts deep, under sections or values."""
    parts = [rng.choice(top + groups + KEY_WORDS)]
    for _ in range(rng.choice([0, 1, 1, 1, 2, 3])):
        fields = sections.get(parts[-1])
        pool = (fields if fields and rng.random() < 0.7 else []) or KEY_WORDS + top
        name = rng.choice(pool)
        if rng.random() < 0.15 and len(name) > 3:  # a misspelling: one character dropped
            cut = rng.randrange(len(name))
            name = name[:cut] + name[cut + 1 :]
        parts.append(name)
    return ".".join(parts)


def test_random_override_keys_are_refused_in_one_line_or_planned(tmp_path):
    """Override *keys*, fuzzed: unknown, nested, under values (``plan.x``), near misses, with ``+``,
    ``++`` and ``~``. Through the real entry point, in one interpreter: each is planned (exit 0) or
    refused with one ``error:`` line, exit 2 — never a traceback."""
    import dataclasses

    from test_cli import assert_one_error_line, run_batch

    from orchestrator.config.compose import group_options
    from orchestrator.config.schema import JobConfig

    top = [f.name for f in dataclasses.fields(JobConfig)]
    sections = {}
    for f in dataclasses.fields(JobConfig):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            sections[f.name] = [g.name for g in dataclasses.fields(sub)]
    groups = list(group_options())
    rng = random.Random(SEED)
    cases = [
        ["plan.x=1"],
        ["dry_run.y=1"],
        ["gpu.z=1"],
        ["run.name.x=1"],
        ["training.x.y=1"],
        ["+plan.x=1"],
        ["~plan.x"],
        ["++training.x.y=1"],
        ["experiment.x=1"],
        ["model=null"],
        ["++model=gpt_tiny"],
        ["hydra=true"],
    ]
    for _ in range(300):
        key, prefix = _fuzzed_key(rng, sections, top, groups), rng.choice(["", "", "+", "++", "~"])
        value = "" if prefix == "~" else "=" + rng.choice(["1", "true", "x", "[1,2]", "null", "gpt_tiny"])
        cases.append(rng.choice(BASES) + [prefix + key + value])
    results = run_batch([c + ["plan=true", f"run.root={tmp_path}/runs"] for c in cases], tmp_path)
    planned = 0
    for result in results:
        if result["code"] == 0:
            assert "layers per stage" in result["stdout"] and result["stderr"] == "", result
            planned += 1
        else:
            assert_one_error_line(result)
    for result in results[:12]:
        assert result["code"] == 2, result
    assert "the keys of training are" in results[4]["stderr"] and "plan is a value" in results[0]["stderr"]
    assert 0 < planned < len(cases) // 2, planned
    assert list(tmp_path.iterdir()) == [], "a refusal or a plan wrote something"
    print(f"{len(cases)} fuzzed override keys: {planned} planned, {len(cases) - planned} refused in one line")
