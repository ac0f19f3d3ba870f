"""The pass-through fields (``model/parallelism/optimizer.megatron``) against the installed megatron-core.

:func:`passthrough_problems`: before anything is queued, one line per field the installed class lacks, whose
value does not fit the field's annotation or that a schema key sets. :func:`with_passthrough`: a megatron
config's arguments, the fields over what the runtime derives (an enum field's name made its member). The schema
side (which keys, which fields each key owns) is :mod:`orchestrator.config.megatron_passthrough`.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Dict, List

from orchestrator.config.megatron_passthrough import SECTIONS, owned_problems
from orchestrator.config.megatron_types import as_field, value_problem
from orchestrator.config.schema import JobConfig


def with_passthrough(cls: type, passed: Dict[str, Any], **derived: Any) -> Dict[str, Any]:
    """``cls``'s arguments: what the runtime derives, then the config's pass-through fields over it
    (``model.megatron`` / ``parallelism.megatron`` / ``optimizer.megatron``, checked by :func:`passthrough_problems`
    before anything is queued: never a field a schema key owns), an enum field's name made its member."""
    try:
        hints = typing.get_type_hints(cls) if passed else {}
    except Exception:  # an annotation megatron-core's module cannot resolve here: the values as given
        hints = {}
    return {**derived, **{name: as_field(hints.get(name), value) for name, value in (passed or {}).items()}}


def passthrough_problems(cfg: JobConfig) -> List[str]:
    """One line for each pass-through field the installed megatron-core's class does not have (with the closest
    names), whose value does not fit the field's annotation (:mod:`orchestrator.config.megatron_types`) or a schema
    key already sets (:func:`orchestrator.config.megatron_passthrough.owned_problems`)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from orchestrator.runtime.rank.mcore import version

    classes = {"transformer": TransformerConfig, "ddp": DistributedDataParallelConfig, "optimizer": OptimizerConfig}
    problems = []
    for group, section in SECTIONS.items():
        known = [f.name for f in dataclasses.fields(classes[section])]
        for name, value in sorted((getattr(cfg, group).megatron or {}).items()):
            wrong = value_problem(f"{group}.megatron.{name}", classes[section], name, value) if name in known else None
            if wrong:
                problems.append(wrong)
            if name not in known:
                near = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
                problems.append(
                    f"{group}.megatron.{name}: megatron-core {version()}'s {classes[section].__name__} has no field "
                    f"{name}; fix: {'did you mean ' + ' or '.join(near) + '?' if near else 'check the name'} "
                    f"({group}.megatron sets that class's fields by their own names)"
                )
    return problems + owned_problems(cfg)
