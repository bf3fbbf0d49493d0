"""Where the Hydra configs (``conf/``) and the experiments' data (``experiments/``) are: inside the package in an
installed wheel (``interp_runner/conf``), beside it in a source tree or an editable install."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent


def shipped_dir(name: str) -> Path:
    for candidate in (HERE / name, HERE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"interp_runner's {name}/ is missing: neither {HERE / name} nor {HERE.parent / name}")


CONF_DIR = shipped_dir("conf")
EXPERIMENTS_DIR = shipped_dir("experiments")
