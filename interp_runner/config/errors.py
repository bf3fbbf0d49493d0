"""Validation errors that name the offending config key, e.g. ``steering.request[2].prefill.post_block.layer``."""

from __future__ import annotations

from pydantic import ValidationError

EXIT_CODE = 2


class ConfigError(Exception):
    """One or more problems in the user's config, each as (key path, reason)."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(f"{path}: {reason}" for path, reason in problems))

    @classmethod
    def at(cls, path: str, reason: str) -> ConfigError:
        return cls([(path, reason)])


def key_path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


# pydantic tags union members and wrappers with names that are not config keys
_NOT_KEYS = ("SteerTerm", "list[SteerTerm]", "function-after", "function-before", "str", "int",
             "list[int]", "literal[", "PromptItem", "tagged-union", "constrained-")


def _clean_loc(loc: tuple) -> tuple:
    return tuple(p for p in loc if not (isinstance(p, str) and p.startswith(_NOT_KEYS)))


def problems_of(err: ValidationError, prefix: str = "") -> list[tuple[str, str]]:
    """pydantic's errors as (key path, reason), the key paths below ``prefix``."""
    problems: dict[str, str] = {}
    for e in err.errors():
        path = key_path(((prefix,) if prefix else ()) + _clean_loc(e["loc"])) or "<root>"
        reason = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
        if e["type"] == "missing":
            reason = "required key is missing"
        problems.setdefault(path, reason)  # union branches repeat a path; the first reason is enough
    # a union reports a mismatch at the parent for each branch it ruled out: keep the deepest reasons
    return [
        (path, reason)
        for path, reason in sorted(problems.items())
        if not any(other != path and other.startswith((path + ".", path + "[")) for other in problems)
    ]
