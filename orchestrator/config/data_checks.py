"""The data options of a config: files exist, one positive weight per path, the tokenizer is usable (and
the package that tokenizes with it installed). Run last by :func:`orchestrator.config.checks.validate`;
as warnings by :func:`~orchestrator.config.checks.validate_planned` (a cluster's data are rarely on the
machine that plans).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from orchestrator.config.schema import JobConfig
from orchestrator.config.tokenizer import tokenizer_facts
from orchestrator.config.values import is_number
from orchestrator.errors import ConfigError
from orchestrator.text import show


def check_data(cfg: JobConfig) -> None:
    """Paths exist, one positive weight per path, the tokenizer is usable (ConfigError, one line)."""
    d = cfg.data
    if d.kind in ("stdlib", "mock"):
        if d.paths or d.weights:
            key = "data.paths" if d.paths else "data.weights"
            raise ConfigError(
                f"{key}={show(list(d.paths) or list(d.weights or []))}: data={d.name} (kind {d.kind}) "
                "reads no files; fix: data=jsonl (or data=indexed) to train on files"
            )
    else:
        example = "/data/a.jsonl" if d.kind == "jsonl" else "/data/corpus_text_document"
        if not d.paths:
            raise ConfigError(
                f"data.paths=[]: data={d.name} needs at least one "
                f"{'JSONL file' if d.kind == 'jsonl' else '.bin/.idx prefix'}; "
                f"fix: data.paths=[{example}]"
            )
        for i, path in enumerate(d.paths):
            if not isinstance(path, str) or not path:
                raise ConfigError(f"data.paths[{i}]={show(path)}: not a path; fix: data.paths=[{example}]")
            full = Path(os.path.expanduser(path))
            if d.kind == "jsonl" and not full.is_file():
                raise ConfigError(
                    f"data.paths[{i}]={show(path)}: no such file (from {os.getcwd()}); "
                    "fix: the path of an existing .jsonl file"
                )
            if d.kind == "indexed":
                missing = [ext for ext in (".bin", ".idx") if not Path(str(full) + ext).is_file()]
                if missing:
                    raise ConfigError(
                        f"data.paths[{i}]={show(path)}: {path}{' and '.join(missing)} not found; "
                        "fix: the prefix of an existing .bin/.idx pair (the path without the extension)"
                    )
        if d.weights is not None:
            if len(d.weights) != len(d.paths):
                raise ConfigError(
                    f"data.weights={show(list(d.weights))}: {len(d.weights)} weights for "
                    f"{len(d.paths)} data.paths; fix: one weight per path, or data.weights=null (equal)"
                )
            for i, w in enumerate(d.weights):
                if not is_number(w) or w <= 0:
                    raise ConfigError(
                        f"data.weights[{i}]={show(w)}: must be a finite number > 0; "
                        "fix: positive blend weights, or data.weights=null (equal)"
                    )
    if not isinstance(d.json_key, str) or not d.json_key:
        raise ConfigError(
            f"data.json_key={show(d.json_key)}: must name the JSON field holding the text; fix: data.json_key=text"
        )
    if not isinstance(d.cache_dir, str) or not d.cache_dir:
        raise ConfigError(
            f"data.cache_dir={show(d.cache_dir)}: must be a directory path; fix: data.cache_dir=~/.cache/orchestrator"
        )
    _check_tokenizer(d)


def _installed(package: str) -> bool:
    """Whether ``package`` is installed (its distribution metadata): a rank process keeps transformers out
    of its imports (``sys.modules``, :mod:`orchestrator.runtime.rank.startup`), so ``find_spec`` would say no."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(package)
    except PackageNotFoundError:
        return False
    return True


def _check_tokenizer(d: Any) -> None:
    """The tokenizer's files, vocabulary and eod (:func:`tokenizer_facts`), and the package that
    tokenizes with it when this data is tokenized here (an indexed dataset is read, never tokenized)."""
    facts = tokenizer_facts(d)
    if d.kind in ("jsonl", "stdlib") and facts.kind in ("huggingface", "gpt2-bpe") and not _installed("transformers"):
        raise ConfigError(
            f"data.tokenizer={show(d.tokenizer)}: tokenizing with it needs the transformers package "
            "(megatron-core's HuggingFaceTokenizer), which is not installed; fix: pip install "
            "transformers, or data.tokenizer=byte"
        )
