"""The user's data files (prompts, facts): read as UTF-8 JSON lines and checked row by row, every error naming
the config key that points at the file and the file's line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from interp_runner.config.errors import ConfigError, problems_of

Row = TypeVar("Row", bound=BaseModel)


def read_text(path: Path, where: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError.at(where, f"file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError.at(where, f"{path} is a folder, not a file") from None
    except UnicodeDecodeError as err:
        raise ConfigError.at(where, f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise ConfigError.at(where, f"cannot read {path}: {err.strerror or err}") from None


def read_rows(path: Path, where: str, model: type[Row]) -> list[Row]:
    """The file's non-blank lines, each a JSON object validated as ``model``; row i's keys are ``where[i].*``."""
    rows: list[Row] = []
    # JSON lines end at "\n" only: str.splitlines would also split at the Unicode separators a text may hold
    for n, line in enumerate(read_text(path, where).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            data = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError.at(where, f"{path}:{n} is not valid JSON ({err.msg})") from None
        if not isinstance(data, dict):
            raise ConfigError.at(where, f"{path}:{n} is not a JSON object")
        try:
            rows.append(model.model_validate(data))
        except ValidationError as err:
            raise ConfigError([(key, f"{path}:{n}: {reason}")
                               for key, reason in problems_of(err, f"{where}[{len(rows)}]")]) from None
    return rows
