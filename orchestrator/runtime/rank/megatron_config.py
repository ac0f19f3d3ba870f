"""The megatron config of a job: one pure builder of what megatron-core receives.

:func:`build` turns the job config, the target device (``cpu`` / ``cuda``) and what is installed
(:class:`Installed`: Transformer Engine, the fused weight-gradient kernel, the megatron-core line) into
``TransformerConfig``, ``DistributedDataParallelConfig`` and ``OptimizerConfig`` — with no CUDA call, so
a SLURM GPU job's config is computed on a login node (``python -m orchestrator megatron-config``) exactly
as its ranks compute it (:mod:`orchestrator.runtime.rank.model` uses nothing else).

Every field is Megatron-LM's for the flags ``convert to-megatron`` prints (its ``parse_args`` ->
``validate_args`` -> ``core_transformer_config_from_args`` / ``get_megatron_ddp_config`` /
``get_megatron_optimizer_config``; proven field by field against ``tests/golden/megatron/``), except the
rows of the README's "Megatron config" table. The math fields are Megatron-LM's on CPU too: the fused
bias-GELU (``bias_activation_fusion``: the tanh approximation of GELU, megatron-core
``fusions/fused_bias_gelu.py``), softmax precision (``attention_softmax_in_fp32=False``: Megatron-LM's
default; its fused softmax kernel computes in fp32 inside). A CPU job keeps the speed-only fields that
run there (no CUDA kernels, no overlap); a GPU job gets Megatron-LM's fusions and NVIDIA's overlaps.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from typing import Dict, Optional

import torch

from orchestrator.config.fp8 import optimizer_fields, problem, transformer_fields
from orchestrator.config.megatron_fields import fields_of, overlaps
from orchestrator.config.megatron_passthrough import passthrough
from orchestrator.config.schema import JobConfig
from orchestrator.errors import BackendError, ConfigError
from orchestrator.runtime.rank.passthrough import passthrough_problems, with_passthrough


@dataclass(frozen=True)
class Installed:
    """What the machine that runs the ranks has (facts, not choices)."""

    transformer_engine: bool
    """Transformer Engine imports (model.transformer_impl=auto takes its layer spec on GPU)."""
    fused_wgrad: bool
    """Apex's ``fused_weight_gradient_mlp_cuda``: megatron-core's linear layers refuse
    gradient_accumulation_fusion without it (tensor_parallel/layers.py)."""
    mcore_line: str
    """The megatron-core version (``0.16.1``)."""


def transformer_engine_problem() -> Optional[str]:
    """None when Transformer Engine imports or is not installed; else ``Type: first line`` of what its
    import raised (any exception: a broken install raises RuntimeError, OSError, ... not ImportError)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return None
    try:
        import transformer_engine  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - every failure of a present package is named
        return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    return None


def installed(transformer_impl: str = "auto") -> Installed:
    """The facts of this machine for a job asking ``model.transformer_impl``. Raises :class:`BackendError`
    naming a Transformer Engine that is installed but fails to import, unless the job asks for ``local``."""
    from orchestrator.runtime.rank.mcore import version

    if transformer_impl == "local":
        return Installed(False, importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None, version())
    problem = transformer_engine_problem()
    if problem:
        raise BackendError(
            f"Transformer Engine is installed but its import fails ({problem}); fix: repair it "
            "(pip install --force-reinstall transformer-engine[pytorch]) or model.transformer_impl=local"
        )
    te = importlib.util.find_spec("transformer_engine") is not None
    return Installed(te, importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None, version())


def resolve_transformer_impl(cfg: JobConfig, device: str, facts: Installed) -> str:
    """``model.transformer_impl`` resolved: ``transformer_engine`` or ``local``. ``auto``: Transformer
    Engine on GPU when installed, the local spec otherwise. Raises :class:`BackendError` for TE asked
    for but missing, or CP > 1 without TE (megatron's local attention has no CP)."""
    impl = cfg.model.transformer_impl
    te_ok = device == "cuda" and facts.transformer_engine and impl in ("auto", "transformer_engine")
    if impl == "transformer_engine" and not te_ok:
        raise BackendError(
            "model.transformer_impl=transformer_engine but Transformer Engine is not importable here "
            f"(device={device}); fix: install transformer-engine on the GPU nodes or set model.transformer_impl=local"
        )
    cp = cfg.parallelism.context_parallel_size
    if cp > 1 and not te_ok:
        raise BackendError(
            f"parallelism.context_parallel_size={cp} needs Transformer Engine attention, but this job uses the "
            f"local layer spec (model.transformer_impl={impl}, device={device}); fix: install transformer-engine "
            "on the GPU nodes, or parallelism.context_parallel_size=1"
        )
    return "transformer_engine" if te_ok else "local"


def params_dtype(cfg: JobConfig) -> torch.dtype:
    """The weights' dtype: ``training.precision``."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.training.precision]


@dataclass
class MegatronConfig:
    """The three objects megatron-core receives, and the layer spec they were built for."""

    transformer: object  # TransformerConfig
    ddp: object  # DistributedDataParallelConfig
    optimizer: object  # OptimizerConfig
    transformer_impl: str

    def __post_init__(self) -> None:
        # as built: the runtime later hangs its hooks on the TransformerConfig (no_sync_func,
        # finalize_model_grads_func, grad_scale_func), which are not configuration
        self._json = {
            "transformer": fields_of(self.transformer),
            "ddp": fields_of(self.ddp),
            "optimizer": fields_of(self.optimizer),
        }

    def as_json(self) -> Dict[str, Dict[str, object]]:
        """``{"transformer", "ddp", "optimizer"}``: every field by megatron-core's name, as built
        (megatron_config.json)."""
        return json.loads(json.dumps(self._json))


def _check_device(cfg: JobConfig, device: str) -> None:
    if device == "cpu" and cfg.training.precision != "fp32":
        raise ConfigError(
            f"training.precision={cfg.training.precision} needs a GPU; fix: training.precision=fp32 on CPU"
        )


def _moe_fields(m) -> dict:
    """A MoE model's router and dispatcher (none for a dense model: megatron-core's defaults stay, as in
    Megatron-LM): top-k routing with the aux load-balancing loss, tokens exchanged all-to-all over the EP
    group (gloo on CPU, nccl on GPU; exported as ``--moe-token-dispatcher-type alltoall``)."""
    if not m.num_moe_experts:
        return {}
    return {
        "moe_router_topk": m.moe_router_topk,
        "moe_aux_loss_coeff": m.moe_aux_loss_coeff,
        "moe_router_load_balancing_type": "aux_loss",
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": m.moe_grouped_gemm,
    }


def transformer_config(cfg: JobConfig, device: str, facts: Installed, impl: str):
    """megatron ``TransformerConfig``: the model, the layout, precision, and Megatron-LM's fusions."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    _check_device(cfg, device)
    if problem(cfg, device, impl):  # FP8: Transformer Engine's GEMMs, on GPU only
        raise ConfigError(problem(cfg, device, impl))
    m, p, t = cfg.model, cfg.parallelism, cfg.training
    gpu, swiglu, dtype = device == "cuda", m.activation == "swiglu", params_dtype(cfg)
    vpp = p.virtual_pipeline_model_parallel_size if (p.virtual_pipeline_model_parallel_size or 1) > 1 else None
    rope_fusion = gpu and impl == "transformer_engine" and m.position_embedding_type == "rope"
    interleaved = gpu and vpp is not None  # Megatron-LM overlaps the interleaved schedule's p2p on GPU
    config = TransformerConfig(
        **with_passthrough(
            TransformerConfig,
            cfg.model.megatron,
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            num_query_groups=m.num_query_groups,
            ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
            hidden_dropout=m.hidden_dropout,
            attention_dropout=m.attention_dropout,
            init_method_std=m.init_method_std,
            normalization=m.normalization,
            gated_linear_unit=swiglu,
            activation_func=torch.nn.functional.silu if swiglu else torch.nn.functional.gelu,
            add_bias_linear=m.add_bias_linear,
            layernorm_epsilon=m.norm_epsilon,
            add_qkv_bias=m.add_bias_linear if m.add_qkv_bias is None else m.add_qkv_bias,
            num_moe_experts=m.num_moe_experts,
            **_moe_fields(m),
            recompute_granularity=m.recompute_granularity,
            recompute_method=m.recompute_method,
            recompute_num_layers=m.recompute_num_layers,
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=vpp,
            context_parallel_size=p.context_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            sequence_parallel=p.sequence_parallel,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=t.precision == "bf16",
            fp16=t.precision == "fp16",
            **transformer_fields(t),
            use_cpu_initialization=None if gpu else True,
            perform_initialization=True,  # None: Megatron-LM's
            inference_sampling_seed=t.seed,
            transformer_impl=impl,  # the layer spec the job builds (megatron_config.json records it)
            cp_comm_type="p2p",
            # math, Megatron-LM's on every device: the fused bias-GELU is GELU's tanh approximation
            # (--bias-gelu-fusion, off without biases as validate_args turns it off); SwiGLU's is exact
            bias_activation_fusion=swiglu or m.add_bias_linear,
            attention_softmax_in_fp32=False,
            # speed only: CUDA kernels on GPU (fp32 weight-gradient GEMMs where the kernel exists)
            gradient_accumulation_fusion=gpu and facts.fused_wgrad,
            masked_softmax_fusion=gpu,
            bias_dropout_fusion=gpu,
            persist_layer_norm=gpu,
            apply_rope_fusion=False,  # set below: its check looks for TE in *this* process
            deallocate_pipeline_outputs=gpu,
            overlap_p2p_comm=interleaved,
            batch_p2p_comm=not interleaved,
        )
    )
    # TransformerConfig refuses apply_rope_fusion where TE's fused RoPE does not import; a GPU job's
    # config computed on a login node is about the GPU nodes (facts.transformer_engine), not this one
    config.apply_rope_fusion = rope_fusion
    return config


def ddp_config(cfg: JobConfig, device: str, dp: int):
    """megatron ``DistributedDataParallelConfig``: fp32 gradient reduction, NaN check, overlaps (``dp``: the layout's
    data-parallel size)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    grad, gather = overlaps(cfg, device == "cuda", dp)
    vpp = cfg.parallelism.virtual_pipeline_model_parallel_size or 1
    return DistributedDataParallelConfig(
        **with_passthrough(
            DistributedDataParallelConfig,
            cfg.parallelism.megatron,
            # Megatron-LM's validate_args: fp32 reduction for bf16 (fp32 weights have fp32 gradients anyway)
            grad_reduce_in_fp32=cfg.training.precision == "bf16",
            overlap_grad_reduce=grad,
            overlap_param_gather=gather,
            align_param_gather=vpp > 1,  # Megatron-LM: validate_args turns it off without the interleaved schedule
            use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
            average_in_collective=False,
            # not megatron's check: it raises RuntimeError inside the backward pass (rerun machine off), before
            # training.nan_policy's guard (faults/guard.py) can stop naming the ranks, or skip the step
            check_for_nan_in_grad=False,
        )
    )


def optimizer_config(cfg: JobConfig, device: str, dp: int):
    """megatron ``OptimizerConfig``: Megatron-LM's optimizer flags (``dp``: the layout's data-parallel size)."""
    from megatron.core.optimizer import OptimizerConfig

    o, t = cfg.optimizer, cfg.training
    _, gather = overlaps(cfg, device == "cuda", dp)
    return OptimizerConfig(
        **with_passthrough(
            OptimizerConfig,
            o.megatron,
            optimizer=o.name,
            lr=o.lr,
            min_lr=o.min_lr,
            weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1,
            adam_beta2=o.adam_beta2,
            adam_eps=o.adam_eps,
            sgd_momentum=o.sgd_momentum,
            clip_grad=o.clip_grad,
            bf16=t.precision == "bf16",
            fp16=t.precision == "fp16",
            params_dtype=params_dtype(cfg),
            use_distributed_optimizer=o.use_distributed_optimizer,
            overlap_param_gather=gather,
            **optimizer_fields(t),
        )
    )


def build(cfg: JobConfig, device: str, facts: Installed, dp: int) -> MegatronConfig:
    """The job's megatron config for ``device`` on a machine with ``facts`` at data-parallel size ``dp`` (the
    validated layout's); no CUDA call, no process group. Raises ConfigError / BackendError for what the device
    cannot run."""
    passed = {section: fields for section, fields in passthrough(cfg).items() if fields}
    problems = passthrough_problems(cfg) if passed else []
    if problems:
        raise ConfigError(problems[0])
    impl = resolve_transformer_impl(cfg, device, facts)
    try:
        return MegatronConfig(
            transformer_config(cfg, device, facts, impl),
            ddp_config(cfg, device, dp),
            optimizer_config(cfg, device, dp),
            impl,
        )
    except (ValueError, AssertionError, ImportError, TypeError) as exc:
        if not passed:
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"megatron-core refused the pass-through fields {passed} on device={device}: {type(exc).__name__}: "
            f"{first}; fix: change or drop them (model/parallelism/optimizer.megatron)"
        ) from None


def check_buildable(cfg: JobConfig, dp: int) -> None:
    """Build the job's megatron config here, as ``megatron-config`` does (a GPU job's Transformer Engine assumed
    on its nodes unless ``model.transformer_impl=local``): ConfigError (one line) for what megatron-core refuses."""
    from orchestrator.config.machine import runs_on_cpu
    from orchestrator.runtime.rank.mcore import version

    cpu = runs_on_cpu(cfg)
    te = not cpu and cfg.model.transformer_impl != "local"
    build(cfg, "cpu" if cpu else "cuda", Installed(te, not cpu, version()), dp)
