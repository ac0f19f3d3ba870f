"""``checkpoint.init_from=hf:PATH``: a Hugging Face checkpoint's weights into this rank's model chunks, at the
job's layout (TP, PP, VPP, EP), one decoder layer at a time (issue 38 items 1 and 3).

Every rank reads only the layers its chunks hold (a TransformerLayer's ``layer_number`` is its global, 1-based
index), maps them to megatron-core's whole (TP1) tensors (the family's module, :func:`family`:
:mod:`orchestrator.runtime.rank.hf_llama` or :mod:`orchestrator.runtime.rank.hf_gpt2`) and keeps its own part, the
rules of megatron-core's parallel layers:

* column-parallel (``linear_qkv``, ``linear_fc1``, the vocabulary-parallel embedding, ``output_layer``): rows
  split in TP contiguous blocks, rank r keeps block r; the fused QKV is grouped per KV group, so a block is whole
  groups (TP divides the groups); SwiGLU's ``linear_fc1`` = ``[gate; up]`` splits each half (megatron-core
  ``apply_swiglu_sharded_factory``: rank r holds ``[gate_r; up_r]``);
* row-parallel (``linear_proj``, ``linear_fc2``): columns split likewise, their biases whole on every rank;
* norms, the router, learned position embeddings (first stage): whole on every rank;
* experts: EP rank e holds global experts ``e * n_local ... + n_local - 1`` (megatron-core ``SequentialMLP``),
  split over the expert-TP group by the rules above.

The embedding's rows beyond the Hugging Face vocabulary (megatron's padding) are zero. Every parameter of the model
must be matched, or the load fails naming the first one left (issue 38 item 3: streaming). Memory beyond the rank's
model: one layer's tensors, whole, as read and as mapped (the fused QKV and ``[gate; up]`` are new tensors: under
2x a layer), or one embedding matrix, copied into the vocabulary-parallel rows without a padded copy.
"""

from __future__ import annotations

import re
from types import ModuleType
from typing import Callable, Dict, List, Optional, Tuple

import torch

from orchestrator.ckpt import hf_dir
from orchestrator.runtime.rank import hf_files, hf_gpt2, hf_llama
from orchestrator.runtime.rank.model import unwrap

_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")
_VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight")


def family(arch: str) -> ModuleType:
    """The weight-mapping module of a supported Hugging Face architecture (``GPT2LMHeadModel``: hf_gpt2; the
    Llama family: hf_llama). Each has ``layer_prefix``, ``outer_names``, ``layer_to_megatron``, ``to_megatron``
    and ``to_hf`` with the same signatures."""
    return hf_gpt2 if arch == "GPT2LMHeadModel" else hf_llama


def local_part(whole: torch.Tensor, local_shape: torch.Size, rank: int, size: int, gated: bool = False) -> torch.Tensor:
    """The part of ``whole`` (megatron's TP1 tensor) that parallel rank ``rank`` of ``size`` holds in a parameter
    of ``local_shape`` (module docstring); ValueError when no split of one dimension by ``size`` gives it."""
    if tuple(whole.shape) == tuple(local_shape):
        return whole
    dims = [d for d in range(whole.dim()) if whole.shape[d] != local_shape[d]]
    if whole.dim() != len(local_shape) or len(dims) != 1 or whole.shape[dims[0]] != local_shape[dims[0]] * size:
        raise ValueError(f"a tensor of shape {tuple(whole.shape)} does not split into {tuple(local_shape)} x {size}")
    d, n = dims[0], local_shape[dims[0]]
    if gated:
        halves = torch.chunk(whole, 2, dim=d)
        return torch.cat([h.narrow(d, rank * (n // 2), n // 2) for h in halves], dim=d)
    return whole.narrow(d, rank * n, n)


def _ranks(expert: bool) -> Tuple[int, int]:
    from megatron.core import parallel_state as ps

    if expert:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _copy(param: torch.nn.Parameter, whole: torch.Tensor, name: str, expert: bool = False, gated: bool = False) -> None:
    rank, size = _ranks(expert)
    with torch.no_grad():
        param.copy_(local_part(whole, param.shape, rank, size, gated))


def _global_name(layer_prefix: str, rest: str, experts_offset: int) -> str:
    m = _EXPERT.match(rest)
    if m:
        rest = f"mlp.experts.local_experts.{experts_offset + int(m.group(1))}." + rest[m.end() :]
    return layer_prefix + rest


def _copy_vocab(param: torch.nn.Parameter, weight: torch.Tensor, name: str) -> None:
    """The rows of ``weight`` [vocab, ...] this TP rank's block of the padded vocabulary holds into ``param``, the
    padding rows beyond the vocabulary zero (no padded copy of the whole matrix is made)."""
    rank, size = _ranks(False)
    rows = param.shape[0]
    if weight.shape[0] > rows * size:
        raise ValueError(
            f"the Hugging Face vocabulary ({weight.shape[0]}) is larger than the model's ({rows * size} rows)"
        )
    if tuple(weight.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(f"{name}: a tensor of shape {tuple(weight.shape)} does not fit {tuple(param.shape)} rows")
    part = weight[rank * rows : (rank + 1) * rows]
    with torch.no_grad():
        param[: part.shape[0]].copy_(part)
        param[part.shape[0] :].zero_()


class _Progress:
    """This rank's decoder layers loaded (bytes as stored): a line per layer with an ETA
    (:class:`orchestrator.meter.Meter`)."""

    def __init__(
        self, model_chunks: List[torch.nn.Module], files: Dict[str, str], prefix: str, log: Optional[Callable]
    ):
        from orchestrator.meter import Meter, say

        sizes = hf_dir.tensor_bytes(files)
        layers = [layer.layer_number - 1 for chunk in model_chunks for layer in unwrap(chunk).decoder.layers]
        total = sum(sizes[n] for g in layers for n in hf_dir.layer_names(files, g, prefix))
        self.done = 0
        self.meter = Meter("loading", total, lambda: {f"of {len(layers)} layers": self.done}, log or say, every=0.0)

    def layer(self, nbytes: int) -> None:
        self.done += 1
        self.meter.advance(nbytes)


def _load_layers(
    model,
    files: Dict[str, str],
    fam: ModuleType,
    shape: Tuple[int, int, bool],
    left: Dict[str, torch.nn.Parameter],
    progress: _Progress,
):
    from megatron.core import parallel_state as ps

    heads, groups, gated = shape
    ep_rank = ps.get_expert_model_parallel_rank()
    fused_norm = any("layer_norm_weight" in n for n in left)
    prefix = fam.layer_prefix(files)
    for i, layer in enumerate(model.decoder.layers):
        g = layer.layer_number - 1
        hf = hf_files.read_tensors(files, hf_dir.layer_names(files, g, prefix))
        whole = fam.layer_to_megatron(hf, g, heads, groups, fused_norm)
        local, glob = f"decoder.layers.{i}.", f"decoder.layers.{g}."
        n_local = len(getattr(getattr(layer.mlp, "experts", None), "local_experts", []) or [])
        for name in [n for n in left if n.startswith(local)]:
            rest = name[len(local) :]
            key = _global_name(glob, rest, ep_rank * n_local)
            if key not in whole:
                raise ValueError(f"no Hugging Face tensor maps to {name} (looked for {key})")
            _copy(
                left.pop(name), whole[key], name, expert=bool(_EXPERT.match(rest)), gated=gated and "linear_fc1" in rest
            )
        progress.layer(sum(t.numel() * t.element_size() for t in hf.values()))
        del hf, whole  # one layer at a time


def load(
    model_chunks: List[torch.nn.Module],
    files: Dict[str, str],
    heads: int,
    groups: int,
    gated: bool,
    arch: str,
    log: Optional[Callable[[str], None]] = None,
) -> int:
    """Copy the Hugging Face weights of ``files`` (tensor name -> shard, :func:`orchestrator.ckpt.hf_dir.weight_map`)
    of architecture ``arch`` into ``model_chunks`` (this rank's parts), saying progress through ``log`` (a line per
    layer with an ETA, after the first second); returns the number of parameters (elements) loaded on this rank.
    HfCheckpointError / ValueError (one line) for a tensor that is missing or does not fit."""
    fam = family(arch)
    loaded = 0
    progress = _Progress(model_chunks, files, fam.layer_prefix(files), log)
    for chunk in model_chunks:
        model = unwrap(chunk)
        left = dict(model.named_parameters())
        loaded += sum(p.numel() for p in left.values())
        _load_layers(model, files, fam, (heads, groups, gated), left, progress)
        # the embeddings (first stage), the final norm and the output layer (last stage: untied, or the copy of tied
        # embeddings megatron-core keeps there)
        for name, source in fam.outer_names(files).items():
            if name in left:
                p, t = left.pop(name), hf_files.read_tensors(files, [source])[source]
                (_copy_vocab if name in _VOCAB_ROWS else _copy)(p, t, name)
        if left:
            raise ValueError(f"{len(left)} parameter(s) found no Hugging Face tensor, first {next(iter(left))}")
    progress.meter.close()
    return loaded
