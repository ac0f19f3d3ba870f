"""``python -m orchestrator [+experiment=NAME] [overrides]`` — compose, validate, plan, preflight, submit.

The entry reads top to bottom:

1. Hydra composes ``conf/`` against the typed schema; :func:`to_job_config` ends OmegaConf's reach.
2. The parallel layout is built and validated (pure Python, no torch): bad arithmetic stops here.
3. The derived numbers are printed. ``plan=true`` prints the planner's estimates and stops;
   ``dry_run=true`` also prints the submission (the sbatch script on SLURM) and stops.
4. Data are prepared on this machine (tokenized, indexed, sample indices cached).
5. Preflight: a checkpoint in the run directory with a different layout is refused now,
   before anything is queued; a run lock refuses a second live run on the same directory.
6. submitit submits one task per rank and, by default, waits and streams progress.

User errors (:class:`~orchestrator.errors.OrchestratorError`) print one ``error:`` message and
exit with code 2 (1 for a failed job); there is no traceback for them.

Multirun (``-m``, e.g. ``training.micro_batch_size=1,2,4``): each point runs the same pipeline as
one job, one after another; a point's error is recorded in its ``point.json`` instead of exiting,
and after the last point :mod:`orchestrator.sweep` prints the ranked results table and sets the
exit code (1 if a point failed, 2 if one was invalid).
"""

from __future__ import annotations

import sys
from typing import Any, Optional


from orchestrator.spec.schema import JobConfig, register_configs, to_job_config
from orchestrator.errors import OrchestratorError
from orchestrator.spec.checks import validate
from orchestrator.spec.layout import ParallelLayout


def say(message: str) -> None:
    print("\n".join(f"[orchestrator] {line}" for line in message.splitlines()), flush=True)


def show_plan(cfg: JobConfig) -> None:
    from orchestrator.plan import memory as planner
    from orchestrator.plan import suggest
    from orchestrator.plan.report import format_plan

    print(format_plan(planner.plan(cfg)), flush=True)
    suggestions = suggest.suggest(cfg)
    if suggestions:
        print(suggest.format_suggestions(suggestions), flush=True)


def dry_run(cfg: JobConfig, layout: ParallelLayout) -> None:
    if cfg.cluster.kind == "slurm":
        from orchestrator.submit.sbatch import render_sbatch

        print(render_sbatch(cfg, layout.world_size, f"{cfg.run.dir}/submitit"), flush=True)
    else:
        say(f"would start {layout.world_size} local processes (submitit LocalExecutor) in {cfg.run.dir}")


def prepare_data(cfg: JobConfig):
    """Tokenize/index the data and build GPTDataset's sample indices once, before any rank starts."""
    from orchestrator.runtime.data import build_tokenizer, build_train_dataset, prepare, samples_needed

    prepared = prepare(cfg.data)
    build_train_dataset(cfg, prepared, build_tokenizer(cfg.data), samples_needed(cfg))
    return prepared


def run(cfg: JobConfig) -> Optional[dict]:
    """The whole pipeline for one composed config; returns the job summary (None for plan/dry-run)."""
    layout = validate(cfg)
    say(f"run {cfg.run.name}: {cfg.model.name} x {cfg.parallelism.name} on cluster={cfg.cluster.name}")
    say(layout.summary())
    if cfg.plan or cfg.dry_run:
        show_plan(cfg)
        if cfg.dry_run:
            dry_run(cfg, layout)
        return None

    from orchestrator.ckpt import resume
    from orchestrator.ckpt.lock import RunLock
    from orchestrator.runtime.data import tokenizer_identity
    from orchestrator.submit.executor import launch

    if cfg.checkpoint.init_from:
        from orchestrator.ckpt.manifest import read_manifest

        read_manifest(cfg.checkpoint.init_from)  # ManifestError naming the file, before anything starts
    prepared = prepare_data(cfg)
    latest = resume.preflight(cfg, layout, data_fingerprint=prepared.fingerprint,
                              tokenizer=tokenizer_identity(cfg.data), warn=lambda m: say(f"warning: {m}"))
    if latest is not None:
        if latest.iteration >= cfg.training.train_iters:
            say(f"{latest.path} is already at iteration {latest.iteration} >= training.train_iters="
                f"{cfg.training.train_iters}: nothing to train (raise training.train_iters to continue)")
            return {"status": "already_done", "iteration": latest.iteration}
        say(f"will resume from {latest.path} (iteration {latest.iteration})")
    RunLock(cfg.run.dir).probe()  # a live holder: refuse now; the job's rank 0 takes the lock itself
    summary = launch(cfg, layout, prepared)
    if summary.get("status") in ("completed", "exited", "stopped"):
        step = summary.get("step_time_median_s")
        say(f"{summary['status']}: iteration {summary.get('iteration')} | lm loss {summary.get('lm_loss'):.4f}"
            + (f" | median step {step * 1000:.1f} ms | {layout.tokens_per_step / step:.0f} tokens/s" if step else "")
            + f" | job {summary.get('job_id')}")
    return summary


def _entry(dcfg: Any) -> Optional[float]:
    from orchestrator.sweep import driver as sweep

    point = sweep.current_point()
    if point is not None:  # multirun: record the point (never sys.exit), see orchestrator/sweep.py
        return sweep.run_point(dcfg, point, run)
    try:
        cfg = to_job_config(dcfg)
        summary = run(cfg)
    except OrchestratorError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        print("interrupted: the job's ranks were stopped; run the same command again to resume from the "
              "latest checkpoint", file=sys.stderr, flush=True)
        sys.exit(130)
    if summary and summary.get("lm_loss") is not None:
        return float(summary["lm_loss"])
    return None


TOOLS = {
    "manifest": "orchestrator.ckpt.cli",
    "status": "orchestrator.submit.status",
    "sweep": "orchestrator.sweep.driver",
}
"""Sub-tools: ``python -m orchestrator <tool> ...`` runs ``<module>.main(argv)``."""


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:
        import importlib

        sys.exit(importlib.import_module(TOOLS[sys.argv[1]]).main(sys.argv[2:]))
    import hydra

    from orchestrator.sweep import driver as sweep

    register_configs()
    import signal

    def _interrupt(signum, frame):  # a closed terminal or `kill` stops the local ranks too, like Ctrl-C
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    # An absolute path: Hydra resolves a relative one against the calling module, which differs
    # between `python -m orchestrator`, the `orchestrator` console script and programmatic calls.
    from orchestrator.spec.compose import conf_dir

    hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_entry)()
    code = sweep.finish()  # None after a single run; after a multirun: table printed, exit code
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
