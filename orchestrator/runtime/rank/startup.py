"""A rank process's start-up: what it keeps out of its imports, and megatron-core's jit fuser on CPU.

A rank spends most of its start-up importing torch and megatron-core (3 CPU-s on this project's CI
machine, Python 3.11, megatron-core 0.16.1, before this module's savings), and a local job's ranks, or
a SLURM job's tasks, pay it each. Four parts of it never serve a rank:

* ``transformers`` (0.9 CPU-s per process, measured after megatron-core's own import): megatron-core's
  ``tokenizers.text`` imports it for its HuggingFace tokenizer, yet a rank never tokenizes -- it reads
  token ids and gets a byte or a null tokenizer (:func:`orchestrator.data.tokenizer.dataset_tokenizer`);
  the launcher tokenizes, in its own process.
* ``wandb`` (0.9-1.4 CPU-s) for a run that does not log to W&B: megatron-core imports it at import
  (``inference/contexts/dynamic_context.py``, ``timers.py``) though training never calls it.
* ``boto3`` / ``botocore`` (0.25 CPU-s per job, measured on :func:`orchestrator.runtime.start.forked.preload`):
  megatron-core's ``timers`` imports ``torch.utils.tensorboard``, whose file layer tries them at import for
  ``s3://`` log directories, and megatron-core's ``indexed_dataset`` for object-storage data; a rank's logs and
  data are local files (:mod:`orchestrator.data` prepares them on disk), so neither is ever used.
* ``torch.compile`` set-up for megatron-core's ``@jit_fuser`` kernels on a CPU job (0.75 CPU-s): the
  fused functions it decorates run only with the fusions the runtime turns off on CPU
  (:mod:`orchestrator.runtime.rank.model`), yet decorating them with ``torch.compile`` at import costs it.

What this relies on in megatron-core is the same in both lines (listed in
:mod:`orchestrator.runtime.rank.mcore`); the savings were measured with ``time.process_time`` around the
rank's imports (:func:`orchestrator.runtime.start.forked.preload`).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any, Optional

KEPT_OUT = ("transformers", "boto3", "botocore")
"""Packages no rank process imports (``sys.modules[name] = None``, Python's documented way to make an
import raise ImportError): see the module docstring."""


def keep_out(*, wandb: bool) -> None:
    """Make ``import transformers`` (and ``import wandb`` when ``wandb``) fail in this process; never for a
    package already imported. Called by a job's task process before megatron-core is imported."""
    for name in KEPT_OUT + (("wandb",) if wandb else ()):
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def let_wandb_in() -> None:
    """Undo :func:`keep_out`'s wandb (a warm pool's later trial logging to W&B); megatron's own modules
    keep the None they imported, and never call wandb in training."""
    if "wandb" in sys.modules and sys.modules["wandb"] is None:
        del sys.modules["wandb"]


def let_in(name: str) -> None:
    """Undo :func:`keep_out` for ``name`` in this process only (the rank that checks imported Hugging Face weights
    against transformers' model: ``runtime.training.hf_start``)."""
    if name in sys.modules and sys.modules[name] is None:
        del sys.modules[name]


class _JitFuserOff(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` with the regular path finder and runs its ``disable_jit_fuser()`` the
    moment the module has executed, before any megatron module takes ``jit_fuser`` from it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name != "megatron.core.jit":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _DisableAfterExec(spec.loader)
        return spec


class _DisableAfterExec(importlib.abc.Loader):
    def __init__(self, loader: Any):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        module.disable_jit_fuser()


def jit_fuser_off() -> None:
    """megatron-core's ``jit_fuser`` decorator as its own ``disable_jit_fuser()`` leaves it (the function
    unchanged) instead of ``torch.compile``, for a job on CPU. megatron's modules bind ``jit_fuser`` when
    they are imported (``from megatron.core.jit import jit_fuser``), so this must run before megatron-core
    is imported: it installs an import hook that disables it as soon as ``megatron.core.jit`` has loaded.
    Called later, it disables it for the modules not imported yet."""
    jit = sys.modules.get("megatron.core.jit")
    if jit is not None:
        jit.disable_jit_fuser()
    elif not any(isinstance(f, _JitFuserOff) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitFuserOff())


def on_cpu(device: str) -> bool:
    """Whether a rank with ``training.device=device`` (auto/cpu/cuda) trains on CPU: ``cpu``, or a task that
    sees no GPU (the rule of :func:`orchestrator.runtime.rank.distributed.choose_binding`, which refuses
    ``cuda`` there)."""
    if device == "cpu":
        return True
    import torch

    return torch.cuda.device_count() == 0
