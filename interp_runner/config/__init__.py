"""Configuration: pydantic schema of a run and its validation errors (no Hydra in here)."""

from .errors import ConfigError, validate_config
from .schema import RunConfig

__all__ = ["ConfigError", "RunConfig", "validate_config"]
