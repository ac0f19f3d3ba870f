"""``python -m orchestrator convert from-hf PATH [--name N] [--out DIR]``: a Hugging Face model directory ->
``DIR/experiment/N.yaml`` whose ``model`` builds its weights (issue 38 item 1).

The file sets every ``model.*`` key config.json decides (:mod:`orchestrator.config.hf_config`: layers, hidden,
heads, KV groups, FFN, RoPE θ and Llama 3.1 scaling, norm ε, QKV bias, tied embeddings, vocabulary, MoE experts
/ top-k), ``data.tokenizer`` = the directory when it holds the tokenizer
(``tokenizer.json`` or ``tokenizer.model``), and ``checkpoint.init_from: hf:PATH``; then it is composed,
validated and planned at once, as ``from-megatron`` does. Pure Python: torch is not imported.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any, List

from orchestrator.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def add_parser(sub) -> None:
    """The ``from-hf`` subcommand on ``convert``'s subparsers."""
    p = sub.add_parser("from-hf", help="a Hugging Face model directory -> conf/experiment/NAME.yaml (init_from=hf:)")
    p.add_argument("path", help="directory with config.json and *.safetensors (a Hugging Face model)")
    p.add_argument("--name", help="experiment name (default: the directory's name)")
    p.add_argument("--out", "--config-dir", dest="out", help="config directory (default ./conf)")
    p.add_argument("--seq-length", type=int, help="model.seq_length (default: min(max_position_embeddings, 4096))")
    p.add_argument("--force", action="store_true", help="overwrite an existing experiment file")


def _yaml(value: Any) -> str:
    return json.dumps(value)  # JSON scalars and flow mappings are YAML


def experiment_text(path: str, name: str, config: dict, seq_length: int) -> str:
    """The experiment file for the Hugging Face directory ``path`` (module docstring)."""
    from orchestrator.config.hf_config import architecture, model_keys

    keys = model_keys(config)
    keys = {"name": name, **keys, "seq_length": seq_length}
    lines = [
        "# @package _global_",
        f"# Imported from Hugging Face ({architecture(config)}) by `python -m orchestrator convert from-hf {path}`:",
        "# the model builds these weights, which the job loads at its layout and checks against transformers.",
        "model:",
        *[f"  {k}: {_yaml(v)}" for k, v in keys.items()],
    ]
    if any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        lines += ["data:", f"  tokenizer: {_yaml(path)}"]
    lines += ["checkpoint:", f"  init_from: {_yaml('hf:' + path)}"]
    return "\n".join(lines) + "\n"


def from_hf(args, check, out_root) -> int:
    """Write the experiment, then compose and validate it with ``check`` (``convert.cli``'s: ``cfg -> (layout,
    warnings)``); ``out_root(--out)`` is the config directory."""
    from orchestrator.config.hf_config import HfConfigError, read_config
    from orchestrator.convert import experiment_file
    from orchestrator.io import write_atomic

    path = os.path.abspath(os.path.expanduser(args.path))
    try:
        config = read_config(path)
        seq = args.seq_length or min(int(config.get("max_position_embeddings", 4096)), 4096)
        text = experiment_text(path, _name(args, path), config, seq)
    except HfConfigError as exc:
        raise ConfigError(f"convert from-hf {args.path}: {exc}") from None
    name, root = _name(args, path), out_root(args.out)
    file = Path(root) / "experiment" / f"{name}.yaml"
    if file.exists() and not args.force:
        raise ConfigError(f"--name: {file} exists; fix: --force to overwrite it, or another --name")
    write_atomic(file, text, fsync=False)
    print(f"wrote {file}")
    if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        print(f"note: {path} holds no tokenizer ({' / '.join(TOKENIZER_FILES)}): set data.tokenizer for real text")
    cfg = experiment_file.compose([f"+experiment={name}"], root)
    layout, warnings = check(cfg)
    for warning in warnings:
        print(f"warning: {warning}")
    words: List[str] = [*experiment_file.search_overrides(root), f"+experiment={name}", "plan=true"]
    print(f"composed +experiment={name}: valid ({layout.world_size} rank(s) as configured)")
    print("next: python -m orchestrator " + " ".join(shlex.quote(w) for w in words))
    return 0


def _name(args, path: str) -> str:
    return args.name or re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(path).name).strip("._") or "imported"
