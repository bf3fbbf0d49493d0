"""Configuration: the pydantic schema of the keys every run has, and validation errors that name the key (no Hydra
in here). The whole run config, with a section per experiment kind, is ``interp_runner.config.run``.
Imports only the kinds' registry (each kind owns its section) and the site names; nothing downstream."""

from interp_runner.config.errors import ConfigError
from interp_runner.config.schema import RunBase

__all__ = ["ConfigError", "RunBase"]
