"""``interp-run``: Hydra composes the config; the pipeline does the rest. The only module that imports Hydra.

Multirun (``-m``) jobs that Hydra runs in this process share one engine pool: the engine is rebuilt only when the
model or engine settings change. Each job's store is listed in the sweep folder's index (``interp_runner.sweep``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .config import ConfigError
from .config.errors import EXIT_CODE

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
EXPERIMENTS_DIR = str(Path(__file__).resolve().parent.parent / "experiments")

OmegaConf.register_new_resolver("experiments_dir", lambda: EXPERIMENTS_DIR, replace=True)

_engines = None


def _engine_pool():
    global _engines
    if _engines is None:
        from .engine import EnginePool

        _engines = EnginePool()
    return _engines


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _main(cfg: DictConfig) -> None:
    from .pipeline import run

    hydra_cfg = HydraConfig.get()
    config = OmegaConf.to_container(cfg, resolve=True)
    overrides = list(hydra_cfg.overrides.task)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    store, status = None, "failed"
    try:
        store = run(config, Path(hydra_cfg.runtime.output_dir), overrides=overrides, engines=_engine_pool())
        status = "complete" if store is not None else "dry_run"
    except ConfigError as err:
        for path, reason in err.problems:
            print(f"config error: {path}: {reason}", file=sys.stderr)
        if not multirun:
            sys.exit(EXIT_CODE)
        status = "config_error"
    finally:
        if multirun:
            from .sweep import record_job

            record_job(Path(hydra_cfg.sweep.dir), hydra_cfg.job.num, overrides, store, status)
    if store is not None:
        from .summary import print_summary

        print_summary(store)
    if multirun and status == "config_error":
        raise SystemExit(EXIT_CODE)


def main() -> None:
    _main()
