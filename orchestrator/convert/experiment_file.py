"""Write a :class:`~orchestrator.convert.to_config.Conversion` as ``conf/experiment/NAME.yaml``.

The file is an ordinary experiment (``# @package _global_``): a ``defaults`` list of group
overrides, then one line per setting with the Megatron-LM flag it came from as its comment.
The header lists, before anything else, what a reader must not miss: flagged flags (with the
reason), flags that were not converted (with the reason), assumptions, derived values (with the
arithmetic) and the Megatron-LM defaults that were written out. :func:`findings` gives the same
lists for the screen.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from orchestrator.errors import ConfigError


def yaml_value(value: Any) -> str:
    """One YAML flow value that OmegaConf reads back as ``value`` (strings single-quoted, ``${`` escaped)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return {math.inf: ".inf", -math.inf: "-.inf"}.get(value, ".nan")
        text = repr(value)
        return text.replace("e", ".0e") if "e" in text and "." not in text else text
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{yaml_value(str(k))}: {yaml_value(v)}" for k, v in value.items()) + "}"
    text = str(value).replace("${", "\\${").replace("'", "''")
    return f"'{text}'"


def findings(conv) -> List[Tuple[str, List[str]]]:
    """(title, lines) for every non-empty list of findings, most important first."""
    src = conv.source
    flags = len(conv.status)
    counts = {s: sum(1 for v in conv.status.values() if v == s) for s in ("mapped", "flagged", "not converted")}
    summary = (
        f"{src.form} {src.path}: {flags} Megatron-LM flags: {counts['mapped']} mapped, "
        f"{counts['flagged']} flagged, {counts['not converted']} not converted"
    )
    return [
        (title, lines)
        for title, lines in (
            ("source", [summary]),
            ("flagged (wrong or suspicious for this GPT job)", conv.flagged),
            ("not converted (no equivalent here)", conv.not_converted),
            ("assumed (not in the source)", conv.assumed),
            ("derived", conv.derived),
            ("Megatron-LM defaults written out (flags not given)", [", ".join(conv.defaults)] if conv.defaults else []),
            ("needs a schema change (not written)", conv.pending_schema),
            ("read notes", src.notes),
        )
        if lines
    ]


def _tree(settings: Dict[str, Any]) -> Dict[str, Any]:
    """Settings as nested dicts (``logging.wandb.project`` -> logging / wandb / project), schema order."""
    from orchestrator.convert.to_config import schema_keys

    order = {k: i for i, k in enumerate(schema_keys())}
    tree: Dict[str, Any] = {}
    for key, setting in sorted(settings.items(), key=lambda kv: (kv[0].count(".") == 0, order.get(kv[0], len(order)))):
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = setting
    return tree


def _lines(tree: Dict[str, Any], indent: str = "") -> List[str]:
    out = []
    for key, node in tree.items():
        if isinstance(node, dict):
            out.append(f"{indent}{key}:")
            out += _lines(node, indent + "  ")
        else:
            out.append(f"{indent}{key}: {yaml_value(node.value)}  # {_comment(node.source)}")
    return out


def render(conv) -> str:
    """The experiment file's text."""
    lines = [
        "# @package _global_",
        f"# Imported from Megatron-LM by `python -m orchestrator.convert from-megatron {conv.source.path}`.",
        "# Each value's comment names the Megatron-LM flag (or rule) it came from.",
    ]
    for title, items in findings(conv):
        lines.append(f"# {title[0].upper() + title[1:]}:")
        lines += [f"#   {item}" for item in items]
    if conv.groups:
        lines.append("defaults:")
        lines += [f"  - override /{group}: {option}" for group, option in conv.groups.items()]
    return "\n".join(lines + _lines(_tree(conv.settings))) + "\n"


def _comment(text: str) -> str:
    return " ".join(str(text).split())


def screen(conv, path: str) -> str:
    """What the user reads after a conversion: where the file went and every finding."""
    out = [f"wrote {path}"]
    for title, items in findings(conv):
        out.append(f"{title}:")
        out += [f"  {item}" for item in items]
    return "\n".join(out)


def json_value(value: Any) -> str:
    """A value for a ``# orchestrator: key=<json>`` line."""
    return json.dumps(value, sort_keys=False)


def write(conv, root: Path, force: bool = False) -> Path:
    """Write ``root/experiment/<name>.yaml`` (atomically); an existing file needs ``force``."""
    from orchestrator.io import write_atomic

    path = Path(root) / "experiment" / f"{conv.name}.yaml"
    if path.exists() and not force:
        raise ConfigError(f"--name: {path} exists; fix: --force to overwrite it, or another --name")
    write_atomic(path, render(conv), fsync=False)
    return path


def search_overrides(root: Path) -> List[str]:
    """What ``python -m orchestrator`` needs, from this directory, to find experiments under ``root``:
    nothing for ``./conf`` or the shipped tree (both searched by default), else ``--config-dir ROOT``."""
    from orchestrator.config.confdirs import conf_dir, user_conf

    root = Path(root).resolve()
    if root in (conf_dir().resolve(), user_conf()):
        return []
    return ["--config-dir", str(root)]


def compose(overrides: List[str], root: Optional[Path] = None):
    """Compose ``conf/`` (with the experiments under ``root`` ahead of it) with ``overrides`` into a
    JobConfig; any Hydra/OmegaConf error becomes one ConfigError line."""
    from orchestrator.config.compose import compose_config
    from orchestrator.config.confdirs import with_config_dir_flags
    from orchestrator.errors import OrchestratorError

    words = list(overrides) + (["--config-dir", str(root)] if root is not None else [])
    try:
        return compose_config(with_config_dir_flags(words))
    except OrchestratorError:
        raise
    except Exception as exc:  # noqa: BLE001 - Hydra/OmegaConf: unknown option, bad override, type error
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"{' '.join(overrides) or 'config'}: {first}; fix: check the override names and values "
            "against conf/ (python -m orchestrator --help)"
        ) from None
