"""The distribution ships every package of the source tree (a folder missing from pyproject's list installs
nowhere but an editable checkout)."""

from __future__ import annotations

import tomllib

from conftest import REPO


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "interp_runner").rglob("__init__.py")}
    assert found - listed == set()
