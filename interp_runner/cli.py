"""``interp-run``: Hydra composes the config; the pipeline does the rest. The only module that imports Hydra."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .config import ConfigError
from .config.errors import EXIT_CODE

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
EXPERIMENTS_DIR = str(Path(__file__).resolve().parent.parent / "experiments")

OmegaConf.register_new_resolver("experiments_dir", lambda: EXPERIMENTS_DIR, replace=True)


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _main(cfg: DictConfig) -> None:
    from .pipeline import run

    hydra_cfg = HydraConfig.get()
    config = OmegaConf.to_container(cfg, resolve=True)
    try:
        store = run(config, Path(hydra_cfg.runtime.output_dir), overrides=list(hydra_cfg.overrides.task))
    except ConfigError as err:
        for path, reason in err.problems:
            print(f"config error: {path}: {reason}", file=sys.stderr)
        sys.exit(EXIT_CODE)
    if store is not None:
        from .summary import print_summary

        print_summary(store)


def main() -> None:
    _main()
