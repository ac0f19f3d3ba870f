"""Hydra's and OmegaConf's errors as one line (:func:`hydra_error`: ``<key>: <what>; fix: <how>``), and what
they need: the options of each config group (:func:`group_options`), the options an override selects
(:func:`override_values`) and the refusal of an option no config directory holds (:func:`no_such_option`).
The composition itself: :mod:`orchestrator.config.compose`.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any, Dict, List, Optional

import yaml

from orchestrator.config.confdirs import conf_view, user_conf_dirs, where
from orchestrator.config.keys import did_you_mean
from orchestrator.config.schema import JobConfig
from orchestrator.errors import ConfigError


def group_options(config_dir: Optional[str] = None) -> Dict[str, List[str]]:
    """``{group: [option, ...]}`` read from ``config_dir`` (default: the shipped ``conf/`` and the
    user's ``./conf`` ahead of it, :mod:`orchestrator.config.confdirs`), ``experiment`` included."""
    root = Path(config_dir) if config_dir else conf_view(user_conf_dirs())
    return {d.name: sorted(p.stem for p in d.glob("*.yaml")) for d in sorted(root.iterdir()) if d.is_dir()}


def override_values(o: Any) -> List[str]:
    """The option names one group override selects (one, or each point of a sweep)."""
    if o.is_sweep_override():
        return [str(v) for v in o.sweep_string_iterator()]
    return [o.get_value_element_as_str()]


def no_such_option(
    group: str,
    value: str,
    known: List[str],
    searched: List[Path] = (),  # type: ignore[assignment]
    named_in: Optional[Path] = None,
) -> ConfigError:
    """``GROUP=VALUE: no such GROUP in <where it looked>; fix: did you mean ...? one of ...`` (the shipped options
    and the user's own); ``named_in``: the config file whose defaults name it; a ``VALUE.yml`` there is named
    (Hydra reads ``.yaml`` only)."""
    plus = "+" if group == "experiment" and named_in is None else ""
    stem = Path(value).name[: -len(".yaml")] if value.endswith(".yaml") else Path(value).name  # a path typed
    yml = next((d / group / f"{stem}.yml" for d in searched if (d / group / f"{stem}.yml").is_file()), None)
    best = None if yml else stem if stem in known else did_you_mean(stem, known)
    where_ = f"{where(group, searched)} (named in {named_in})" if named_in else where(group, searched)
    fix = (
        f"rename {yml} to {stem}.yaml (Hydra reads .yaml files only); "
        if yml
        else f"in that file, did you mean {best}? "
        if best and named_in
        else f"did you mean {plus}{group}={best}? "
        if best
        else ""
    )
    own = " (your own: ./conf/experiment/NAME.yaml, or --config-dir DIR)" if group == "experiment" else ""
    return ConfigError(f"{group}={value}: no such {group} in {where_}; fix: {fix}one of {', '.join(known)}{own}")


def _naming_file(root: str, parsed: List[Any], option: str) -> Optional[Path]:
    """The chosen option file (``+experiment=NAME``'s, usually) whose text names ``option``, resolved to where
    it lives (the user's directory, not the composed view)."""
    for o in parsed:
        for value in override_values(o) if o.value() is not None and "=" in o.input_line else []:
            path = Path(root) / o.key_or_group / f"{value}.yaml"
            try:
                if path.is_file() and re.search(rf"(?<![\w.-]){re.escape(option)}(?![\w.-])", path.read_text()):
                    return path.resolve()
            except OSError:
                continue
    return None


def hydra_error(
    exc: BaseException,
    searched: List[Path] = (),
    root: Optional[str] = None,  # type: ignore[assignment]
    parsed: List[Any] = (),
) -> ConfigError:  # type: ignore[assignment]
    """One ``<key>: <what>; fix: <how>`` line for any Hydra or OmegaConf exception (``searched``, ``root``,
    ``parsed``: the user's config directories, the composed view and the overrides, when composing)."""
    from hydra.errors import MissingConfigException, OverrideParseException
    from omegaconf.errors import OmegaConfBaseException

    from orchestrator.config.keys import omegaconf_error

    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, yaml.YAMLError):  # a config file that is not YAML (a user's own, usually)
        mark = getattr(exc, "problem_mark", None)
        file = f"{mark.name}, line {mark.line + 1}" if mark is not None else "a config file"
        what = getattr(exc, "problem", None) or (str(exc).strip().splitlines() or ["not YAML"])[0]
        return ConfigError(
            f"{file}: not valid YAML ({what}); fix: correct that file (each key once per "
            "mapping, brackets and quotes closed)"
        )
    if isinstance(exc, OverrideParseException):
        what = str(exc.message).strip().splitlines()[0]
        return ConfigError(
            f"{exc.override}: not a valid override ({what}); fix: key=value, key=[a,b] for a list, "
            "'quoted' values for special characters, +key=value only for new keys"
        )
    if isinstance(exc, MissingConfigException):
        missing = str(getattr(exc, "missing_cfg_file", "") or "")
        group, _, option = missing.rpartition("/")
        known = group_options(root).get(group, [])
        if known:  # an option named in a config file's defaults (a user's experiment, usually)
            return no_such_option(
                group, option, known, searched, named_in=_naming_file(root, parsed, option) if root else None
            )
        return ConfigError(
            f"{group or 'config'}={option or missing}: no such config in {where(group, searched)}; "
            "fix: check the defaults list of the config"
        )
    cause: Optional[BaseException] = exc
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__ or cause.__context__
    lines = [s.strip() for s in str(exc).strip().splitlines() if s.strip()]
    hint = _hydra_hint(str(exc))
    if cause is not None and getattr(cause, "full_key", None):
        key = cause.full_key
        if hint:  # Hydra names the override to type: a new key under an open mapping (cluster.env.X)
            return ConfigError(
                f"{key}: not in the config yet (Hydra adds a new key with +, merges a mapping's new keys with ++); fix: {hint}"
            )
        return omegaconf_error(cause, JobConfig)
    first = lines[0] if lines else type(exc).__name__
    fix = hint or "; ".join(lines[1:3]) or "python -m orchestrator --help"
    return ConfigError(f"config: {first}; fix: {fix}")


def _hydra_hint(message: str) -> Optional[str]:
    """The override Hydra's message says to type, as it works in bash (shell-quoted), or None. Hydra's
    ``use +KEY=VALUE`` for a mapping value (``cluster.env={FOO: 1}``: KEY exists, the value's keys are new) is
    refused by the same check (KEY is in the config): ``++KEY=VALUE`` merges the new keys into it."""
    use = re.search(r"Could not override '([^']+)'\.\s*To append to your config use \+(\S[^\n]*)", message)
    if use:
        key, typed = use.group(1), use.group(2).strip()
        merge = typed.startswith(f"{key}=") and typed[len(key) + 1 :].lstrip().startswith("{")
        return shlex.quote(("++" if merge else "+") + typed)
    remove = re.search(r"Either remove \+ prefix: '([^']+)'", message)
    return shlex.quote(remove.group(1)) if remove else None
