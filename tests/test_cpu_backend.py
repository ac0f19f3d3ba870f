"""The megatron-core CPU compatibility layer (orchestrator.runtime.rank.cpu), exercised on real megatron code."""

from __future__ import annotations

import socket

import pytest
import torch

from orchestrator.errors import BackendError
from orchestrator.runtime.rank import cpu


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def single_rank_group():
    """A real one-rank gloo process group with megatron's parallel state (TP=PP=1)."""
    from megatron.core import parallel_state

    cpu.activate()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.mark.mcore_lines
def test_unknown_megatron_version_is_refused():
    for other in ("0.17.0", "0.18.1", "0.20.0", "0.15.3"):
        with pytest.raises(BackendError, match=other) as info:
            cpu.check_supported(other)
        assert "0.16.x, 0.19.x" in str(info.value) and "\n" not in str(info.value)
    cpu.check_supported("0.16.1")  # the version it was written for
    cpu.check_supported("0.19.2")  # the version GPU users get on Python 3.12 (CI's second leg)
    cpu.check_supported()  # the installed one: 0.16.1, or 0.19.2 in that leg


@pytest.mark.mcore_lines
def test_distributed_timeout_reaches_every_megatron_group():
    """training.distributed_timeout_minutes is megatron's timeout for every group it creates (TP, PP, DP,
    CP, ...), not only for the default group (megatron's own default: 30 minutes)."""
    import datetime

    from megatron.core import parallel_state as ps

    from orchestrator.config.schema import JobConfig
    from orchestrator.runtime.rank.model import initialize_parallel_state

    cfg = JobConfig()
    cfg.training.distributed_timeout_minutes = 3
    cpu.activate()
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        initialize_parallel_state(cfg, seed=1234, device="cpu")
        groups = {
            "tp": ps.get_tensor_model_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(),
            "dp": ps.get_data_parallel_group(),
            "cp": ps.get_context_parallel_group(),
            "dp_cp": ps.get_data_parallel_group(with_context_parallel=True),
            "mp": ps.get_model_parallel_group(),
        }
        timeouts = {name: g._get_backend(torch.device("cpu")).options._timeout for name, g in groups.items()}
        assert timeouts == {name: datetime.timedelta(minutes=3) for name in groups}, timeouts
    finally:
        ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def test_cuda_allocations_in_patched_modules_land_on_cpu():
    cpu.activate()
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    assert schedules.torch.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert (
        p2p_communication.torch.empty((3,), device=p2p_communication.torch.cuda.current_device()).device.type == "cpu"
    )
    schedules.torch.cuda.synchronize()  # a no-op, not an error
    assert schedules.torch.float32 is torch.float32  # everything else is the real torch


def test_clip_grad_matches_torch_reference(single_rank_group):
    from megatron.core.optimizer import clip_grads

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 5)) for _ in range(3)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, r in zip(params, reference):
        g = torch.randn_like(p) * 10
        p.grad, r.grad = g.clone(), g.clone()
    grads = [p.grad for p in params]
    total = clip_grads.get_grad_norm_fp32(grads)
    clip_grads.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total)
    expected = torch.nn.utils.clip_grad_norm_(reference, max_norm=1.0)
    assert total == pytest.approx(float(expected), rel=1e-5)
    for p, r in zip(params, reference):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)
    assert float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))) == pytest.approx(
        1.0, rel=1e-4
    )


def test_rng_tracker_forks_reproducibly_on_cpu(single_rank_group):
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(123)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched by the fork
    tensor_parallel.model_parallel_cuda_manual_seed(123)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        b = torch.rand(4)
    torch.testing.assert_close(a, b)


def test_deactivate_restores_megatron():
    from megatron.core.optimizer import clip_grads
    from megatron.core.pipeline_parallel import schedules

    cpu.activate()
    patched = clip_grads.clip_grad_by_total_norm_fp32
    cpu.deactivate()
    try:
        assert schedules.torch is torch
        assert clip_grads.clip_grad_by_total_norm_fp32 is not patched
    finally:
        cpu.activate()


_LIGHT_RANK = r"""
import sys
from orchestrator.runtime.rank import startup
startup.keep_out(wandb=True)
startup.jit_fuser_off()
import megatron.core.jit as jit
from megatron.core.fusions import fused_bias_gelu
from orchestrator.config.compose import compose_config
from orchestrator.config.checks import validate
from orchestrator.data.tokenizer import dataset_tokenizer
print("fuser", jit.jit_fuser is jit.noop_decorator, type(fused_bias_gelu.bias_gelu).__name__)
import torch
from megatron.core.pipeline_parallel import schedules  # imports megatron's moe.router (0.19: @torch.compile in it)
from orchestrator.runtime.rank.startup import deferred_compile
twice = deferred_compile(torch.compile)(lambda x: 2 * x)
print("inductor", "torch._inductor.compile_fx" in sys.modules, torch.compile.__module__)
print("deferred", twice(torch.ones(1)).item(), "torch._inductor.compile_fx" in sys.modules)
cfg = compose_config(["data.tokenizer=GPT2BPETokenizer", "data.vocab_file=" + sys.argv[1], "data.merge_file=" + sys.argv[2],
                      "run.dir=" + sys.argv[3]])
validate(cfg)  # the job's own validate still knows transformers is installed
print("byte eod", dataset_tokenizer(compose_config(["run.dir=" + sys.argv[3]]).data).eod)
print("kept out", sys.modules["transformers"] is None, sys.modules["wandb"] is None, sys.modules["boto3"] is None)
"""


@pytest.mark.mcore_lines
def test_a_rank_keeps_transformers_wandb_and_the_jit_fuser_out_and_still_validates(tmp_path):
    """What every rank process does before importing megatron-core (runtime/rank/startup.py): megatron's
    jit fuser is its own no-op (a fused function stays a plain function, not torch.compile's wrapper), the
    import of megatron's schedules (0.19.x: the router's @torch.compile) leaves torch's inductor out until a
    deferred compile is first called,
    transformers, wandb and boto3 are never imported, the byte tokenizer still builds, and the job's validate
    of an HF-tokenized run still sees transformers installed (distribution metadata, not sys.modules)."""
    import json
    import subprocess
    import sys

    from conftest import GPT2_EOD, REPO

    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": GPT2_EOD}))
    merges.write_text("#version: 0.2\na b\n")
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", _LIGHT_RANK, str(vocab), str(merges), str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == [
        "fuser True function",
        "inductor False torch",  # 0.19's router imported with torch.compile deferred, and torch.compile restored
        "deferred 2.0 True",  # a deferred torch.compile compiles (imports the inductor) at its first call
        "byte eod 256",
        "kept out True True True",
    ], out.stdout
