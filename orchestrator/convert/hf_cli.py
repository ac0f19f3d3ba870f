"""``python -m orchestrator convert from-hf PATH [--name N] [--out DIR]``: a Hugging Face model directory ->
``DIR/experiment/N.yaml`` whose ``model`` builds its weights (issue 38 item 1).

The file sets every ``model.*`` key config.json decides (:mod:`orchestrator.config.hf_config`: layers, hidden,
heads, KV groups, FFN, RoPE θ and Llama 3.1 scaling or GPT-2's learned positions, norm ε, biases, tied embeddings,
vocabulary, MoE experts / top-k), ``model.make_vocab_size_divisible_by: 1`` (config.json's vocabulary unpadded, as
Megatron-Bridge's ``should_pad_vocab=False``: padded rows would add logits to the softmax, and the loss would not be
transformers'), ``data.tokenizer`` = the directory when it holds the tokenizer (``tokenizer.json`` or
``tokenizer.model``), and ``checkpoint.init_from: hf:PATH``; then it is composed, validated and planned at once, as
``from-megatron`` does. Pure Python: torch is not imported.

``convert to-hf RUN OUT [--iteration N] [--max-shard-gb G] [--eval-batch FILE]``: the checkpoint as a Hugging Face
directory (:mod:`orchestrator.runtime.rank.hf_export`); ``--eval-batch`` also writes the token batch of the run's
evaluation and says our lm loss on it (:mod:`orchestrator.runtime.rank.eval_batch`).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any, List

from orchestrator.errors import ConfigError, DataError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def add_parser(sub) -> None:
    """The ``from-hf`` subcommand on ``convert``'s subparsers."""
    p = sub.add_parser("from-hf", help="a Hugging Face model directory -> conf/experiment/NAME.yaml (init_from=hf:)")
    p.add_argument("path", help="directory with config.json and *.safetensors (a Hugging Face model)")
    p.add_argument("--name", help="experiment name (default: the directory's name)")
    p.add_argument("--out", "--config-dir", dest="out", help="config directory (default ./conf)")
    p.add_argument("--seq-length", type=int, help="model.seq_length (default: min(max_position_embeddings, 4096))")
    p.add_argument("--force", action="store_true", help="overwrite an existing experiment file")


def add_export_parser(sub) -> None:
    """The ``to-hf`` subcommand on ``convert``'s subparsers."""
    p = sub.add_parser("to-hf", help="a run's checkpoint (any layout) -> a Hugging Face directory")
    p.add_argument("run", help="the run directory (<run.root>/<run.name>) or one of its iter_* checkpoints")
    p.add_argument("out", help="the directory to write (must not exist or be empty)")
    p.add_argument("--iteration", type=int, help="the checkpoint's iteration (default: the latest complete one)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="safetensors shard size cap, GB (default 5)")
    p.add_argument(
        "--eval-batch",
        metavar="FILE",
        help="also write the token batch the run's evaluation reads (safetensors: tokens, labels, loss_mask) and say "
        "our lm loss on it at this iteration: transformers' loss on it checks the export",
    )


def _checkpoint(run: str, iteration) -> tuple:
    """(checkpoint directory, its manifest) of ``run`` at ``iteration`` (None: the latest complete one)."""
    from orchestrator.ckpt.catalogue import list_checkpoints
    from orchestrator.ckpt.manifest import read_manifest

    path = Path(run)
    if path.name.startswith("iter_"):
        path, iteration = path.parent.parent, int(path.name[5:]) if iteration is None else iteration
    complete = [c for c in list_checkpoints(path / "checkpoints") if c.status == "complete"]
    chosen = [c for c in complete if iteration is None or c.iteration == iteration]
    if not chosen:
        have = ", ".join(str(c.iteration) for c in complete) or "none"
        raise ConfigError(
            f"convert to-hf {run}: no complete checkpoint{'' if iteration is None else f' at iteration {iteration}'} "
            f"in {path / 'checkpoints'} (complete: {have}); fix: a run directory that saved one, or --iteration "
            "one of those"
        )
    return str(chosen[-1].path), read_manifest(chosen[-1].path)


def to_hf(args) -> int:
    """Export a checkpoint as a Hugging Face directory (runtime.rank.hf_export), then its tokenizer when the
    run's is a Hugging Face one."""
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("transformers", "safetensors")):
        raise ConfigError("convert to-hf writes with transformers and safetensors; fix: pip install 'orchestrator[hf]'")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"convert to-hf: {out} is not empty; fix: a new directory (nothing is overwritten)")
    ckpt, manifest = _checkpoint(args.run, args.iteration)
    from orchestrator.runtime.rank import hf_export

    try:
        arch = hf_export.architecture_of(manifest)
    except ValueError as exc:
        raise ConfigError(f"convert to-hf {args.run}: {exc}") from None
    check = _EvalBatch(args.eval_batch, ckpt, manifest) if args.eval_batch else None  # before anything is written
    print(f"exporting {ckpt} (iteration {manifest['iteration']}) as {arch} to {out}", flush=True)
    shards = hf_export.export(ckpt, manifest, str(out), int(args.max_shard_gb * 10**9), log=_progress)
    tokenizer = str(manifest["config"]["data"]["tokenizer"])
    if os.path.isdir(tokenizer) or tokenizer.endswith("tokenizer.json"):
        import transformers

        source = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer)
        transformers.AutoTokenizer.from_pretrained(source).save_pretrained(out)
        print(f"tokenizer: {source}")
    else:
        print(f"note: the run's tokenizer ({tokenizer}) is not a Hugging Face one: no tokenizer files written")
    print(f"wrote {out}: config.json, generation_config.json, {len(shards)} safetensors shard(s) + index")
    if check is not None:
        check.write()
    return 0


class _EvalBatch:
    """``--eval-batch FILE``: the validation samples the run's evaluation reads (runtime.rank.eval_batch), built
    from the checkpoint's config and data when constructed (ConfigError / DataError, one line, before the export
    writes anything), and our lm loss at the checkpoint's iteration from the run's metrics.jsonl."""

    def __init__(self, file: str, ckpt: str, manifest: dict) -> None:
        from orchestrator.ckpt.rundir import metrics_path
        from orchestrator.config.schema import from_dict
        from orchestrator.data.prepare import prepare
        from orchestrator.io import read_jsonl
        from orchestrator.runtime.rank import eval_batch

        if os.path.exists(file):
            raise ConfigError(f"--eval-batch {file}: exists; fix: a new file name (nothing is overwritten)")
        self.file, self.iteration, self.cfg = file, int(manifest["iteration"]), from_dict(manifest["config"])
        evals = [
            r
            for r in read_jsonl(metrics_path(Path(ckpt).parent.parent))
            if r.get("event") == "eval" and r.get("iteration") == self.iteration
        ]
        self.loss = float(evals[-1]["lm_loss"]) if evals else None
        eval_iters = int(evals[-1]["eval_iters"]) if evals else self.cfg.training.eval_iters
        if eval_iters < 1:
            raise ConfigError(
                f"--eval-batch: the run evaluates nothing (training.eval_iters={eval_iters}); fix: a run trained with "
                "training.eval_iters > 0, or leave out --eval-batch"
            )
        prepared = prepare(self.cfg.data)
        if prepared.fingerprint != manifest["data"]["fingerprint"]:
            raise DataError(
                f"--eval-batch: the run's data changed since it trained (fingerprint {manifest['data']['fingerprint']},"
                f" now {prepared.fingerprint}); fix: the data it trained on, or leave out --eval-batch"
            )
        self.batch = eval_batch.samples(self.cfg, prepared, eval_iters)

    def write(self) -> None:
        from orchestrator.runtime.rank import eval_batch

        eval_batch.write(self.file, self.batch, self.cfg, self.iteration, self.loss)
        n, s = self.batch["tokens"].shape
        said = (
            f"our lm loss on it at iteration {self.iteration}: {self.loss:.6f} (metrics.jsonl)"
            if self.loss is not None
            else f"note: metrics.jsonl holds no evaluation at iteration {self.iteration}"
        )
        print(f"eval batch: {self.file}: {n} samples x {s} tokens, as the run's evaluation reads them; {said}")


def _progress(line: str) -> None:
    print(f"[orchestrator] {line}", file=sys.stderr, flush=True)


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
        "  # config.json's vocabulary, unpadded (padded only to a multiple of TP), as Megatron-Bridge imports it:",
        "  # padded logits would take part in the softmax, and the losses would not be transformers'",
        "  make_vocab_size_divisible_by: 1",
    ]
    if any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        lines += ["data:", f"  tokenizer: {_yaml(path)}"]
    lines += ["checkpoint:", f"  init_from: {_yaml('hf:' + path)}"]
    return "\n".join(lines) + "\n"


def from_hf(args, check, out_root) -> int:
    """Write the experiment, then compose and validate it with ``check`` (``convert.cli``'s: ``cfg -> (layout,
    warnings)``); ``out_root(--out)`` is the config directory."""
    from orchestrator.config.hf_config import HfConfigError, model_keys, read_config
    from orchestrator.convert import experiment_file
    from orchestrator.io import write_atomic

    path = os.path.abspath(os.path.expanduser(args.path))
    try:
        config = read_config(path)
        seq = args.seq_length or min(int(model_keys(config)["max_position_embeddings"]), 4096)
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
