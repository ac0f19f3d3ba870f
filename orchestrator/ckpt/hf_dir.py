"""A Hugging Face checkpoint directory on disk (issue 38): which shard holds which tensor, what it weighs and
its content hashes. Pure Python (no torch, no safetensors): the launcher checks a directory before queueing.

A directory holds ``config.json`` and either ``model.safetensors`` or shards named by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file). A safetensors file starts with an
8-byte little-endian header length and a JSON header (tensor name -> dtype, shape, offsets; the safetensors
format specification), which is all this module reads of the weights.
Errors: :class:`HfCheckpointError` with one line naming the missing file / tensor, the directory and the fix.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Dict, List

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class HfCheckpointError(ValueError):
    """A Hugging Face directory that cannot be read: one line naming the file or tensor and the fix."""


def header(file: str) -> Dict[str, dict]:
    """A safetensors file's tensors: name -> ``{"dtype", "shape", "data_offsets"}`` (``__metadata__`` dropped)."""
    with open(file, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        table = json.loads(f.read(size))
    table.pop("__metadata__", None)
    return table


def weight_map(path: str) -> Dict[str, str]:
    """Tensor name -> shard file (absolute) for the directory ``path``; every shard named must exist."""
    index = os.path.join(path, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            files = {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    else:
        single = os.path.join(path, SINGLE)
        if not os.path.exists(single):
            raise HfCheckpointError(
                f"{path}: no {SINGLE} or {INDEX} there; fix: a Hugging Face model directory saved with safetensors"
            )
        files = dict.fromkeys(header(single), single)
    missing = sorted({v for v in files.values() if not os.path.exists(v)})
    if missing:
        raise HfCheckpointError(
            f"{path}: shard {os.path.basename(missing[0])} named by {INDEX} is missing ({len(missing)} missing); "
            "fix: download the whole directory"
        )
    return files


def layer_names(files: Dict[str, str], i: int, prefix: str = "model.layers.{i}.") -> List[str]:
    """Every stored tensor name of decoder layer ``i``: names starting with ``prefix`` (a format string of ``i``;
    Llama's ``model.layers.{i}.``, GPT-2's ``transformer.h.{i}.``)."""
    start = prefix.format(i=i)
    return sorted(n for n in files if n.startswith(start))


def tensor_bytes(files: Dict[str, str]) -> Dict[str, int]:
    """Tensor name -> its size in bytes as stored, from the shards' headers."""
    out: Dict[str, int] = {}
    for shard in sorted(set(files.values())):
        out.update({n: v["data_offsets"][1] - v["data_offsets"][0] for n, v in header(shard).items()})
    return out


def content_hashes(files: Dict[str, str]) -> Dict[str, str]:
    """``{shard file name: sha256 hex}`` of every shard (the manifest's record of the source's exact bytes)."""
    out = {}
    for shard in sorted(set(files.values())):
        digest = hashlib.sha256()
        with open(shard, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        out[os.path.basename(shard)] = digest.hexdigest()
    return out
