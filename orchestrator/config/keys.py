"""The closed schema's keys: every dotted key, "did you mean", unknown keys and types in words.

Pure functions of a schema class (the :class:`~orchestrator.config.schema.JobConfig` dataclass tree,
passed in, so this module depends on nothing but :mod:`orchestrator.errors`). Used by composition
(unknown override keys), :func:`~orchestrator.config.schema.to_job_config` (keys a config file or a
``+`` override added) and :func:`~orchestrator.config.checks.validate` (value types). Every
message is one line ``<key>: <what>; fix: <how>``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from orchestrator.errors import ConfigError


def is_section(f: Any) -> bool:
    """True for a schema field that is a nested section (a dataclass), not a value."""
    sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
    return dataclasses.is_dataclass(sub)


def _section_class(f: Any) -> type:
    return type(f.default_factory())


def schema_keys(cls: type, prefix: str = "") -> Dict[str, Any]:
    """Every dotted key of the schema ``cls`` -> its dataclass field (nested sections flattened)."""
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out[key] = f
        if is_section(f):
            out.update(schema_keys(_section_class(f), key + "."))
    return out


def is_open(key: str, cls: type) -> bool:
    """True for a free-form ``Dict`` field (``cluster.env``, ``cluster.additional_parameters``):
    any sub-key is allowed under it."""
    f = schema_keys(cls).get(key)
    return f is not None and f.default_factory is dict  # type: ignore[comparison-overlap]


def did_you_mean(name: str, candidates: List[str]) -> Optional[str]:
    """The candidate closest to a misspelt ``name`` (difflib), or None."""
    import difflib

    best = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return best[0] if best else None


def _fields(cls: type) -> Dict[str, Any]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _known_prefix(parts: List[str], cls: type) -> tuple:
    """``(i, field)``: the longest prefix ``parts[:i]`` naming a schema field, and that field (0, None)."""
    section, found = cls, (0, None)
    for i, part in enumerate(parts):
        f = _fields(section).get(part) if section is not None else None
        if f is None:
            break
        found = (i + 1, f)
        section = _section_class(f) if is_section(f) else None
    return found


def _corrected(parts: List[str], cls: type, extra: List[str]) -> Optional[str]:
    """``parts`` with each misspelt name replaced by its section's closest field (None when one has none)."""
    section: Optional[type] = cls
    out: List[str] = []
    for part in parts:
        if section is None:  # more parts under a value: the corrected key ends at the value
            break
        names = list(_fields(section)) + (extra if section is cls else [])
        name = part if part in names else did_you_mean(part, names)
        if name is None:
            return None
        out.append(name)
        f = _fields(section).get(name)
        section = _section_class(f) if f is not None and is_section(f) else None
    return ".".join(out)


def unknown_key_error(key: str, cls: type, extra: Optional[List[str]] = None) -> ConfigError:
    """``<key>: unknown key; fix: ...`` from the keys of ``cls`` (and ``extra`` names, e.g. the config
    groups): a key under a value (``plan.x``) names the value; a misspelt one gets "did you mean" (each
    part corrected within its own section: ``trainng.seed`` -> ``training.seed``); otherwise the keys
    of the deepest section the key does reach."""
    parts = key.split(".")
    depth, field = _known_prefix(parts, cls)
    known = ".".join(parts[:depth])
    if field is not None and not is_section(field):
        return ConfigError(
            f"{key}: unknown key ({known} is a value, {type_words(field.type)}, not a section "
            f"with keys); fix: {known}=<value>"
        )
    extra = list(extra or [])
    if depth == 0 and parts[0] in extra:
        plus = "+" if parts[0] == "experiment" else ""
        return ConfigError(
            f"{key}: unknown key ({parts[0]} is a config group); fix: {plus}{parts[0]}=<option> "
            f"chooses a file of conf/{parts[0]}/"
        )
    best = _corrected(parts, cls, extra)
    section = field and _section_class(field)
    if best and best != key:
        fix = f"did you mean {best}?"
    elif section is not None:
        fix = f"the keys of {known} are: " + ", ".join(_fields(section))
    else:
        fix = "the top-level keys are: " + ", ".join(_fields(cls))
    return ConfigError(f"{key}: unknown key (the config schema is closed); fix: {fix}")


def check_keys(container: Dict[str, Any], cls: type, prefix: str = "", root: Optional[type] = None) -> None:
    """Raise :class:`ConfigError` for the first key of a composed config that ``cls`` does not have.

    ``container`` is the composed config as plain containers (``OmegaConf.to_container``, not
    resolved). A ``+key=value`` override or a config file can add keys Hydra accepts; the schema
    is closed, so they are refused here with a "did you mean".
    """
    names = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in container.items():
        full = f"{prefix}{key}"
        if key not in names:
            raise unknown_key_error(full, root or cls)
        if is_section(names[key]) and isinstance(value, dict):
            check_keys(value, _section_class(names[key]), full + ".", root or cls)


def type_words(annotation: Any) -> str:
    """The schema type of a field in words: ``Optional[int]`` -> "an integer or null"."""
    text = str(annotation).replace("typing.", "")
    nullable = text.startswith("Optional[")
    inner = text[len("Optional[") : -1] if nullable else text
    words = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}.get(inner)
    if words is None:
        words = (
            "a list such as [a,b]"
            if inner.startswith("List")
            else "a mapping such as {KEY: value}"
            if inner.startswith("Dict")
            else inner
        )
    return words + (" or null" if nullable else "")


def omegaconf_error(exc: Exception, cls: type) -> ConfigError:
    """One line for an OmegaConf error: ``<full_key>: <what>; fix: <how>`` (types from ``cls``)."""
    from omegaconf.errors import MissingMandatoryValue, ValidationError

    key = getattr(exc, "full_key", None) or "config"
    text = str(exc).strip()
    what = (getattr(exc, "msg", None) or text).strip().splitlines()[0] if text else type(exc).__name__
    if isinstance(exc, MissingMandatoryValue):
        return ConfigError(f"{key}: must be set (the chosen config leaves it ???); fix: {key}=<value>")
    if isinstance(exc, ValidationError):
        field = key.split("[")[0]
        f = schema_keys(cls).get(field)
        return ConfigError(
            f"{key}: {what}; fix: give {field} {type_words(f.type) if f is not None else 'a value of the schema type'}"
        )
    return ConfigError(
        f"{key}: {what}; fix: correct {key} (interpolations are ${{group.key}}, ${{oc.env:VAR,default}})"
    )
