"""The tuner's winner as an experiment file: ``conf/experiment/<name>.yaml``, runnable with ``+experiment=<name>``
(:func:`run_flags`: the ``--config-dir`` that finds it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Sequence

from orchestrator.config.compose import CONFIG_GROUPS


def experiment_yaml(name: str, base_overrides: Sequence[str], knobs: Sequence[str], header: Sequence[str]) -> str:
    """``conf/experiment/<name>.yaml`` text: the base overrides and the winner's knobs, runnable with
    ``+experiment=<name>``; ``header`` lines become its leading comment.

    Group choices become ``override /group: option`` defaults, ``+experiment=X`` includes
    ``/experiment/X``, dotted keys become values; the knobs win over the base (written last).
    """
    import yaml
    from hydra.core.override_parser.overrides_parser import OverridesParser

    defaults: List[Any] = []
    values: Dict[str, Any] = {}

    def put(key: str, value: Any) -> None:
        node = values
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value

    knob_keys = {k.partition("=")[0] for k in knobs}
    for o in OverridesParser.create().parse_overrides(list(base_overrides)):
        key = o.key_or_group
        if o.is_delete() or key in knob_keys:
            continue
        if key == "experiment":
            defaults.append(f"/experiment/{o.value()}")
        elif key in CONFIG_GROUPS:
            defaults.append({f"override /{key}": o.value()})
        else:
            put(key, o.value())
    for o in OverridesParser.create().parse_overrides(list(knobs)):
        put(o.key_or_group, o.value())
    put("run.name", name)
    body = yaml.safe_dump({"defaults": defaults + ["_self_"], **values}, sort_keys=False, default_flow_style=False)
    comment = "\n".join(f"# {line}".rstrip() for line in header)
    return f"# @package _global_\n{comment}\n{body}"


def run_flags(path: Path) -> str:
    """What ``python -m orchestrator`` needs, from this directory, to find the experiment file ``path``."""
    from orchestrator.config.confdirs import conf_dir, user_conf_dirs

    root = path.resolve().parent.parent
    if path.parent.name != "experiment":
        return f"--config-dir <a directory whose experiment/ holds {path.name}> "
    return "" if root in [conf_dir().resolve(), *user_conf_dirs()] else f"--config-dir {root} "
