"""Configuration: the pydantic schema of the keys every run has, and validation errors that name the key (no Hydra
in here). The whole run config, with a section per experiment kind, is ``interp_runner.run_config``."""

from .errors import ConfigError
from .schema import RunBase

__all__ = ["ConfigError", "RunBase"]
