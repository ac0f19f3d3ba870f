"""Hugging Face safetensors tensors in and out, one layer at a time (issue 38 item 3: streaming); which shard
holds what is :mod:`orchestrator.ckpt.hf_dir`'s.

A directory holds ``config.json`` and either ``model.safetensors`` or shards named by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file). Only the tensors asked for are read
(``safetensors.safe_open`` memory-maps the shard), so a layer's tensors are the most held at once.
Errors: :class:`HfCheckpointError` with one line naming the missing file / tensor and the directory.
"""

from __future__ import annotations

import json
import os

from orchestrator.ckpt.hf_dir import HfCheckpointError


def read_tensors(files: dict[str, str], names: list[str]) -> dict:
    """The named tensors (torch, as stored), each read from its shard; others stay on disk."""
    from safetensors import safe_open

    out: dict = {}
    by_file: dict[str, list[str]] = {}
    for n in names:
        if n not in files:
            raise HfCheckpointError(f"the Hugging Face checkpoint has no tensor {n}; fix: the complete model directory")
        by_file.setdefault(files[n], []).append(n)
    for shard, ns in by_file.items():
        with safe_open(shard, framework="pt") as f:
            for n in ns:
                out[n] = f.get_tensor(n)
    return out


def write_shards(path: str, tensors: dict, max_shard_bytes: int = 5 * 10**9) -> list[str]:
    """Write ``tensors`` as safetensors shards of at most ``max_shard_bytes`` each (one tensor over it gets its own
    shard) plus ``model.safetensors.index.json`` (transformers' layout); returns the shard file names."""
    from safetensors.torch import save_file

    groups: list[dict] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    names, weight_map, total = [], {}, 0
    for k, g in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(g, os.path.join(path, fname), metadata={"format": "pt"})
        names.append(fname)
        weight_map.update(dict.fromkeys(g, fname))
        total += sum(t.numel() * t.element_size() for t in g.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names
