"""``python -m orchestrator megatron-config [--config-dir DIR] OVERRIDES...``: the megatron config a job would build, as JSON.

Prints ``{"transformer", "ddp", "optimizer"}`` — what the job writes to ``<run.dir>/megatron_config.json``
— for any job, a SLURM GPU job included, without a GPU and without writing or queueing anything: the
config is composed and validated as a plan is (a bad layout: one ``error:`` line, exit 2), then
:func:`orchestrator.runtime.rank.megatron_config.build` runs (megatron-core is imported, no CUDA call).
The installed facts are this machine's for a local job (a Transformer Engine that fails to import is
refused in one line); for a SLURM GPU job they are assumed, and said on stderr: the GPU nodes have
Transformer Engine and apex's fused weight-gradient kernel (NVIDIA's PyTorch containers), unless
``model.transformer_impl=local``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import sys
from typing import List, Optional

from orchestrator.errors import OrchestratorError, plain


def megatron_json(cfg, dp: Optional[int] = None) -> tuple:
    """(the megatron config of ``cfg`` at data-parallel size ``dp`` (default: its validated layout's) as JSON, the
    device, what was assumed about the GPU nodes or None)."""
    from orchestrator.config.machine import runs_on_cpu
    from orchestrator.runtime.rank import megatron_config as mcfg
    from orchestrator.runtime.rank.mcore import version

    device = "cpu" if runs_on_cpu(cfg) else "cuda"
    assumed = None
    if device == "cpu":
        facts = mcfg.Installed(False, False, version())
    elif cfg.cluster.kind == "local":
        facts = mcfg.installed(cfg.model.transformer_impl)
    else:
        te = cfg.model.transformer_impl != "local"
        facts = mcfg.Installed(te, True, version())
        assumed = (
            f"assumed on the GPU nodes: Transformer Engine {'installed' if te else 'not used'}, apex's "
            "fused weight-gradient kernel (NVIDIA's PyTorch containers); the job records what it built "
            "in <run.dir>/megatron_config.json"
        )
    if dp is None:
        from orchestrator.config.layout import layout_from_config

        dp = layout_from_config(cfg).data_parallel_size
    return mcfg.build(cfg, device, facts, dp).as_json(), device, assumed


LEAN_KEPT_OUT = ("wandb", "boto3", "botocore", "fsspec")
"""What this command keeps out of megatron-core's import: wandb (megatron imports it at import and never calls it
here; 0.9-1.4 CPU-s) and the optional remote-storage packages TensorBoard's file layer tries at import (megatron's
``timers`` imports ``torch.utils.tensorboard``; boto3/botocore/fsspec: 0.13 s on this machine), which only an
``s3://``-style log directory would use, and this command writes no log."""


@contextlib.contextmanager
def lean_imports():
    """megatron-core imported for its three config dataclasses only: without :data:`LEAN_KEPT_OUT` and without the
    ``torch.compile`` set-up of its jit-fused kernels, which this process never runs
    (:mod:`orchestrator.runtime.rank.startup`, as a CPU rank does): 4.9 -> 2.8 CPU-s for the whole command; and
    without the cyclic collector's full collections over those imports (as a rank's start-up,
    ``startup.pause_collector``). What was kept out is let in again after, and the collector is on again (an
    in-process caller may use them)."""
    from orchestrator.runtime.rank import startup

    kept_out = [name for name in LEAN_KEPT_OUT if name not in sys.modules]
    for name in kept_out:
        sys.modules[name] = None  # type: ignore[assignment]  (Python's documented way: import raises)
    startup.jit_fuser_off()
    collecting = gc.isenabled()
    gc.disable()  # importing torch and megatron-core makes ~300k objects and no garbage: no full collections
    try:
        yield
    finally:
        if collecting:
            gc.enable()
        for name in kept_out:
            startup.let_in(name)


def main(argv: Optional[List[str]] = None) -> int:
    """Compose + validate (as ``plan=true``), build, print; exit 2 with one line on a user error."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(plain(__doc__))
        return 0
    from orchestrator.config.checks import validate
    from orchestrator.config.compose import compose_config
    from orchestrator.config.confdirs import with_config_dir_flags

    try:  # --config-dir DIR: the user's configs, as for a run
        cfg = dataclasses.replace(
            compose_config(with_config_dir_flags(argv)), plan=True
        )  # plan: nothing is written, nothing queued
        layout = validate(cfg)
        print("[orchestrator] config valid; importing megatron-core to build its three configs", file=sys.stderr)
        with lean_imports():
            config, device, assumed = megatron_json(cfg, layout.data_parallel_size)
    except OrchestratorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"megatron config for device={device} (megatron-core field names)", file=sys.stderr)
    if assumed:
        print(assumed, file=sys.stderr)
    print(json.dumps(config, indent=1, sort_keys=True))
    return 0
