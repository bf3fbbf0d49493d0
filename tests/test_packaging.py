"""The distribution ships every package of the source tree (a folder missing from pyproject's list installs
nowhere but an editable checkout), and the configs and data its experiments need."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib

import pytest

from conftest import REPO


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "interp_runner").rglob("__init__.py")}
    assert found - listed == set()


@pytest.mark.cli
def test_an_installed_copy_composes_every_experiment_from_what_it_ships(tmp_path):
    """A real (non-editable) install of the tree, run from elsewhere: the configs and the experiments' data come
    from inside the installed package, and every built-in experiment composes with its data files present."""
    source, site = tmp_path / "src", tmp_path / "site"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "interp_runner", "kernels", "conf", "experiments"):
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy)(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True, capture_output=True)
    experiments = sorted(p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml"))
    code = f"""
import json, sys
from pathlib import Path
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from interp_runner.cli import CONF_DIR, EXPERIMENTS_DIR
assert CONF_DIR.startswith({str(site)!r}) and EXPERIMENTS_DIR.startswith({str(site)!r}), (CONF_DIR, EXPERIMENTS_DIR)
files = []
with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
    for name in {experiments!r}:
        cfg = OmegaConf.to_container(compose("config", [f"+experiment={{name}}"]), resolve=True)
        stack = [cfg]
        while stack:
            node = stack.pop()
            values = node.values() if isinstance(node, dict) else node if isinstance(node, list) else []
            for v in values:
                if isinstance(v, (dict, list)):
                    stack.append(v)
                elif isinstance(v, str) and v.startswith(EXPERIMENTS_DIR):
                    files.append(v)
missing = [f for f in files if not Path(f).exists()]
assert files and not missing, missing
print(len(files))
"""
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
