"""A rank process's start-up: what it keeps out of its imports, and megatron-core's jit fuser on CPU.

A rank spends most of its start-up importing torch and megatron-core (3 CPU-s on this project's CI
machine, Python 3.11, megatron-core 0.16.1, before this module's savings), and a local job's ranks, or
a SLURM job's tasks, pay it each. Five parts of it never serve a rank:

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
* torch's inductor (0.8-1.1 CPU-s per process, measured on :func:`orchestrator.runtime.start.forked.preload`
  under megatron-core 0.19.2: 4.3-4.5 -> 3.2-3.4 CPU-s), imported by the ``@torch.compile`` that 0.19's
  ``megatron.core.transformer.moe.router`` applies as it is imported (``InferenceTopKRouter``'s routing: inference
  only, never called in training): on a CPU job that module is imported with ``torch.compile`` deferred to the
  decorated function's first call (:data:`COMPILES_AT_IMPORT`).

What this relies on in megatron-core is the same in both lines (listed in
:mod:`orchestrator.runtime.rank.mcore`); the savings were measured with ``time.process_time`` around the
rank's imports (:func:`orchestrator.runtime.start.forked.preload`).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable, Optional

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


COMPILES_AT_IMPORT = "megatron.core.transformer.moe.router"
"""The megatron-core module (0.19.x) that calls ``torch.compile`` while it is imported; 0.16.x's does not."""


class _OnImport(importlib.abc.MetaPathFinder):
    """Finds module ``name`` with the regular path finder (once) and has ``run(exec_module, module)`` execute it."""

    def __init__(self, name: str, run: Callable[[Callable[[Any], None], Any], None]):
        self.name, self.run = name, run

    def find_spec(self, name: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if name != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _RunExec(spec.loader, self.run)
        return spec


class _RunExec(importlib.abc.Loader):
    def __init__(self, loader: Any, run: Callable[[Callable[[Any], None], Any], None]):
        self.loader, self.run = loader, run

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.run(self.loader.exec_module, module)


def _then_disable_jit_fuser(exec_module: Callable[[Any], None], module: Any) -> None:
    exec_module(module)
    module.disable_jit_fuser()


def deferred_compile(compile_: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.compile`` (as ``compile_(fn, **options)`` or ``@compile_(**options)``) that compiles ``fn`` at its
    first call instead of at once: the same function to its callers, no inductor import until it is called."""

    def defer(fn: Optional[Callable[..., Any]] = None, **options: Any) -> Any:
        if fn is None:
            return lambda f: defer(f, **options)
        compiled: list = []

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(compile_(fn, **options))
            return compiled[0](*args, **kwargs)

        return call

    return defer


def _with_compile_deferred(exec_module: Callable[[Any], None], module: Any) -> None:
    import torch

    compile_ = torch.compile
    torch.compile = deferred_compile(compile_)
    try:
        exec_module(module)
    finally:
        torch.compile = compile_


def jit_fuser_off() -> None:
    """megatron-core's ``jit_fuser`` decorator as its own ``disable_jit_fuser()`` leaves it (the function
    unchanged) instead of ``torch.compile``, for a job on CPU; and :data:`COMPILES_AT_IMPORT` imported with
    ``torch.compile`` deferred (:func:`deferred_compile`). megatron's modules bind ``jit_fuser`` when they are
    imported (``from megatron.core.jit import jit_fuser``), so this must run before megatron-core is imported:
    it installs import hooks, one that disables it as soon as ``megatron.core.jit`` has loaded. Called later,
    it disables it for the modules not imported yet."""
    hooks = [f.name for f in sys.meta_path if isinstance(f, _OnImport)]
    jit = sys.modules.get("megatron.core.jit")
    if jit is not None:
        jit.disable_jit_fuser()
    elif "megatron.core.jit" not in hooks:
        sys.meta_path.insert(0, _OnImport("megatron.core.jit", _then_disable_jit_fuser))
    if COMPILES_AT_IMPORT not in sys.modules and COMPILES_AT_IMPORT not in hooks:
        sys.meta_path.insert(0, _OnImport(COMPILES_AT_IMPORT, _with_compile_deferred))


def on_cpu(device: str) -> bool:
    """Whether a rank with ``training.device=device`` (auto/cpu/cuda) trains on CPU: ``cpu``, or a task that
    sees no GPU (the rule of :func:`orchestrator.runtime.rank.distributed.choose_binding`, which refuses
    ``cuda`` there)."""
    if device == "cpu":
        return True
    import torch

    return torch.cuda.device_count() == 0


def pause_collector() -> None:
    """Python's cyclic garbage collector off for a rank's start-up (until :func:`resume_collector`).

    Start-up makes hundreds of thousands of long-lived objects (torch's and megatron-core's modules, the model)
    and little garbage, and every full collection traverses all of them: measured on a PP2 x DP2 job's rank 0
    (gc.callbacks), 6 full collections during its imports and the fork took 1.7 s on a loaded machine and freed
    under 100 objects each. The Python documentation's recipe for processes that fork (``gc.freeze``): disable
    early, freeze before the fork (runtime.start.forked), enable again in the children."""
    import gc

    gc.disable()


def resume_collector() -> None:
    """Before the training loop: one collection of start-up's garbage, then what start-up made and keeps is
    frozen (never traversed again, nor copied in the forks' pages by the collector's bookkeeping) and
    collection is back on for what training makes."""
    import gc

    if not gc.isenabled():  # a warm pool's rank (runtime.start.pool) never paused it: nothing to freeze there
        gc.collect()  # start-up's own garbage (~11k objects, 6-7 MB) is freed, not frozen; a forked rank's
        gc.freeze()  # imports were frozen at the fork, so this traverses only what it made since
        gc.enable()
