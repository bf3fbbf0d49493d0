"""The run config: the keys every run has (``config.schema.RunBase``) plus one optional section per registered
experiment kind (``interp_runner.kinds``), validated into a frozen pydantic model.

A kind's section runs alone: it cannot be combined with another kind's section, nor with the keys of the prompts
kind that the kind lists in its ``excludes``.
"""

from __future__ import annotations

from typing import Any, Optional

from pydantic import ValidationError, create_model, model_validator

from interp_runner.config.errors import ConfigError, problems_of
from interp_runner.config.schema import RunBase
from interp_runner.kinds import KINDS

SECTIONS = tuple(kind for kind in KINDS if kind.section is not None)


def _is_set(config: RunBase, dotted: str) -> bool:
    """Whether the key ``dotted`` (e.g. ``prompts.items``) holds something other than its default."""
    *parents, key = dotted.split(".")
    model = config
    for parent in parents:
        model = getattr(model, parent)
    value = getattr(model, key)
    return bool(value) and value != type(model).model_fields[key].default


def _kinds_run_alone(config: RunBase) -> RunBase:
    given = [kind for kind in SECTIONS if getattr(config, kind.section) is not None]
    if len(given) > 1:
        raise ValueError(f"'{given[1].section}' cannot be combined with '{given[0].section}'")
    for kind in given:
        for key, why in kind.excludes.items():
            if _is_set(config, key):
                raise ValueError(f"'{key.split('.')[0]}' cannot be combined with '{kind.section}'"
                                 + (f" ({why})" if why else ""))
    return config


RunConfig = create_model(
    "RunConfig",
    __base__=RunBase,
    __doc__="A run's config: the keys every run has and the section of at most one experiment kind.",
    __validators__={"kinds_run_alone": model_validator(mode="after")(_kinds_run_alone)},
    **{kind.section: (Optional[kind.settings], None) for kind in SECTIONS},
)


def validate_config(data: dict[str, Any]) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(problems_of(err)) from None
