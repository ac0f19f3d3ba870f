"""Hugging Face safetensors tensors in and out, one layer at a time (issue 38 item 3: streaming); which shard
holds what is :mod:`orchestrator.ckpt.hf_dir`'s.

A directory holds ``config.json`` and either ``model.safetensors`` or shards named by
``model.safetensors.index.json`` (``weight_map``: tensor name -> shard file). Only the tensors asked for are read
(``safetensors.safe_open`` memory-maps the shard), so a layer's tensors are the most held at once; shards are
written tensor by tensor (:class:`ShardWriter`), so nothing of a shard is held while it is written.
Errors: :class:`HfCheckpointError` with one line naming the missing file / tensor and the directory.
"""

from __future__ import annotations

import json
import os
import struct

import torch

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


SAFETENSORS_DTYPES = {
    "torch.float64": "F64",
    "torch.float32": "F32",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.int64": "I64",
    "torch.int32": "I32",
    "torch.int16": "I16",
    "torch.int8": "I8",
    "torch.uint8": "U8",
    "torch.bool": "BOOL",
}
"""torch dtype -> the safetensors format's dtype name (its specification's list; the types a model stores)."""


class ShardWriter:
    """Safetensors shards written one tensor at a time, each of at most ``max_shard_bytes`` of tensor data (one
    tensor over it gets its own shard), plus ``model.safetensors.index.json`` (transformers' layout) last.

    ``plan``: every tensor as ``(name, shape, dtype)`` in the order :meth:`add` will be given them (a dry run of
    the mapping on ``meta`` tensors gives it). Knowing every shard's tensors in advance, each file's header is
    written first and each tensor's bytes are appended as it arrives, so nothing of a shard stays in memory
    (safetensors' ``save_file`` takes the whole shard, up to 5 GB, as one dict). The files are the safetensors
    format (its specification: 8-byte little-endian header length, a JSON header of ``dtype``, ``shape`` and
    ``data_offsets`` per tensor padded with spaces to 8 bytes, then the bytes in row-major order), read back by
    safetensors and transformers in the tests. A shard is named only when complete (``.part`` until then).
    ValueError when a tensor arrives out of plan.
    """

    def __init__(self, path: str, plan: list, max_shard_bytes: int = 5 * 10**9):
        groups: list[list] = [[]]
        size = 0
        for name, shape, dtype in plan:
            nbytes = _nbytes(shape, dtype)
            if groups[-1] and size + nbytes > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        self.path, self.groups = path, [g for g in groups if g]
        self.names = [f"model-{k + 1:05d}-of-{len(self.groups):05d}.safetensors" for k in range(len(self.groups))]
        self.shard, self.next, self.file = -1, 0, None
        self.total = sum(n for g in self.groups for *_, n in g)

    def _open(self) -> None:
        if self.shard + 1 == len(self.groups):
            raise ValueError(f"shard writer: every planned tensor of {len(self.groups)} shard(s) is already written")
        self.shard, self.next = self.shard + 1, 0
        table: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape, dtype, nbytes in self.groups[self.shard]:
            table[name] = {"dtype": SAFETENSORS_DTYPES[str(dtype)], "shape": list(shape)}
            table[name]["data_offsets"] = [offset, offset + nbytes]
            offset += nbytes
        header = json.dumps(table, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        self.file = open(os.path.join(self.path, self.names[self.shard] + ".part"), "wb")
        self.file.write(struct.pack("<Q", len(header)) + header)

    def add(self, name: str, tensor) -> None:
        """Append ``tensor`` (any device-CPU tensor; made contiguous) as ``name``, the plan's next tensor."""
        if self.file is None:
            self._open()
        want, shape, dtype, _ = self.groups[self.shard][self.next]
        if (name, tuple(tensor.shape), tensor.dtype) != (want, shape, dtype):
            raise ValueError(f"shard writer: got {name} {tuple(tensor.shape)} {tensor.dtype}, planned {want} {shape}")
        self.file.write(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
        self.next += 1
        if self.next == len(self.groups[self.shard]):
            self.file.close()
            self.file = None
            final = os.path.join(self.path, self.names[self.shard])
            os.replace(final + ".part", final)

    def close(self) -> list[str]:
        """Write the index (every planned tensor must have been added); returns the shard file names."""
        if self.file is not None or self.shard != len(self.groups) - 1:
            raise ValueError(f"shard writer: closed at shard {self.shard + 1} of {len(self.groups)}, incomplete")
        weight_map = {name: self.names[k] for k, g in enumerate(self.groups) for name, *_ in g}
        with open(os.path.join(self.path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": self.total}, "weight_map": weight_map}, f, indent=2)
        return self.names


def _nbytes(shape, dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= int(d)
    return n


def write_shards(path: str, tensors: dict, max_shard_bytes: int = 5 * 10**9) -> list[str]:
    """Write ``tensors`` (name -> tensor, in memory) with :class:`ShardWriter`, in name order; returns the shard
    file names."""
    names = sorted(tensors)
    writer = ShardWriter(path, [(n, tensors[n].shape, tensors[n].dtype) for n in names], max_shard_bytes)
    for n in names:
        writer.add(n, tensors[n])
    return writer.close()
