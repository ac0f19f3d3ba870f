"""A job that starts from Hugging Face weights (``checkpoint.init_from=hf:PATH``, issue 38): load them at the job's
layout (:mod:`orchestrator.runtime.rank.hf_import`), then verify them against transformers' own model.

Verification (``checkpoint.hf_verify``, on by default): every rank runs megatron-core's forward-only schedule on
one fixed batch (:data:`VERIFY_TOKENS` tokens from a seeded generator, below the vocabulary); the last pipeline
stage gathers the vocabulary-parallel logits over TP, and its first rank compares them, over the Hugging Face
vocabulary, with ``transformers.AutoModelForCausalLM`` built from the same directory in fp32 (skipped, saying why,
when that model would not fit in a quarter of this host's free memory or transformers is not installed). The
largest absolute difference is said; above the tolerance (:data:`TOLERANCE`: the job's precision) every rank
stops with one line before the first iteration.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional

import torch

from orchestrator.ckpt import hf_dir
from orchestrator.config.hf_config import architecture, read_config
from orchestrator.errors import OrchestratorError
from orchestrator.runtime.rank import hf_import, param_sync, startup
from orchestrator.runtime.rank.build import Rank

VERIFY_TOKENS = 32
"""Tokens per sequence of the verification batch (one sequence per micro-batch), at most ``model.seq_length``."""

TOLERANCE = {"fp32": 1e-4, "bf16": 0.15, "fp16": 0.05}
"""Largest absolute logit difference accepted, by ``training.precision``: fp32 differs only by summation order;
bf16 / fp16 keep 8 / 11 mantissa bits of logits of size ~10."""


class HfImportError(OrchestratorError):
    """The imported weights do not reproduce the Hugging Face model's logits, or could not be loaded."""


def start(rank: Rank, path: str) -> Dict[str, object]:
    """Load ``path`` into this rank's model, refresh the optimizer's main params, verify; returns the manifest's
    ``origin`` (rank 0: the source's architecture and shard hashes). Collective."""
    from orchestrator.runtime.training.saving import slowest

    cfg, built = rank.cfg, rank.built
    m = cfg.model
    t0, before = time.perf_counter(), _memory()
    arch = architecture(read_config(path))
    try:
        files = hf_dir.weight_map(path)  # read once: the load, the verification and the manifest's hashes use it
        hf_import.load(
            built.model,
            files,
            m.num_attention_heads,
            m.num_query_groups or m.num_attention_heads,
            gated=m.activation == "swiglu",
            arch=arch,
            log=rank.say,
        )
    except (ValueError, hf_dir.HfCheckpointError) as exc:
        raise HfImportError(f"checkpoint.init_from=hf:{path}: {exc}") from exc
    # Megatron-LM's load_checkpoint does this when it loads no optimizer state: the fp32 main params follow
    built.optimizer.reload_model_params()
    load_s = slowest(rank, time.perf_counter() - t0)
    rank.say(f"model weights initialised from Hugging Face {path} in {load_s:.2f} s (slowest rank){_grew(before)}")
    if cfg.checkpoint.hf_verify:
        verify(rank, path, files)
    origin: Dict[str, object] = {"init_from": cfg.checkpoint.init_from}
    if rank.rank0:
        origin["hf"] = {
            "path": path,
            "architecture": arch,
            "sha256": hf_dir.content_hashes(files),
        }
    return origin


def _memory() -> tuple:
    """(resident bytes, peak resident bytes so far) of this process."""
    import psutil

    from orchestrator.runtime.training.summary import max_rss_mb

    return psutil.Process().memory_info().rss, int(max_rss_mb() * 2**20)


def _grew(before: tuple) -> str:
    """What the load held beyond the model on this rank (rank 0): its peak resident set over the resident set before
    it. The peak is the process's high-water mark, so a load that stayed below an earlier peak is an upper bound."""
    rss, peak = before
    after = _memory()[1]
    bound = "" if after > peak else "at most "
    return (
        f"; host memory {rss / 2**30:.2f} GiB resident before the load, its peak {bound}{after / 2**30:.2f} GiB "
        f"(+{(after - rss) / 2**30:.2f} GiB, rank 0)"
    )


def _batch(vocab: int, seq: int, device) -> Dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (1, seq + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1].to(device),
        "labels": tokens[:, 1:].to(device),
        "loss_mask": torch.ones(1, seq, device=device),
        "position_ids": torch.arange(seq, device=device).unsqueeze(0),
    }


def _our_logits(rank: Rank, batch: Dict[str, torch.Tensor]) -> Optional[torch.Tensor]:
    """[1, s, padded vocab] logits of this model on ``batch`` on the last stage (gathered over TP); None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    stash: List[torch.Tensor] = []

    def step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None)
        return out, lambda output: (stash.append(output.detach()) or torch.zeros((), device=output.device), {})

    model = rank.built.model
    n = ps.get_pipeline_model_parallel_world_size()  # the interleaved schedule wants a multiple of PP micro-batches
    iterators = [iter([batch] * n) for _ in model] if len(model) > 1 else iter([batch] * n)
    for chunk in model:
        chunk.eval()
    with torch.no_grad(), param_sync.gathered(model):
        get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iterators,
            model=model,
            num_microbatches=n,
            seq_length=batch["tokens"].shape[1],
            micro_batch_size=1,
            forward_only=True,
        )
    for chunk in model:
        chunk.train()
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    local = stash[-1].float()
    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    parts = [torch.empty_like(local) for _ in range(tp)]
    torch.distributed.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _reference(path: str, files: Dict[str, str], batch: Dict[str, torch.Tensor]):
    """transformers' fp32 logits on ``batch``, or why there are none (a line): transformers is absent, or its fp32
    model (at most twice the bf16 weights' bytes) would not fit in a quarter of this host's free memory."""
    import psutil

    need, free = 2 * sum(hf_dir.tensor_bytes(files).values()), psutil.virtual_memory().available
    if need > free / 4:
        return (
            f"transformers' fp32 model (up to {need / 2**30:.1f} GiB) would not fit in a quarter of this host's free "
            f"memory ({free / 2**30:.1f} GiB); verify on a larger host, or checkpoint.hf_verify=false to silence this"
        )
    startup.let_in("transformers")  # kept out of ranks (runtime.rank.startup); this one needs it
    try:
        import transformers
    except ImportError:
        return "transformers is not installed (pip install 'orchestrator[hf]')"
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return ref(batch["tokens"].cpu()).logits


def verify(rank: Rank, path: str, files: Dict[str, str]) -> None:
    """Compare this model's logits with transformers' on a fixed batch (module docstring); collective, raises
    HfImportError on every rank above the tolerance."""
    from megatron.core import parallel_state as ps

    if ps.get_context_parallel_world_size() > 1:
        rank.say("Hugging Face weights not verified: context parallel splits the sequence (verify at CP 1)")
        return
    vocab = read_config(path)["vocab_size"]
    seq = min(VERIFY_TOKENS, rank.cfg.model.seq_length)
    batch = _batch(vocab, seq, rank.tensor_device)
    ours = _our_logits(rank, batch)
    verdict: List[object] = [None]
    checker = ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    if checker and ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0:
        want = _reference(path, files, batch)
        if isinstance(want, str):
            verdict[0] = ("skipped", want)
        else:
            diff = (ours[..., :vocab].cpu() - want).abs().max().item()
            verdict[0] = ("diff", diff)
    checker_rank = torch.tensor(
        [torch.distributed.get_rank() if verdict[0] is not None else -1], device=rank.tensor_device
    )
    torch.distributed.all_reduce(checker_rank, op=torch.distributed.ReduceOp.MAX)
    torch.distributed.broadcast_object_list(verdict, src=int(checker_rank[0]))
    kind, value = verdict[0]  # type: ignore[misc]
    tol = TOLERANCE[rank.cfg.training.precision]
    if kind == "skipped":
        rank.say(f"Hugging Face weights not verified: {value}")
    elif value > tol:
        raise HfImportError(
            f"checkpoint.init_from=hf:{path}: our logits differ from transformers' by up to {value:.3g} on a "
            f"fixed batch (tolerance {tol:g} at training.precision={rank.cfg.training.precision}): the model "
            "config does not match the weights' (model.* keys, model.megatron); fix: model from "
            "`orchestrator convert from-hf` for this directory"
        )
    else:
        rank.say(
            f"verified against transformers: max |logits difference| {value:.3g} on {seq} tokens (tolerance {tol:g})"
        )
