"""The experiment kinds, registered once: a kind is one module or subpackage here (its ``KIND``, see ``base.Kind``) plus its
``conf/experiment/*.yaml``. Pipeline, store, summary, verify and the report find a run's kind here and call only
its interface: ``kind_for`` a config (the kind whose section it sets, else the prompts kind), ``kind_of_store``
a finished store (its manifest's ``kind``; stores written before kinds were recorded: their config's).
Imports compile/, store/, vectors/, models/ and config/; never engine/ or report/.
"""

from __future__ import annotations

import importlib

import yaml

from interp_runner.kinds.base import Kind

# one entry per kind module; the first is the default kind, which has no section of its own
MODULES = ("prompts", "causal_trace", "steering_vectors")
KINDS: tuple[Kind, ...] = tuple(importlib.import_module(f"{__name__}.{module}").KIND for module in MODULES)
DEFAULT = KINDS[0]
BY_NAME = {kind.name: kind for kind in KINDS}


def section_of(config, key: str):
    """The value of ``key`` in a config: a validated one (attribute) or a raw dict (item); None when unset."""
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def kind_for(config) -> Kind:
    """The kind of a run config (validated or a raw dict): the one whose section it sets, else the default."""
    return next((kind for kind in KINDS if kind.section is not None and section_of(config, kind.section) is not None),
                DEFAULT)


def kind_of_store(attrs: dict) -> Kind:
    """The kind that wrote a store, from its root attributes; LookupError for a kind this version lacks."""
    name = attrs.get("kind")
    if name is not None:
        if name not in BY_NAME:
            raise LookupError(f"the store was written by the experiment kind {name!r}, which this version lacks "
                              f"(it has {', '.join(BY_NAME)})")
        return BY_NAME[name]
    try:  # a store from before kinds were recorded: its config says
        config = yaml.safe_load(attrs.get("config_yaml") or "{}")
    except yaml.YAMLError:
        config = None
    return kind_for(config if isinstance(config, dict) else {})
