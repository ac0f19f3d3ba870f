"""The one composition of ``conf/``: overrides in, a :class:`JobConfig` out.

``conf/`` lives at the repository top level (the project's design) and is shipped inside the
wheel as ``orchestrator/conf`` (``[tool.setuptools.package-data]`` in pyproject.toml), so the
same Hydra tree is found from a source checkout, an editable install and ``pip install .``. A
user's own configs (``./conf``, ``--config-dir``, ``hydra.searchpath``) are searched ahead of it:
:mod:`orchestrator.config.confdirs`.

:func:`compose_config` is what the entry point (single runs), the sub-tools and the tests use:
Hydra's compose API, never ``hydra.main`` — so composing writes nothing (no ``.hydra/``, no
``__main__.log``, no run directory) and every Hydra/OmegaConf error becomes one
:class:`~orchestrator.errors.ConfigError` line. Steps:

1. :func:`check_overrides` reads each override against the closed schema and ``conf/``: an
   unknown key (with or without ``+``), an unknown group option or experiment, ``+`` on a key
   that exists, ``experiment=`` without ``+``, a sweep (``a,b``) outside ``-m`` — each refused
   with a "did you mean" from the schema's field names, the group options or the experiment
   names in ``conf/``.
2. Hydra composes; whatever it still refuses is turned into one line by :func:`hydra_error`.
3. Run naming (the single-run directory is ``run.root/run.name``): an experiment's run is named
   by the experiment (its ``run.name``, else the experiment's name) plus every config group chosen on the command line,
   except ``cluster`` (where a run runs is not what it trains) — ``+experiment=gpt_pp2_dp2
   parallelism=tp2_pp2`` is ``gpt_pp2_dp2-parallelism=tp2_pp2`` — unless ``run.name`` is given.
   Key overrides (``training.train_iters=300``) keep the name: rerunning with them continues the
   same run, and a change a checkpoint cannot carry is refused by the resume check with its diff.
   Without an experiment the name is ``<model>_<parallelism>`` (conf/config.yaml).
4. ``run.dir`` (``${hydra:runtime.output_dir}`` in the schema, which is the sweep point's
   directory under ``-m``) becomes ``hydra.run.dir`` = ``run.root/run.name``, made absolute.
5. :func:`orchestrator.config.schema.to_job_config` refuses keys the schema does not have and
   resolves the rest into dataclasses. Values are checked later by the one ``validate``.
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import yaml

from orchestrator.config.confdirs import conf_dir, conf_view, user_conf_dirs, where  # noqa: F401 (conf_dir: re-exported)
from orchestrator.config.hydra_errors import group_options, hydra_error, no_such_option, override_values
from orchestrator.config.keys import is_open, schema_keys, unknown_key_error
from orchestrator.config.override_forms import lists_as_strings, repeated_group_refusal, sweep_refusal
from orchestrator.config.schema import JobConfig
from orchestrator.errors import ConfigError

NOT_IN_RUN_NAME = ("experiment", "cluster")
"""Groups whose choice does not enter an experiment's run name (see the module docstring)."""

__all__ = [  # group_options and hydra_error live in config/hydra_errors.py; read from here too
    "CONFIG_GROUPS",
    "NAMED_GROUPS",
    "check_overrides",
    "compose_config",
    "compose_dict",
    "conf_dir",
    "group_options",
    "hydra_error",
    "parse_overrides",
    "sweep_checks",
    "sweep_points",
]


# ---------------------------------------------------------------- overrides against the schema
def parse_overrides(overrides: List[str]) -> List[Any]:
    """Hydra's parsed overrides (raises ConfigError for one that does not parse)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        return OverridesParser.create().parse_overrides(list(overrides))
    except OverrideParseException as exc:
        raise hydra_error(exc) from None


def check_overrides(
    parsed: List[Any], options: Dict[str, List[str]], multirun: bool = False, searched: List[Path] = ()
) -> None:  # type: ignore[assignment]
    """Refuse, one line each, what the closed schema and ``conf/`` (and the user's config
    directories ``searched`` ahead of it) do not have (ConfigError)."""
    from hydra.core.override_parser.types import OverrideType

    keys = schema_keys(JobConfig)
    repeated = repeated_group_refusal(parsed, options)
    if repeated is not None:
        raise repeated
    for o in parsed:
        key, line = o.key_or_group, o.input_line
        if key.startswith(("hydra/launcher", "hydra.launcher")):
            raise _launcher_error(line, parsed)
        if key == "hydra" or key.startswith("hydra."):
            continue  # Hydra's own settings: Hydra checks them
        if o.is_sweep_override() and not multirun:
            raise sweep_refusal(o, keys.get(key))
        if key in options:  # a config group
            if o.type == OverrideType.DEL:
                raise ConfigError(
                    f"{line}: the {key} group cannot be removed; fix: choose another option, "
                    f"{key}=<one of {', '.join(options[key])}>"
                )
            if o.value() is None and o.type != OverrideType.DEL:
                raise ConfigError(
                    f"{line}: a config group needs an option, not null; fix: "
                    f"{'+' if key == 'experiment' else ''}{key}=<one of {', '.join(options[key])}>"
                )
            if o.type == OverrideType.FORCE_ADD:
                raise ConfigError(
                    f"{line}: ++ does not apply to a config group; fix: "
                    + shlex.quote(f"{'+' if key == 'experiment' else ''}{line.lstrip('+')}")
                )
            for value in override_values(o) if o.value() is not None else []:
                if value not in options[key]:
                    raise no_such_option(key, value, options[key], searched)
            if key == "experiment" and o.type == OverrideType.CHANGE:
                raise ConfigError(
                    f"{line}: experiment is an optional group, added with +; fix: {shlex.quote('+' + line)}"
                )
            if key != "experiment" and o.type == OverrideType.ADD:
                raise ConfigError(
                    f"{line}: {key} is already chosen by the defaults (a + adds a new entry); "
                    f"fix: {shlex.quote(line.lstrip('+'))}"
                )
            continue
        if key not in keys and not _under_open_field(key):
            raise unknown_key_error(key, JobConfig, extra=list(options))
        if key in keys and o.type == OverrideType.ADD:
            merge = is_open(key, JobConfig) and isinstance(o.value(), dict)  # new keys into an open mapping: ++
            raise ConfigError(
                f"{line}: {key} is already in the config (a + adds a new key); fix: "
                + shlex.quote(("++" if merge else "") + line.lstrip("+"))
            )
        if key in keys and o.type == OverrideType.DEL:
            raise ConfigError(f"{line}: schema keys cannot be removed; fix: {key}=<value> (or null where allowed)")


def _launcher_error(line: str, parsed: List[Any]) -> ConfigError:
    """``hydra/launcher=...`` (Hydra's submitit plugin habit): how sweeps run here, and the command that does."""
    kept = [o.input_line for o in parsed if not o.key_or_group.startswith(("hydra/launcher", "hydra.launcher"))]
    if any(o.key_or_group == "hydra/launcher" and str(o.value()) in ("submitit_local", "basic") for o in parsed):
        return ConfigError(  # the local launcher is what a run already does
            f"{line}: drop it: local is the default (cluster=local runs the job, or each -m point, on this machine "
            f"through submitit's local executor); fix: python -m orchestrator " + shlex.join(kept)
        )
    if not any(o.key_or_group == "cluster" for o in parsed):
        kept.append("cluster=slurm")
    return ConfigError(
        f"{line}: Hydra's launcher plugins are not used here: -m runs one orchestrator job per "
        "point, one after another locally, or all queued at once on SLURM through submitit with "
        "cluster=slurm (partition, account, time as cluster.* keys); fix: python -m orchestrator -m " + shlex.join(kept)
    )


def _under_open_field(key: str) -> bool:
    parts = key.split(".")
    return any(is_open(".".join(parts[:i]), JobConfig) for i in range(1, len(parts)))


def sweep_checks(overrides: List[str]) -> Iterator[List[str]]:
    """Override lists that together compose every value of a ``-m`` sweep at least once.

    Each swept key's values are tried in turn with the other sweeps at their first value: a
    misspelt value anywhere in ``a,b,c`` is refused before the first point runs.
    """
    parsed = parse_overrides(overrides)
    fixed = [
        o.input_line if not o.is_sweep_override() else f"{o.get_key_element()}={override_values(o)[0]}" for o in parsed
    ]
    yield fixed
    for i, o in enumerate(parsed):
        if o.is_sweep_override():
            for value in override_values(o)[1:]:
                yield fixed[:i] + [f"{o.get_key_element()}={value}"] + fixed[i + 1 :]


def sweep_points(overrides: List[str]) -> Tuple[int, List[str]]:
    """(points, the swept overrides as typed) of a ``-m`` command: Hydra's basic sweeper runs the
    cartesian product of every swept key's values."""
    points, swept = 1, []
    for o in parse_overrides(overrides):
        if o.is_sweep_override():
            points *= len(override_values(o))
            swept.append(o.input_line)
    return points, swept


# ---------------------------------------------------------------- the composition
PASSTHROUGH_KEYS = ("model.megatron", "parallelism.megatron", "optimizer.megatron")
"""The free-form mappings of megatron-core fields (:mod:`orchestrator.config.megatron_passthrough`)."""


def merged_passthrough(overrides: List[str]) -> List[str]:
    """``overrides`` with every one that sets a pass-through mapping or a field in it (``model.megatron={a: 1}``,
    ``model.megatron.a=1``, ``+model.megatron.a=1``) as Hydra's merge ``++``: the mappings start empty, so Hydra
    would refuse the first two (``+`` adds a new key) and the third when the key is already set; merged, the
    fields' own check (megatron-core's dataclass fields, with did-you-mean) judges them in the same run."""
    out = []
    for o in overrides:
        bare = o.lstrip("+")
        key = bare.split("=", 1)[0]
        if "=" in bare and any(key == k or key.startswith(k + ".") for k in PASSTHROUGH_KEYS):
            o = "++" + bare
        out.append(o)
    return out


def compose_dict(overrides: List[str], config_dir: Optional[str] = None) -> Any:
    """The composed ``DictConfig`` of one run (no ``hydra`` node; ``run.name``/``run.dir`` set).

    Raises ConfigError (one line) for every override or composition error.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf, open_dict
    from omegaconf.errors import OmegaConfBaseException

    from orchestrator.config.schema import register_configs

    overrides = merged_passthrough(overrides)
    overrides = lists_as_strings(overrides, parse_overrides(overrides))
    parsed = parse_overrides(overrides)
    searched = user_conf_dirs(overrides)
    root = str(config_dir or conf_view(searched))
    check_overrides(parsed, group_options(root), searched=searched)
    register_configs()
    try:
        with initialize_config_dir(config_dir=root, version_base=None):
            try:
                cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
            except ValueError as exc:  # Hydra's defaults list on a value it cannot take (hydra=true)
                raise HydraException(str(exc)) from exc
        with open_dict(cfg):
            for key in ("run.name", "run.root"):  # an error names the key the user typed, not hydra.run.dir
                OmegaConf.select(cfg, key, throw_on_missing=True)
            _name_unnamed_options(cfg)
            _name_run(cfg, parsed)
            run_dir = os.path.abspath(str(OmegaConf.select(cfg, "hydra.run.dir", throw_on_missing=True)))
            del cfg["hydra"]
            if OmegaConf.is_interpolation(cfg.run, "dir") and "hydra:" in str(cfg.run._get_node("dir")._value()):
                cfg.run.dir = run_dir
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as exc:
        raise hydra_error(exc, searched, root, parsed) from None
    _fill_suggest_lr(cfg, overrides, parsed, config_dir)
    return cfg


LR_KEY = "optimizer.lr"


def _fill_suggest_lr(cfg: Any, overrides: List[str], parsed: List[Any], config_dir: Optional[str]) -> None:
    """``training.spike.suggest_lr``, when null and the command line set ``optimizer.lr``: the learning rate of the
    same composition without that override, if it is lower -- what a spike or NaN stop then proposes
    (:func:`orchestrator.config.spike.proposed_lr`) -- and ``training.spike.suggest_lr_from``, where it comes from
    (:func:`_lr_source`). One more composition for such a command line (two with an experiment)."""
    from omegaconf import OmegaConf, open_dict

    set_lr = [raw for raw, o in zip(overrides, parsed) if o.key_or_group.lstrip("+~") == LR_KEY]
    if not set_lr or OmegaConf.select(cfg, "training.spike.suggest_lr") is not None:
        return
    rest = [o for o in overrides if o not in set_lr]
    own_cfg = compose_dict(rest, config_dir)
    own = OmegaConf.select(own_cfg, LR_KEY)
    if own is not None and float(own) < float(OmegaConf.select(cfg, LR_KEY)):
        with open_dict(cfg):
            OmegaConf.update(cfg, "training.spike.suggest_lr", float(own), force_add=True)
            source = _lr_source(rest, own_cfg, config_dir)
            OmegaConf.update(cfg, "training.spike.suggest_lr_from", source, force_add=True)


def _lr_source(rest: List[str], own_cfg: Any, config_dir: Optional[str]) -> str:
    """Where ``own_cfg``'s learning rate comes from: the ``optimizer=<name>`` option's (its preset's default), or an
    experiment's own when the same composition without the experiment (that option chosen) has another."""
    from omegaconf import OmegaConf

    preset = f"the optimizer={own_cfg.optimizer.name} preset's default"
    keys = {raw: o.key_or_group.lstrip("+~") for raw, o in zip(rest, parse_overrides(rest))}
    if "experiment" not in keys.values():
        return preset
    bare = [o for o in rest if keys[o] not in ("experiment", "optimizer")] + [f"optimizer={own_cfg.optimizer.name}"]
    try:
        same = OmegaConf.select(compose_dict(bare, config_dir), LR_KEY) == OmegaConf.select(own_cfg, LR_KEY)
    except ConfigError:  # the option is the experiment's own, or needs it
        same = False
    return preset if same else "the experiment's own"


NAMED_GROUPS = ("model", "parallelism", "optimizer", "data")
"""Groups whose ``name`` (the schema's default unless the option sets it) names runs and manifests."""
CONFIG_GROUPS = ("parallelism", "model", "optimizer", "data", "training", "cluster")
"""The config groups an experiment file or an override can choose an option of."""


def _name_unnamed_options(cfg: Any) -> None:
    """An option file of the user's without ``name:`` (``conf/model/mymodel.yaml``) is named after the option
    (``mymodel``), not after the schema's default option it would otherwise claim to be (``gpt_tiny``): the run
    directory ``${model.name}_${parallelism.name}`` of two different models must differ."""
    from orchestrator.config.schema import JobConfig

    defaults = JobConfig()
    for group in NAMED_GROUPS:
        choice = cfg.hydra.runtime.choices.get(group)
        default = getattr(defaults, group).name
        if choice and choice != default and cfg[group].get("name") == default:
            cfg[group].name = re.sub(r"[^A-Za-z0-9._=+,-]", "_", str(choice))


def _name_run(cfg: Any, parsed: List[Any]) -> None:
    """An experiment's run name (its file's ``run.name``, else the experiment's own name) plus the groups chosen on
    the command line (module docstring, step 3)."""
    from hydra.core.override_parser.types import OverrideType

    from orchestrator.config.run_schema import RunConfig

    if any(o.key_or_group == "run.name" for o in parsed):
        return
    if not any(o.key_or_group == "experiment" and o.type != OverrideType.DEL for o in parsed):
        return
    if cfg.run._get_node("name")._value() == RunConfig.name:  # the experiment names no run: its own name does
        cfg.run.name = re.sub(r"[^A-Za-z0-9._=+,-]", "_", str(cfg.hydra.runtime.choices["experiment"]))
    chosen: Dict[str, str] = {}  # a group chosen twice (model=a model=b) trains the last: its name alone
    for o in parsed:
        group = o.key_or_group
        if group in cfg.hydra.runtime.choices and group not in NOT_IN_RUN_NAME and o.type != OverrideType.DEL:
            if "/" not in group:
                chosen.pop(group, None)
                chosen[group] = f"{group}={o.get_value_element_as_str()}"
    if chosen:
        cfg.run.name = re.sub(r"[^A-Za-z0-9._=+,-]", "_", "-".join([str(cfg.run.name), *chosen.values()]))


def compose_config(overrides: List[str], config_dir: Optional[str] = None) -> JobConfig:
    """Compose ``conf/`` with ``overrides`` into a :class:`JobConfig` (raises ConfigError, one line)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from orchestrator.config.schema import to_job_config

    cfg = compose_dict(overrides, config_dir)
    try:
        return to_job_config(cfg)
    except (HydraException, OmegaConfBaseException) as exc:
        raise hydra_error(exc) from None
