"""``python -m orchestrator manifest`` — inspect checkpoints and check a config against one.

    python -m orchestrator manifest show  <ckpt_dir> [--json] [--no-verify | --deep]
    python -m orchestrator manifest check <ckpt_dir> [--deep] -- <hydra overrides...>   # exit 0 ok, 1 refused
    python -m orchestrator manifest list  <run_dir | save_dir> [--no-verify | --deep]

Verification is cheap by default (every file's size, dist_checkpointing's metadata and small files
re-hashed); ``--deep`` re-hashes every file whose sha256 the manifest holds (``checkpoint.digest=sha256``
records them all) and says how many it could only size-check.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

from orchestrator.ckpt.catalogue import list_checkpoints
from orchestrator.ckpt.manifest import MANIFEST_NAME, read_manifest
from orchestrator.errors import ManifestError, OneLineArgumentParser


def _summary(manifest: dict) -> str:
    lay, mod, files = manifest["layout"], manifest["model"], manifest["files"]
    vpp = lay.get("virtual_pipeline_model_parallel_size")
    return "\n".join(
        [
            f"iteration {manifest['iteration']}  consumed_samples {manifest['consumed_samples']}  "
            f"created {manifest.get('created')} on {manifest.get('host')}",
            f"layout: world {lay['world_size']} = TP {lay['tensor_model_parallel_size']} x PP "
            f"{lay['pipeline_model_parallel_size']} x CP {lay['context_parallel_size']} x DP "
            f"{lay['data_parallel_size']}; VPP {vpp}; EP {lay['expert_model_parallel_size']}; "
            f"SP {lay['sequence_parallel']}; layers/stage {lay['layers_per_stage']}",
            f"batch: MBS {lay['micro_batch_size']} GBS {lay['global_batch_size']} "
            f"num_microbatches {lay['num_microbatches']}"
            + (
                f"; ramp-up {ramp} (start, increment, samples)"
                if (ramp := manifest.get("batch", {}).get("rampup_batch_size"))
                else ""
            ),
            f"model: {mod['num_layers']} layers, hidden {mod['hidden_size']}, heads {mod['num_attention_heads']}, "
            f"seq {mod['seq_length']}, vocab {mod['vocab_size']} (padded {mod['padded_vocab_size']})",
            f"tokenizer: {json.dumps(manifest['tokenizer'], sort_keys=True)}",
            f"data: {json.dumps({k: v for k, v in manifest['data'].items()}, sort_keys=True)}",
            f"checkpoint: {json.dumps(manifest['checkpoint'], sort_keys=True)}",
            f"versions: {json.dumps(manifest['versions'], sort_keys=True)}",
            f"origin: {json.dumps(manifest.get('origin'))}",
            f"files: {files['count']} files, {files['bytes']} bytes, {files['mode']} digest {files['sha256'][:16]}",
            f"hosts: {' '.join(manifest['hosts']) if manifest.get('hosts') else '-'}",
        ]
    )


def _deep_line(manifest: dict) -> str:
    entries = (manifest.get("files") or {}).get("entries", [])
    hashed = sum(1 for e in entries if "sha256" in e)
    sized = len(entries) - hashed
    return f"deep check: {hashed} file(s) re-hashed and matching" + (
        f"; {sized} checked by size only (saved with checkpoint.digest=size)" if sized else ""
    )


def _parser():

    parser = OneLineArgumentParser(prog="python -m orchestrator manifest", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_show = sub.add_parser("show", help="print a checkpoint's manifest")
    p_show.add_argument("ckpt_dir")
    p_show.add_argument("--json", action="store_true", help="the whole manifest as JSON")
    p_show.add_argument("--no-verify", action="store_true", help="skip checking the checkpoint files")
    p_show.add_argument("--deep", action="store_true", help="re-hash every file with a recorded sha256")
    p_check = sub.add_parser("check", help="compare a config (Hydra overrides) with a checkpoint; exit 1 if refused")
    p_check.add_argument("ckpt_dir")
    p_check.add_argument("overrides", nargs="*", help="Hydra overrides, after --")
    p_check.add_argument(
        "--config-dir",
        action="append",
        default=[],
        help="a config directory searched ahead of the shipped conf/ (./conf is searched without it)",
    )
    p_check.add_argument("--deep", action="store_true", help="re-hash every file with a recorded sha256")
    p_list = sub.add_parser("list", help="list a run's checkpoints with iteration, layout and status")
    p_list.add_argument("run_dir")
    p_list.add_argument("--no-verify", action="store_true")
    p_list.add_argument("--deep", action="store_true", help="re-hash every file with a recorded sha256")
    return parser


def show(args) -> int:
    """``manifest show``: the manifest (summary or JSON), verified unless ``--no-verify``."""
    directory = Path(args.ckpt_dir)
    directory = directory.parent if directory.name == MANIFEST_NAME else directory
    manifest = read_manifest(directory, verify=not args.no_verify, deep=args.deep)
    print(
        json.dumps(manifest, indent=1, sort_keys=True)
        if args.json
        else f"{directory / MANIFEST_NAME}\n{_summary(manifest)}"
    )
    if args.deep and not args.json:
        print(_deep_line(manifest))
    return 0


def check(args) -> int:
    """``manifest check``: the resume comparison of a composed config with a checkpoint; 1 when refused."""
    from orchestrator.ckpt.compare import compare
    from orchestrator.ckpt.mismatch import blocking, format_mismatch_table
    from orchestrator.config.compose import compose_config
    from orchestrator.config.confdirs import with_config_dir_flags
    from orchestrator.config.layout import layout_from_config

    directory = Path(args.ckpt_dir)
    manifest = read_manifest(directory, deep=args.deep)
    if args.deep:
        print(_deep_line(manifest))
    overrides = list(args.overrides)
    if not any(o.split("=", 1)[0].lstrip("+~") == "run.dir" for o in overrides):
        overrides.append(f"run.dir={directory.resolve().parent.parent}")
    cfg = compose_config(with_config_dir_flags(overrides + [w for d in args.config_dir for w in ("--config-dir", d)]))
    mismatches = compare(manifest, cfg, layout_from_config(cfg), data_fingerprint=None, tokenizer=None)
    print(
        format_mismatch_table(mismatches)
        if mismatches
        else f"{directory}: the config matches the checkpoint (iteration {manifest['iteration']})"
    )
    refused = blocking(mismatches, cfg.checkpoint.allow_reshard)
    if refused:
        print(f"resume refused: {refusal_count(refused)}")
    return 1 if refused else 0


def refusal_count(refused: list) -> str:
    """The blocking differences ``refused`` (:class:`~orchestrator.ckpt.mismatch.Mismatch`) counted by kind:
    those the checkpoint cannot carry at all, and those that only need ``checkpoint.allow_reshard=true``."""
    reshard = sum(1 for m in refused if m.reshardable)
    hard = len(refused) - reshard
    opt_in = f"need{'s' if reshard == 1 else ''} checkpoint.allow_reshard=true"
    if not hard:
        return f"{reshard} difference{'s' if reshard > 1 else ''} that {opt_in}"
    said = f"{hard} difference{'s' if hard > 1 else ''} the checkpoint cannot carry"
    return f"{said}, and {reshard} more that {opt_in}" if reshard else said


def list_run(args) -> int:
    """``manifest list``: every checkpoint of a run with its layout, status and why retention keeps it."""
    from orchestrator.ckpt.retention import describe

    root = Path(args.run_dir)
    if not root.is_dir():
        raise ManifestError(
            f"{root}: {'not a directory' if root.exists() else 'does not exist'}; fix: a run directory "
            "(run.root/run.name, e.g. runs/gpt_pp2_dp2; status lists them) or its checkpoints/ directory"
        )
    save_dir = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    infos = list_checkpoints(save_dir, verify=not args.no_verify, deep=args.deep)
    if not infos:
        print(f"{save_dir}: no checkpoints")
    for info, why in zip(infos, describe(save_dir, infos)):
        lay = (info.manifest or {}).get("layout") or {}
        shape = (
            (
                f"TP{lay['tensor_model_parallel_size']} PP{lay['pipeline_model_parallel_size']} "
                f"VPP{lay.get('virtual_pipeline_model_parallel_size') or '-'} CP{lay['context_parallel_size']} "
                f"EP{lay['expert_model_parallel_size']} DP{lay['data_parallel_size']}"
            )
            if lay
            else "-"
        )
        extra = f"consumed {info.manifest['consumed_samples']}" if info.manifest else info.reason
        kept = f"[{why}]" if why.startswith("removed") else f"[kept: {why}]"
        print(f"{info.iteration:>9}  {info.status:<8}  {shape:<28}  {info.path}  {extra}  {kept}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: 0 done (``check``: the config matches), 1 ``check`` refused, 2 a user error (one line)."""
    from orchestrator.errors import OrchestratorError

    argv = list(sys.argv[1:] if argv is None else argv)
    tail = argv[argv.index("--") + 1 :] if "--" in argv else []  # Hydra overrides, after options anywhere
    args = _parser().parse_args(argv[: len(argv) - len(tail) - 1] if "--" in argv else argv)
    if args.cmd == "check":
        args.overrides = list(args.overrides) + tail
    try:
        return {"show": show, "check": check, "list": list_run}[args.cmd](args)
    except OrchestratorError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
