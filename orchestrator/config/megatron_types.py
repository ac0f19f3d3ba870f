"""The values of ``model/parallelism/optimizer.megatron`` against the annotations of megatron-core's dataclass
fields (:mod:`orchestrator.config.megatron_passthrough`): ``+model.megatron.kv_channels=abc`` is refused before
anything is queued, not by megatron-core in rank 0's first forward.

Checked: ``bool``, ``int``, ``float`` (an integer is a number), ``str``, ``Optional[...]``, ``Union[...]``,
``Literal[...]``, enums (by member name or value) and lists/tuples of these. Values arrive as Hydra typed them
(``true`` a bool, ``1`` an int, ``'1'`` a string); nothing is coerced but an enum field's member, given by name
(:func:`as_field`, as Megatron-LM's parser turns ``--attention-backend flash`` into ``AttnBackend.flash``). An
annotation that is none of these (a callable, a torch dtype, a class of megatron-core's) is accepted without a
word. Pure Python.
"""

from __future__ import annotations

import enum
import typing
from typing import Any, Optional

_UNCHECKABLE = object()
""":func:`accepts`'s answer for an annotation it cannot judge."""


def _scalar(annotation: Any, value: Any) -> Any:
    """True/False for a plain annotation (bool/int/float/str/None/an enum), :data:`_UNCHECKABLE` otherwise."""
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        names = [m.name for m in annotation] + [m.value for m in annotation]
        return isinstance(value, annotation) or (not isinstance(value, bool) and value in names)
    return _UNCHECKABLE


def accepts(annotation: Any, value: Any) -> Any:
    """Whether ``value`` (as Hydra typed it) fits ``annotation``: True, False, or :data:`_UNCHECKABLE` (any part of
    the annotation this module does not know, so nothing may be said)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is None:
        return _scalar(annotation, value)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin is typing.Union:
        answers = [accepts(a, value) for a in args]
        if True in answers:
            return True
        return _UNCHECKABLE if _UNCHECKABLE in answers else False
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                return False
            answers = [accepts(a, v) for a, v in zip(args, value)]
        else:
            answers = [accepts(args[0], v) for v in value] if args else []
        if False in answers:
            return False
        return _UNCHECKABLE if _UNCHECKABLE in answers else True
    return _UNCHECKABLE


def as_field(annotation: Any, value: Any) -> Any:
    """``value`` as megatron-core's field of type ``annotation`` takes it: the member of an enum field (or of an
    ``Optional``/``Union`` whose only match is an enum) given by its name or value (``"flash"`` ->
    ``AttnBackend.flash``: megatron-core compares the field with its members, so the string would match none and
    be ignored without a word); any other value unchanged. Call after :func:`accepts` said True."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Union else (annotation,)
    enums = [a for a in options if isinstance(a, type) and issubclass(a, enum.Enum)]
    if (
        not enums
        or isinstance(value, (bool, enum.Enum))
        or any(accepts(a, value) is True for a in options if a not in enums)
    ):
        return value
    for cls in enums:
        for member in cls:
            if value in (member.name, member.value):
                return member
    return value


def annotation_text(annotation: Any) -> str:
    """An annotation as a person reads it: ``Optional[int]``, ``Literal['full', 'selective']``, ``list[int]``."""
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    for noise in ("typing.", "<class '", "'>", "<enum '"):
        text = text.replace(noise, "")
    return text


def _example(annotation: Any) -> str:
    """A value of ``annotation`` to type after ``KEY=`` (what the fix names)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " or ".join(repr(a) if isinstance(a, str) else str(a).lower() for a in args[:4])
    if origin is typing.Union:
        options = [_example(a) for a in args if a is not type(None)]
        return " or ".join(options + (["null"] if type(None) in args else []))
    if origin in (list, tuple):
        return f"[{_example(args[0]) if args else 'a'},...]"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " or ".join(m.name for m in annotation)
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(annotation, "a value")


def value_problem(key: str, cls: type, name: str, value: Any) -> Optional[str]:
    """One ``error:``-ready line when ``value`` does not fit ``cls``'s field ``name`` (``key``: the config key typed,
    ``model.megatron.kv_channels``); None when it fits or the annotation cannot be checked."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # an annotation megatron-core's module cannot resolve here: nothing to say
        return None
    annotation = hints.get(name)
    if annotation is None or accepts(annotation, value) is not False:
        return None
    quote = f" (a string quoted: \"{key}='text'\")" if accepts(annotation, "text") is True else ""
    return (
        f"{key}={value!r}: {cls.__name__}.{name} is {annotation_text(annotation)}, not "
        f"{type(value).__name__}; fix: {key}=<{_example(annotation)}>{quote}"
    )
