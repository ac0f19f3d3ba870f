"""Read a Megatron-LM launch file — shell script, args YAML or JSON — into a :class:`Source`.

The forms are described in :mod:`orchestrator.convert.sources` (mappings, flags) and
:mod:`orchestrator.convert.shell` (scripts). Pure Python.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, Optional

from orchestrator.convert.shell import parse_shell
from orchestrator.convert.sources import Source, from_mapping
from orchestrator.errors import ConfigError


def read_source(path: str, variables: Optional[Dict[str, str]] = None) -> Source:
    """Read ``path`` (shell script, ``.yaml``/``.yml`` or ``.json``); raises ConfigError if unreadable."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"FILE: cannot read {path}: {exc.strerror}; fix: give a readable Megatron-LM script, args YAML or JSON"
        ) from None
    suffix = p.suffix.lower()
    if suffix == ".json":
        try:
            return from_mapping(json.loads(text), path, "JSON")
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"FILE: {path} is not JSON ({exc.msg}, line {exc.lineno}); fix: repair the file"
            ) from None
    if suffix in (".yaml", ".yml") or (suffix not in (".sh", ".bash", ".slurm", ".sbatch") and _looks_like_yaml(text)):
        import yaml

        try:
            return from_mapping(yaml.safe_load(text) or {}, path, "YAML")
        except yaml.YAMLError as exc:
            raise ConfigError(f"FILE: {path} is not YAML ({str(exc).splitlines()[0]}); fix: repair the file") from None
    return parse_shell(text, path, variables or {})


def _looks_like_yaml(text: str) -> bool:
    if re.search(r"(^|\s)--[a-z]", text):
        return False
    try:
        import yaml

        return isinstance(yaml.safe_load(text), dict)
    except Exception:  # noqa: BLE001 - not YAML: read as shell
        return False
