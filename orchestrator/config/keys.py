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


def did_you_mean(key: str, candidates: List[str]) -> Optional[str]:
    """The candidate closest to a misspelt ``key`` (difflib), or None.

    Within a known section the field names are compared (``training.micro_batch`` ->
    ``training.micro_batch_size``); otherwise whole keys of the same depth (``paralelism`` ->
    ``parallelism``, ``trainng.seed`` -> ``training.seed``).
    """
    import difflib

    section, _, tail = key.rpartition(".")
    same = [c for c in candidates if c.count(".") == key.count(".")]
    siblings = {c.rpartition(".")[2]: c for c in same if c.rpartition(".")[0] == section}
    if section and siblings:
        best = difflib.get_close_matches(tail, list(siblings), n=1, cutoff=0.6)
        return siblings[best[0]] if best else None
    if section:  # a misspelt section: correct it, then the field
        fixed = did_you_mean(section, candidates + [c.rpartition(".")[0] for c in candidates])
        return (did_you_mean(f"{fixed}.{tail}", candidates) or fixed) if fixed else None
    best = difflib.get_close_matches(key, same, n=1, cutoff=0.6)
    return best[0] if best else None


def unknown_key_error(key: str, cls: type, extra: Optional[List[str]] = None) -> ConfigError:
    """``<key>: unknown key; fix: did you mean ...`` from the keys of ``cls`` (and ``extra`` names,
    e.g. the config groups)."""
    keys = schema_keys(cls)
    best = did_you_mean(key, list(keys) + list(extra or []))
    section = key.rpartition(".")[0]
    if best:
        fix = f"did you mean {best}?"
    elif section in keys and is_section(keys[section]):
        fix = f"the keys of {section} are: " + ", ".join(f.name for f in dataclasses.fields(_section_class(keys[section])))
    else:
        fix = "the top-level keys are: " + ", ".join(f.name for f in dataclasses.fields(cls))
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
    inner = text[len("Optional["):-1] if nullable else text
    words = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}.get(inner)
    if words is None:
        words = ("a list such as [a,b]" if inner.startswith("List") else
                 "a mapping such as {KEY: value}" if inner.startswith("Dict") else inner)
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
        return ConfigError(f"{key}: {what}; fix: give {field} "
                           f"{type_words(f.type) if f is not None else 'a value of the schema type'}")
    return ConfigError(f"{key}: {what}; fix: correct {key} (interpolations are ${{group.key}}, "
                       "${oc.env:VAR,default})")
