"""Megatron's layout rules, one test per rule and per reported case (../shared/docs/FIELD_NOTES.md).

Each failing input must end in a LayoutError whose message carries the numbers involved, so a user
sees the arithmetic before the job is queued. Plain Python: no torch, no megatron.
"""

import pytest

from orchestrator.config.layout import ParallelLayout, layout_from_config, world_size_of
from orchestrator.config.schema import ClusterConfig, JobConfig, ModelConfig, ParallelismConfig, TrainingConfig
from orchestrator.errors import ConfigError, LayoutError


def lay(**kw) -> ParallelLayout:
    base = dict(
        world_size=8,
        micro_batch_size=1,
        global_batch_size=8,
        num_layers=8,
        num_attention_heads=8,
        seq_length=128,
        max_position_embeddings=128,
    )
    base.update(kw)
    return ParallelLayout(**base)


def error_of(layout: ParallelLayout) -> str:
    with pytest.raises(LayoutError) as info:
        layout.validate()
    return str(info.value)


def slurm_cfg(nodes, gpus, parallelism, model=None, training=None) -> JobConfig:
    return JobConfig(
        parallelism=parallelism,
        model=model or ModelConfig(),
        training=training or TrainingConfig(),
        cluster=ClusterConfig(name="slurm", kind="slurm", nodes=nodes, gpus_per_node=gpus),
    )


# ---- "Megatron constraints worth knowing" ---------------------------------------------------


def test_world_size_must_divide_by_model_parallel_product():
    msg = error_of(lay(world_size=12, pipeline_model_parallel_size=8, global_batch_size=12))
    assert "world size 12" in msg and "= 8" in msg and "divisors: [1, 2, 3, 4, 6, 12]" in msg


def test_dp_is_derived_from_world_size():
    layout = lay(
        world_size=32,
        pipeline_model_parallel_size=2,
        micro_batch_size=4,
        global_batch_size=256,
        num_layers=32,
        num_attention_heads=32,
    ).validate()
    assert layout.data_parallel_size == 16
    assert layout.num_microbatches == 4  # 256 / (4 x 16)
    assert "world size 32 = TP 1 x PP 2 x CP 1 x DP 16" in layout.summary()
    assert "256 / (4 x 16) = 4" in layout.summary()


def test_global_batch_must_divide_by_micro_batch_times_dp():
    msg = error_of(lay(world_size=4, micro_batch_size=2, global_batch_size=10))
    assert "10 % 8 = 2" in msg and "[8, 16, 24]" in msg


def test_layers_must_split_evenly_over_pipeline():
    msg = error_of(lay(world_size=4, pipeline_model_parallel_size=4, num_layers=30, global_batch_size=4))
    assert "num_layers=30" in msg and "pipeline_model_parallel_size=4" in msg and "30 % 4 = 2" in msg


def test_interleaved_needs_microbatches_multiple_of_pp():
    # m = 8 >= PP = 6 but not a multiple of it: still refused (megatron-core's group size defaults to PP).
    msg = error_of(
        lay(
            world_size=6,
            pipeline_model_parallel_size=6,
            virtual_pipeline_model_parallel_size=2,
            num_layers=24,
            global_batch_size=8,
        )
    )
    assert "num_microbatches >= 6" in msg and "multiple of pipeline_model_parallel_size=6" in msg and "= 8" in msg
    ok = lay(
        world_size=6,
        pipeline_model_parallel_size=6,
        virtual_pipeline_model_parallel_size=2,
        num_layers=24,
        global_batch_size=12,
    )
    assert ok.validate().interleaved


def test_interleaved_needs_pipeline():
    msg = error_of(lay(virtual_pipeline_model_parallel_size=2))
    assert "virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1" in msg


def test_heads_must_divide_by_tp():
    msg = error_of(lay(world_size=3, tensor_model_parallel_size=3, num_attention_heads=32, global_batch_size=3))
    assert "num_attention_heads=32" in msg and "tensor_model_parallel_size=3" in msg


def test_query_groups_multiple_or_divisor_of_tp():
    msg = error_of(
        lay(world_size=4, tensor_model_parallel_size=4, num_attention_heads=24, num_query_groups=6, global_batch_size=4)
    )
    assert "num_query_groups=6" in msg and "tensor_model_parallel_size=4" in msg
    # megatron-core 0.16.1 replicates key/value heads when TP > groups (groups divides TP): valid.
    lay(world_size=8, tensor_model_parallel_size=8, num_attention_heads=32, num_query_groups=2).validate()
    lay(world_size=2, tensor_model_parallel_size=2, num_attention_heads=32, num_query_groups=8).validate()


def test_sequence_parallel_needs_tp():
    msg = error_of(lay(sequence_parallel=True))
    assert "sequence_parallel=true needs tensor_model_parallel_size > 1" in msg


def test_stated_dp_must_agree_with_world_size():
    # The seed's "--data-parallel-size 2" on 4 x 8 GPUs with TP 1 x PP 2 (Megatron has no such flag).
    cfg = slurm_cfg(
        4,
        8,
        ParallelismConfig(pipeline_model_parallel_size=2, data_parallel_size=2),
        ModelConfig(
            num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048, max_position_embeddings=2048
        ),
        TrainingConfig(micro_batch_size=4, global_batch_size=256),
    )
    msg = error_of(layout_from_config(cfg))
    assert "data_parallel_size=2 disagrees" in msg
    assert "32 / (1 x 2 x 1) = 16" in msg and "run 4 tasks" in msg


def test_split_rank_option_is_not_part_of_the_schema():
    # --pipeline-model-parallel-split-rank is an encoder-decoder option; GPT configs cannot carry it.
    assert not hasattr(ParallelismConfig(), "pipeline_model_parallel_split_rank")


def test_sequence_longer_than_positions():
    msg = error_of(lay(seq_length=256, max_position_embeddings=128))
    assert "seq_length=256 exceeds model.max_position_embeddings=128" in msg
    lay(seq_length=256, max_position_embeddings=128, position_embedding_type="rope").validate()


def test_context_parallel_needs_seq_multiple_of_2cp():
    msg = error_of(
        lay(world_size=4, context_parallel_size=4, seq_length=100, max_position_embeddings=128, global_batch_size=2)
    )
    assert "seq_length=100" in msg and "2 x context_parallel_size = 8" in msg


def test_expert_parallel_needs_experts():
    msg = error_of(lay(world_size=8, expert_model_parallel_size=2))
    assert "expert_model_parallel_size=2 needs a mixture-of-experts model" in msg
    msg = error_of(lay(world_size=8, expert_model_parallel_size=4, num_moe_experts=6))
    assert "num_moe_experts=6 is not divisible by parallelism.expert_model_parallel_size=4" in msg


def test_expert_grid_excludes_context_parallel():
    # megatron-core 0.16.1: expert grid = expert TP x EP x PP; CP folds into expert data parallelism.
    lay(
        world_size=4, context_parallel_size=2, expert_model_parallel_size=4, num_moe_experts=4, global_batch_size=2
    ).validate()


def test_expert_and_tensor_parallel_need_sequence_parallel():
    msg = error_of(lay(world_size=8, tensor_model_parallel_size=2, expert_model_parallel_size=2, num_moe_experts=4))
    assert "needs sequence parallelism" in msg and "sequence_parallel=true" in msg
    lay(
        world_size=8,
        tensor_model_parallel_size=2,
        expert_model_parallel_size=2,
        num_moe_experts=4,
        sequence_parallel=True,
    ).validate()


def test_every_problem_is_listed_at_once():
    msg = error_of(
        lay(
            world_size=4,
            pipeline_model_parallel_size=4,
            num_layers=30,
            num_attention_heads=6,
            tensor_model_parallel_size=1,
            global_batch_size=6,
            micro_batch_size=4,
        )
    )
    assert msg.count("\n  - ") == 2 and "30 % 4" in msg and "6 % 4" in msg


# ---- "Concrete cases users reported" --------------------------------------------------------


def test_case_pp4_with_30_layers():
    cfg = slurm_cfg(
        1,
        4,
        ParallelismConfig(pipeline_model_parallel_size=4),
        ModelConfig(num_layers=30),
        TrainingConfig(micro_batch_size=1, global_batch_size=4),
    )
    msg = error_of(layout_from_config(cfg))
    assert "30 % 4 = 2" in msg


def test_case_80_layers_pp16_vpp2():
    cfg = slurm_cfg(
        2,
        8,
        ParallelismConfig(pipeline_model_parallel_size=16, virtual_pipeline_model_parallel_size=2),
        ModelConfig(num_layers=80, num_attention_heads=8),
        TrainingConfig(micro_batch_size=1, global_batch_size=32),
    )
    msg = error_of(layout_from_config(cfg))
    assert "80 layers do not split into 32 chunks of equal size" in msg
    assert "80 % 32 = 16" in msg


def test_case_pp6_vpp2_three_microbatches():
    cfg = slurm_cfg(
        1,
        6,
        ParallelismConfig(pipeline_model_parallel_size=6, virtual_pipeline_model_parallel_size=2),
        ModelConfig(num_layers=24),
        TrainingConfig(micro_batch_size=1, global_batch_size=3),
    )
    msg = error_of(layout_from_config(cfg))
    assert "num_microbatches >= 6 and a multiple of pipeline_model_parallel_size=6" in msg
    assert "3 / (1 x 1) = 3" in msg


def test_case_gbs24_mbs1_on_16_gpus():
    cfg = slurm_cfg(2, 8, ParallelismConfig(), ModelConfig(), TrainingConfig(micro_batch_size=1, global_batch_size=24))
    msg = error_of(layout_from_config(cfg))
    assert "24 % 16 = 8" in msg and "one of [16, 32, 48]" in msg


def test_case_8_gpus_pp2_ep8():
    cfg = slurm_cfg(
        1,
        8,
        ParallelismConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=8),
        ModelConfig(num_moe_experts=8),
        TrainingConfig(micro_batch_size=1, global_batch_size=8),
    )
    msg = error_of(layout_from_config(cfg))
    assert "expert grid TP x EP x PP = 1 x 8 x 2 = 16 does not divide world size 8" in msg
    assert "expert_model_parallel_size one of [1, 2, 4]" in msg


# ---- world size from the cluster ------------------------------------------------------------


def test_world_size_sources():
    cfg = slurm_cfg(4, 8, ParallelismConfig())
    assert world_size_of(cfg) == (32, "cluster.nodes x cluster.tasks_per_node = 4 x 8")
    local = JobConfig(parallelism=ParallelismConfig(pipeline_model_parallel_size=2, data_parallel_size=2))
    assert world_size_of(local)[0] == 4
    with pytest.raises(LayoutError, match="tasks_per_node is null"):
        world_size_of(slurm_cfg(1, 0, ParallelismConfig()))
    assert issubclass(LayoutError, ConfigError)
