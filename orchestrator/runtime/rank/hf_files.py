"""Reading a Hugging Face checkpoint directory one layer at a time (issue 38 item 3: streaming).

A directory holds ``config.json`` and either ``model.safetensors`` or shards named by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file). Only the tensors asked for are read
(``safetensors.safe_open`` memory-maps the shard), so a layer's tensors are the most held at once.
Errors: :class:`HfCheckpointError` with one line naming the missing file / tensor and the directory.
"""

from __future__ import annotations

import json
import os


class HfCheckpointError(ValueError):
    """A Hugging Face directory that cannot be read: one line naming the file or tensor and the fix."""


def weight_map(path: str) -> dict[str, str]:
    """Tensor name -> shard file (absolute) for the directory ``path``; every shard named must exist."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    else:
        single = os.path.join(path, "model.safetensors")
        if not os.path.exists(single):
            raise HfCheckpointError(
                f"error: checkpoint.init_from=hf:{path}: no model.safetensors or model.safetensors.index.json there"
            )
        from safetensors import safe_open

        with safe_open(single, framework="pt") as f:
            files = dict.fromkeys(f.keys(), single)
    missing = sorted({v for v in files.values() if not os.path.exists(v)})
    if missing:
        raise HfCheckpointError(
            f"error: checkpoint.init_from=hf:{path}: shard {os.path.basename(missing[0])} named by "
            f"model.safetensors.index.json is missing ({len(missing)} missing); download the whole directory"
        )
    return files


def read_tensors(files: dict[str, str], names: list[str]) -> dict:
    """The named tensors (torch, as stored), each read from its shard; others stay on disk."""
    from safetensors import safe_open

    out: dict = {}
    by_file: dict[str, list[str]] = {}
    for n in names:
        if n not in files:
            raise HfCheckpointError(f"error: Hugging Face checkpoint has no tensor {n}; is it a complete model?")
        by_file.setdefault(files[n], []).append(n)
    for shard, ns in by_file.items():
        with safe_open(shard, framework="pt") as f:
            for n in ns:
                out[n] = f.get_tensor(n)
    return out


def layer_names(files: dict[str, str], i: int) -> list[str]:
    """Every stored tensor name of decoder layer ``i`` (``model.layers.{i}.``)."""
    prefix = f"model.layers.{i}."
    return sorted(n for n in files if n.startswith(prefix))


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
