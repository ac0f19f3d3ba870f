"""``python -m orchestrator [+experiment=NAME] [overrides]`` — compose, validate, plan, preflight, submit.

The entry reads top to bottom:

1. ``conf/`` is composed against the closed schema (:func:`orchestrator.config.compose.compose_config`:
   Hydra's compose API, so nothing is written anywhere by composing).
2. :func:`~orchestrator.config.checks.validate` — the one validate — checks every rule (values,
   layout, model, device, data, ``run.name``); pure Python, no torch.
3. The derived numbers are printed. ``plan=true`` prints the planner's estimates and the resume
   verdict of step 4 (a refusal exits 2 as the run would) and stops; ``dry_run=true`` also prints the
   submission (the sbatch script on SLURM) and stops.
4. Preflight, before anything expensive: a checkpoint in the run directory that the request
   cannot resume from is refused (data compared by content fingerprint, hashed, not tokenized);
   a live run holding the directory's lock is refused.
5. Data are prepared on this machine (tokenized, indexed, sample indices cached).
6. The run starts: its resolved config is recorded as ``<run.dir>/config.yaml`` (only now: plan,
   dry-run and every refusal leave the run directory as it was) and submitit submits one task
   per rank and, by default, waits and streams progress.

One error boundary (:func:`main`): every user error — ours
(:class:`~orchestrator.errors.OrchestratorError`), Hydra's and OmegaConf's — prints exactly one
``error: <key>: <what>; fix: <how>`` line on stderr (a resume refusal adds its diff table below)
and exits 2, before anything is prepared or queued. A failed job exits 1 with the failing rank's
last lines; a signal while a job is waited on follows :mod:`orchestrator.submit.signals` (a local job's
ranks save and stop, 128 + the signal; a SLURM job is left running, 0); before that, 128 + the signal too
(Ctrl-C: 130), with one ``interrupted (SIGNAME): ...`` line.

Multirun (``-m``, e.g. ``training.micro_batch_size=1,2,4``): every value of every swept key is
composed first (a typo stops the sweep with exit 2 before any point runs); then Hydra's sweeper
and launcher run each point through the same pipeline, one after another; a point's error is
recorded in its ``point.json`` instead of exiting, and after the last point
:mod:`orchestrator.sweep` prints the ranked results table and sets the exit code (1 if a point
failed, 2 if one was invalid).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable, List, Optional

from orchestrator.cli_flags import Flags
from orchestrator.config.schema import JobConfig
from orchestrator.errors import OrchestratorError
from orchestrator.pipeline import Current, run  # run: the single-run pipeline
from orchestrator.usage import TOOLS, help_text


# ---------------------------------------------------------------- the error boundary
def _user_error_types() -> tuple:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from yaml import YAMLError

    return OrchestratorError, HydraException, OmegaConfBaseException, YAMLError


def report(exc: BaseException) -> int:
    """Print a user error as one ``error:`` line (a resume diff follows it); return the exit code."""
    if not isinstance(exc, OrchestratorError):
        from orchestrator.config.hydra_errors import hydra_error

        exc = hydra_error(exc)
    first, *rest = str(exc).strip().splitlines() or [type(exc).__name__]
    print(f"error: {first}", file=sys.stderr, flush=True)
    if rest:
        print("\n".join(rest), file=sys.stderr, flush=True)
    return exc.exit_code  # type: ignore[attr-defined]


def interrupted(cfg: Optional[JobConfig], signum: int = signal.SIGINT) -> str:
    """The interrupt line, naming the signal; the resume hint only when the run directory holds a checkpoint."""
    line = f"interrupted ({signal.Signals(signum).name}): stopped (the job's ranks too, if any had started)"
    if cfg is None:
        return line
    try:
        from orchestrator.ckpt.catalogue import latest_complete
        from orchestrator.ckpt.manifest import save_dir_of

        latest = latest_complete(save_dir_of(cfg), lambda _: None, verify=False)
    except Exception:  # a torn directory must not turn an interrupt into a traceback
        latest = None
    if latest is None:
        return f"{line}; no checkpoint in {cfg.run.dir}, so running the same command again starts from scratch"
    return f"{line}; run the same command again to resume from {latest.path} (iteration {latest.iteration})"


def guarded(body: Callable[[], int]) -> int:
    """Run ``body``; a user error prints one line (exit 2), a signal before a job is waited on exits 128 + its
    number (Ctrl-C: 130, SIGTERM: 143, SIGHUP: 129), no traceback."""
    from orchestrator.submit.signals import Detached, JobStopped, pending_signal, tell

    try:
        return body()
    except Detached as exc:  # a SLURM job left running: its line is printed already
        return exc.code
    except JobStopped as exc:
        tell(exc.line)
        return exc.code
    except KeyboardInterrupt:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # a second signal must not print a traceback
            signal.signal(sig, signal.SIG_IGN)
        signum = pending_signal()
        print(interrupted(Current.cfg, signum), file=sys.stderr, flush=True)
        return 128 + signum
    except _user_error_types() as exc:
        return report(exc)


# ---------------------------------------------------------------- single runs, sweeps, help
def announce_conf_dirs(overrides: List[str]) -> None:
    """Say which of the user's config directories are searched ahead of the shipped conf/."""
    from orchestrator.config.confdirs import user_conf_dirs
    from orchestrator.pipeline import say

    dirs = user_conf_dirs(overrides)
    if dirs:
        say(f"configs: {', '.join(str(d) for d in dirs)}, ahead of the shipped conf/")


def _single(overrides: List[str]) -> int:
    import shlex

    from orchestrator.config.compose import compose_config
    from orchestrator.meter import phase
    from orchestrator.pipeline import say

    with phase(f"composing {shlex.join(overrides) if overrides else 'the defaults'}", log=say):
        cfg = compose_config(overrides)
    announce_conf_dirs(overrides)
    run(cfg)
    return 0


def _entry(dcfg: Any) -> Optional[float]:
    """Hydra's task function: a multirun point (recorded, never raised), or a plain run."""
    from orchestrator.config.schema import to_job_config
    from orchestrator.sweep import driver as sweep

    point = sweep.current_point()
    if point is not None:
        return sweep.run_point(dcfg, point, run)
    summary = run(to_job_config(dcfg))
    return float(summary["lm_loss"]) if summary and summary.get("lm_loss") is not None else None


def _hydra(read: Flags) -> int:
    """Hand the command line to ``hydra.main`` (sweeps, inspection flags); its errors come back as exceptions."""
    import hydra

    from orchestrator.config.confdirs import conf_view, user_conf_dirs
    from orchestrator.config.schema import register_configs
    from orchestrator.submit.signals import Detached
    from orchestrator.sweep import driver as sweep

    register_configs()
    saved_argv, saved_env = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    sys.argv = [sys.argv[0], *read.hydra_argv()]
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing its own multi-line report
    try:
        try:
            # An absolute path: Hydra resolves a relative one against the calling module, which differs
            # between `python -m orchestrator`, the `orchestrator` console script and programmatic calls.
            view = conf_view(user_conf_dirs(read.overrides))
            hydra.main(config_path=str(view), config_name="config", version_base="1.3")(_entry)()
        finally:
            sys.argv = saved_argv
            if saved_env is None:
                os.environ.pop("HYDRA_FULL_ERROR", None)
            else:
                os.environ["HYDRA_FULL_ERROR"] = saved_env
        return sweep.finish() or 0  # None after a single run; after a multirun: table printed, exit code
    except Detached as exc:  # a SLURM sweep's queued points run on: one line for all of them
        sweep.detached(exc)
        raise


def _multirun(read: Flags) -> int:
    from orchestrator.config.compose import (
        check_overrides,
        compose_config,
        group_options,
        parse_overrides,
        sweep_checks,
        sweep_points,
    )
    from orchestrator.config.confdirs import conf_view, user_conf_dirs

    overrides = read.overrides
    searched = user_conf_dirs(overrides)
    check_overrides(
        parse_overrides(overrides), group_options(str(conf_view(searched))), multirun=True, searched=searched
    )
    announce_conf_dirs(overrides)
    for point in sweep_checks(overrides):
        cfg = compose_config(point)  # composition errors only: a point's invalid layout is recorded, not fatal
    from orchestrator.sweep import driver as sweep

    sweep.announce(*sweep_points(overrides), cfg.cluster.kind)  # in place of Hydra's "Launching N jobs" lines
    return _hydra(read)


def _show_job_config(read: Flags) -> int:
    """``--cfg job [--resolve]``: the composed config as YAML, the way a run would see it (run.dir set)."""
    from omegaconf import OmegaConf

    from orchestrator.config.compose import compose_dict

    print(OmegaConf.to_yaml(compose_dict(read.overrides), resolve="--resolve" in read.flags), end="")
    return 0


def _tool(name: str, argv: List[str]) -> int:
    import importlib

    module = TOOLS[name][0]
    try:
        tool = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if not (exc.name and module.startswith(exc.name)):
            raise
        print(
            f"error: {name}: not available in this version of orchestrator ({module} is missing); "
            f"fix: python -m orchestrator --help lists the sub-tools",
            file=sys.stderr,
        )
        return 2
    try:
        return tool.main(argv) or 0
    except BrokenPipeError:  # `status | head`: the reader has gone; nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _config_dir_flags(argv: List[str]) -> List[str]:
    """``--config-dir DIR`` as a ``hydra.searchpath`` override (one error line, exit 2, if malformed)."""
    from orchestrator.config.confdirs import with_config_dir_flags

    try:
        return with_config_dir_flags(argv)
    except OrchestratorError as exc:
        sys.exit(report(exc))


def main(argv: Optional[List[str]] = None) -> None:
    """The console script and ``python -m orchestrator``: dispatch, then exit with the run's code."""
    from_cli = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        code = _tool(argv[0], argv[1:])
        if from_cli and "torch" in sys.modules:  # megatron-config, tune, convert's weights: no teardown either
            _exit_fast(code)
        sys.exit(code)
    argv = _config_dir_flags(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        return
    if "--version" in argv or "-V" in argv:
        import orchestrator

        print(f"orchestrator {orchestrator.__version__}")
        return
    from orchestrator.submit.signals import interrupt

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # before a job is waited on: like Ctrl-C
        signal.signal(sig, interrupt)
    from orchestrator.cli_flags import HYDRA_FLAGS, read_flags

    try:
        read = read_flags(argv)
    except OrchestratorError as exc:
        sys.exit(report(exc))
    flags = set(read.flags)
    cfg_kind = read.values.get("--cfg", read.values.get("-c"))
    if cfg_kind == "job" and not {"-m", "--multirun", "--package", "-p"} & flags:
        code = guarded(lambda: _show_job_config(read))
    elif HYDRA_FLAGS & flags:
        code = guarded(lambda: _hydra(read))
    elif {"-m", "--multirun"} & flags:
        code = guarded(lambda: _multirun(read))
    else:
        code = guarded(lambda: _single(read.overrides))
    if from_cli and "torch" in sys.modules:
        _exit_fast(code)
    if code:
        sys.exit(code)


def _exit_fast(code: int) -> None:
    """Exit without the interpreter's teardown, once torch is imported (the launcher tokenized or built
    sample indices; a sub-tool built megatron-core's configs or read weights): collecting torch's and
    megatron-core's modules took 8-10 s of silence after the last line on 2 loaded cores (megatron-config:
    2.2 s at load 15). The atexit handlers still run; the output is flushed first."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(code)


if __name__ == "__main__":
    main()
