"""What ``python -m orchestrator --help`` says: the usage, the config groups and keys read from ``conf/``
and the schema, the sub-tools (:data:`TOOLS`, which the entry, :mod:`orchestrator.__main__`, dispatches
to) and the exit codes."""

from __future__ import annotations

TOOLS = {
    "manifest": ("orchestrator.ckpt.cli", "list a run's checkpoints; check one against a config"),
    "status": ("orchestrator.submit.status", "runs under a directory: job state, iteration, last loss"),
    "stop": ("orchestrator.submit.stop", "stop a live run: the ranks save, then exit (--now: at once)"),
    "sweep": ("orchestrator.sweep.driver", "summarize <sweep dir>: rebuild a sweep's results table"),
    "convert": ("orchestrator.convert.cli", "Megatron-LM arguments <-> orchestrator experiments"),
    "tune": ("orchestrator.sweep.tune", "planner-guided search for the fastest layout that fits"),
    "check": (
        "orchestrator.submit.check_links",
        "links OVERRIDES: measure a multi-node job's cross-node links, nothing trained",
    ),
    "megatron-config": (
        "orchestrator.convert.megatron_config_cli",
        "the megatron config a job builds (JSON), without a GPU or queueing anything",
    ),
}
"""Sub-tools: ``python -m orchestrator <tool> ...`` runs ``<module>.main(argv)``."""


def help_text() -> str:
    """The tool's own ``--help``: usage, the groups and options read from ``conf/``, the sub-tools."""
    import textwrap

    from orchestrator.config.hydra_errors import group_options
    from orchestrator.config.schema import JobConfig as _J
    from orchestrator.plan.inputs import GPU_PRESETS

    groups = group_options()
    width = max(len(g) for g in groups) + 2
    lines = [
        "usage: python -m orchestrator [+experiment=NAME] [GROUP=OPTION ...] [KEY=VALUE ...]",
        "       python -m orchestrator -m KEY=a,b,c ...      a sweep: one complete job per point",
        "       python -m orchestrator TOOL ARGS ...         TOOL: " + " | ".join(TOOLS),
        "       python -m orchestrator --help | --version",
        "your own configs (experiment/NAME.yaml, model/NAME.yaml ...): ./conf in the current directory and",
        "--config-dir DIR (or hydra.searchpath=[file://DIR]), searched ahead of the shipped conf/",
        "",
        "Compose a Megatron-core GPT run from conf/, validate it (no torch), print the layout, then train",
        "locally (cluster=local) or on SLURM. Rerunning a command resumes its run directory",
        "run.root/run.name; a resume the checkpoint cannot carry is refused with a diff.",
        "",
        "config groups (GROUP=OPTION; experiments with +experiment=NAME):",
    ]
    for group, options in groups.items():
        lines += textwrap.wrap(
            ", ".join(options), 100, initial_indent=f"  {group:<{width}}", subsequent_indent=" " * (width + 2)
        )
    lines += [
        "",
        "top-level keys:",
        "  plan=true      print the layout, memory per GPU, pipeline bubble and FLOPs and the resume verdict",
        "                 (would resume / start fresh, or refused with exit 2 as the run would), and stop (no torch)",
        "  dry_run=true   plan, then print the submission (the sbatch script on SLURM), and stop",
        "  plan_picture=FILE.png  with plan=true: draw the predicted schedule and the memory per stage",
        '  plan_headroom=0.85  share of device memory a plan may use and say "fits"; above it "tight", with suggestions',
        "  gpu=NAME       the planner's GPU preset: " + ", ".join(GPU_PRESETS),
        "  run.name=NAME  the run directory is run.root/run.name (run.root=runs); an experiment's run is",
        "                 named by the experiment (its run.name, else its own name) plus the groups",
        "                 chosen on the command line",
        "",
        "config keys (KEY=VALUE, a section's keys are SECTION.KEY):",
    ]
    import dataclasses

    for f in dataclasses.fields(_J):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        if dataclasses.is_dataclass(sub):
            names = ", ".join(x.name for x in dataclasses.fields(sub) if not (x.name == "name" and f.name in groups))
            lines += textwrap.wrap(
                names, 100, initial_indent=f"  {f.name:<{width + 2}}", subsequent_indent=" " * (width + 4)
            )
    lines += ["", "sub-tools (python -m orchestrator TOOL --help):"]
    lines += [f"  {name:<10} {description}" for name, (_, description) in TOOLS.items()]
    lines += [
        "",
        "exit codes: 0 done | 1 a job failed (the failing rank's last lines are shown) | 2 a user error:",
        "one line `error: <key>: <what>; fix: <how>`, before anything is prepared or queued | 130/143/129 a local",
        "job stopped by SIGINT/SIGTERM/SIGHUP to this launcher (the ranks save first; a second signal: at once) |",
        "a SLURM job is never stopped by a signal to its launcher: it detaches, exit 0 (`stop RUN` stops it)",
        "Hydra's inspection flags work too: --cfg job, --resolve, --info.",
    ]
    return "\n".join(lines)
