"""``python -m orchestrator convert`` (also ``python -m orchestrator.convert``): Megatron-LM <-> Hydra.

``from-megatron FILE [--name NAME] [--out DIR] [--nodes N --gpus-per-node G] [--gpu PRESET] [--var K=V]``
    reads a Megatron-LM launch (shell script, args YAML or JSON), writes ``DIR/experiment/NAME.yaml``
    (``DIR`` defaults to ``./conf``, the user's config directory that ``python -m orchestrator``
    searches ahead of the shipped conf/ from this directory), prints every finding, then composes the experiment,
    validates it and prints the plan (layout, memory verdict, pipeline bubble). Exit 0, or 2 with
    one ``error:`` line when the source or the composed config is refused (the file stays written).
``to-megatron [--out FILE] OVERRIDES...``
    composes ``OVERRIDES`` (``+experiment=gpt_pp2_dp2 ...``), validates, and prints the Megatron-LM
    ``pretrain_gpt.py`` launch (``#SBATCH`` + ``srun torchrun`` on SLURM, ``torchrun`` locally).
    ``from-megatron`` of that script composes to the same config.
``from-hf PATH [--name NAME] [--out DIR] [--seq-length S]``
    a Hugging Face model directory -> ``DIR/experiment/NAME.yaml`` whose model builds its weights and
    whose ``checkpoint.init_from`` is ``hf:PATH`` (:mod:`orchestrator.convert.hf_cli`).
``to-hf RUN OUT [--iteration N] [--eval-batch FILE]``
    a run's checkpoint, any layout, as a Hugging Face directory transformers loads (imports torch).

No torch import but ``to-hf``'s: the others run on a login node in about a second.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from fractions import Fraction
from pathlib import Path
from typing import Dict, List, Optional

from orchestrator.convert import hf_cli
from orchestrator.errors import ConfigError, OneLineArgumentParser, OrchestratorError


def _parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(
        prog="python -m orchestrator convert",
        description="Convert Megatron-LM launches to orchestrator experiments and back.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("from-megatron", help="a Megatron-LM script / args YAML / JSON -> conf/experiment/NAME.yaml")
    imp.add_argument("file", help="shell script (torchrun/srun/#SBATCH), args YAML or JSON")
    imp.add_argument("--name", help="experiment name (default: the file's name)")
    imp.add_argument(
        "--out",
        "--config-dir",
        dest="out",
        help="config directory: the file goes to OUT/experiment/NAME.yaml (default ./conf, which "
        "python -m orchestrator searches ahead of the shipped conf/)",
    )
    imp.add_argument("--nodes", type=int, help="nodes, when the source has no launcher line saying it")
    imp.add_argument("--gpus-per-node", type=int, help="GPUs (processes) per node, likewise")
    imp.add_argument("--gpu", help="planner GPU preset written into the experiment (A100-40GB, A100-80GB, H100, H200)")
    imp.add_argument(
        "--var",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="define a shell variable the script reads ($1, $DATA_PATH, ...)",
    )
    imp.add_argument("--force", action="store_true", help="overwrite an existing experiment file")
    hf_cli.add_parser(sub)
    hf_cli.add_export_parser(sub)
    exp = sub.add_parser("to-megatron", help="a composed config -> Megatron-LM pretrain_gpt.py launch script")
    exp.add_argument("--out", help="write the script to this file instead of printing it")
    exp.add_argument(
        "--config-dir",
        action="append",
        default=[],
        help="a config directory searched ahead of the shipped conf/ (./conf is searched without it)",
    )
    exp.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. +experiment=gpt_pp2_dp2")
    return parser


def _variables(items: List[str]) -> Dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_]\w*|\d+", name):
            raise ConfigError(f"--var: {item!r} is not NAME=VALUE; fix: e.g. --var DATA_PATH=/data/my_text_document")
        out[name] = value
    return out


def _name(args) -> str:
    name = args.name or re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(args.file).stem).strip("._") or "imported"
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
        raise ConfigError(f"--name: {name!r} is not a file name for conf/experiment; fix: letters, digits, _ . -")
    return name


def out_root(out: Optional[str]) -> Path:
    """Where the experiment goes: ``--out DIR``, else ``./conf`` (the user's config directory,
    :mod:`orchestrator.config.confdirs`; in a source checkout that is the shipped tree)."""
    from orchestrator.config.confdirs import USER_CONF

    return Path(out) if out else Path(USER_CONF)


def bubble_line(layout) -> str:
    """The pipeline bubble as an exact fraction: (PP-1)/(VPP x m), Narayanan et al. 2021 sec. 2.2."""
    p, v, m = layout.pipeline_model_parallel_size, layout.vpp, layout.num_microbatches
    if p == 1:
        return "pipeline bubble: none (PP 1)"
    frac = Fraction(p - 1, v * m)
    shown = f"{frac.numerator}/{frac.denominator}" if frac.denominator != 1 else str(frac.numerator)
    if layout.interleaved:
        return (
            f"pipeline bubble (interleaved 1F1B): (PP - 1) / (VPP × m) = ({p} - 1) / ({v} × {m}) = {shown} "
            f"= {float(frac):.1%} of the ideal step time"
        )
    return (
        f"pipeline bubble (1F1B): (PP - 1) / m = ({p} - 1) / {m} = {shown} = {float(frac):.1%} of the ideal step time"
    )


def check(cfg):
    """(layout, warnings): :func:`~orchestrator.config.checks.validate_planned` on ``cfg`` as a plan
    (data problems are warnings), plus whether this machine could run it."""
    import dataclasses

    from orchestrator.config.checks import validate_planned
    from orchestrator.config.machine import check_local_gpus

    layout, warnings = validate_planned(dataclasses.replace(cfg, plan=True))  # the job as described
    try:
        check_local_gpus(dataclasses.replace(cfg, plan=False, dry_run=False))
    except OrchestratorError as exc:
        warnings.append(f"to run it here: {exc}")
    return layout, warnings


def _show_plan(cfg, layout, vocab_size: Optional[int]) -> None:
    from orchestrator.plan.memory import plan as make_plan
    from orchestrator.plan.report import format_plan
    from orchestrator.plan.suggest import format_suggestions, suggest

    print(format_plan(make_plan(cfg, vocab_size=vocab_size)))
    suggestions = suggest(cfg, vocab_size=vocab_size)
    if suggestions:
        print(format_suggestions(suggestions))
    print(bubble_line(layout))


def check_defined(source, argv: List[str]) -> None:
    """ConfigError naming, in one line, every variable the script leaves undefined that a converted
    flag reads, and the one command that defines them all (``--var NAME=<what the script calls it>``)."""
    from orchestrator.convert.to_config import undefined_variables

    missing = undefined_variables(source)
    if not missing:
        return
    what = ", ".join(
        f"${n} ({source.holders[n] + ': ' if n in source.holders else ''}{', '.join(flags)})"
        for n, flags in missing.items()
    )
    words = [w for n in missing for w in ("--var", f"{n}=<{source.holders.get(n, 'value')}>")]
    raise ConfigError(
        f"--var: {source.path} leaves {len(missing)} variable{'s' * (len(missing) > 1)} undefined "
        f"that converted flags read: {what} (set when the script runs); fix: python -m orchestrator "
        f"convert {shlex.join([*argv, *words])}"
    )


def from_megatron(args) -> int:
    """Import, write, then compose + validate + plan at once (see the module docstring)."""
    from orchestrator.convert import experiment_file
    from orchestrator.convert.read import read_source
    from orchestrator.convert.to_config import convert

    source = read_source(args.file, _variables(args.var))
    check_defined(source, args.argv)
    name, root = _name(args), out_root(args.out)
    conv = convert(source, name, args.nodes, args.gpus_per_node, args.gpu)
    path = experiment_file.write(conv, root, args.force)
    print(experiment_file.screen(conv, str(path)), flush=True)
    search = experiment_file.search_overrides(root)
    try:
        cfg = experiment_file.compose([f"+experiment={name}"], root)
        layout, warnings = check(cfg)
    except OrchestratorError as exc:
        print(f"refused: {path} stays written; fix the source (or that file) and convert again", flush=True)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"composed +experiment={name}: valid")
    for warning in warnings:
        print(f"warning: {warning}")
    _show_plan(cfg, layout, conv.vocab_size)
    words = [*search, f"+experiment={name}", "plan=true"]
    print(
        "next: python -m orchestrator "
        + " ".join(shlex.quote(w) for w in words)
        + ("" if search else "   (from this directory: ./conf is searched ahead of the shipped conf/)")
    )
    return 0


def _config_dirs(dirs: List[str]) -> List[str]:
    from orchestrator.config.confdirs import with_config_dir_flags

    return with_config_dir_flags([w for d in dirs for w in ("--config-dir", d)])


def to_megatron(args) -> int:
    """Compose, validate, print (or write) the Megatron-LM launch script."""
    from orchestrator.convert.experiment_file import compose
    from orchestrator.convert.from_config import export

    cfg = compose([*args.overrides, *_config_dirs(args.config_dir)])
    layout, warnings = check(cfg)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    text = export(cfg, list(args.overrides), layout.world_size)
    if args.out:
        from orchestrator.io import write_atomic

        write_atomic(args.out, text, fsync=False)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point; returns the exit code (0 ok, 2 user error with one ``error:`` line)."""
    args = _parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "from-hf":
            return hf_cli.from_hf(args, check, out_root)
        if args.command == "to-hf":
            return hf_cli.to_hf(args)
        return from_megatron(args) if args.command == "from-megatron" else to_megatron(args)
    except OrchestratorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
