"""``interp-run``: Hydra composes the config; the pipeline does the rest. With ``cli_errors``, which explains
Hydra's own errors, the only module that imports Hydra. Every bad config exits 2 naming the key, Hydra's errors
(an unknown experiment, key or option, an override that does not parse) included.

Multirun (``-m``) jobs that Hydra runs in this process share one engine pool: the engine is rebuilt only when the
model or engine settings change. Jobs that a launcher runs in processes of their own each take their own GPUs
(``job_gpus``). Each job's store is listed in the sweep folder's index (``interp_runner.sweep``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra._internal.utils import run_and_report
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from interp_runner import run_log, shipped
from interp_runner.cli_errors import COMMAND_LINE_ERRORS, explain
from interp_runner.config import ConfigError
from interp_runner.config.errors import EXIT_CODE

CONF_DIR, EXPERIMENTS_DIR = str(shipped.CONF_DIR), str(shipped.EXPERIMENTS_DIR)

OmegaConf.register_new_resolver("experiments_dir", lambda: EXPERIMENTS_DIR, replace=True)

_engines = None
VERBOSE_FLAGS = ("-v", "--verbose")  # not Hydra's: taken off the command line before Hydra parses it
_verbose = False


def _engine_pool():
    global _engines
    if _engines is None:
        from interp_runner.engine.pool import EnginePool

        _engines = EnginePool()
    return _engines


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def _main(cfg: DictConfig) -> None:
    from interp_runner.pipeline import run

    hydra_cfg = HydraConfig.get()
    run_log.install(_verbose)  # after Hydra's logging set-up: its run-folder log gets the libraries' lines too
    overrides = OmegaConf.to_container(hydra_cfg.overrides.task)  # as typed: "${...}" in one stays unresolved
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if multirun and not hydra_cfg.launcher._target_.endswith(".BasicLauncher"):
        # jobs in processes of their own: each takes its own GPUs before CUDA starts (``job_gpus``)
        from interp_runner.engine.job_gpus import bind_job

        tp = OmegaConf.select(cfg, "engine.tensor_parallel_size", default=1, throw_on_resolution_failure=False)
        gpus = bind_job(hydra_cfg.job.num, tp if isinstance(tp, int) and tp > 1 else 1)  # a bad tp: the config check's
        if gpus is not None:
            print(f"job {hydra_cfg.job.num}: GPUs {','.join(gpus)}", file=sys.stderr, flush=True)
    store, status = None, "failed"
    try:
        config = resolved(cfg)
        store = run(config, Path(hydra_cfg.runtime.output_dir), overrides=overrides, engines=_engine_pool(),
                    log=run_log.say)
        status = "complete" if store is not None else "dry_run"
    except ConfigError as err:
        report(err.problems)
        if not multirun:
            sys.exit(EXIT_CODE)
        status = "config_error"
    finally:
        if multirun:
            from interp_runner.report.sweep_index import write_index_page
            from interp_runner.sweep import record_job

            record_job(Path(hydra_cfg.sweep.dir), hydra_cfg.job.num, overrides, store, status,
                       on_recorded=write_index_page)
    if store is not None:
        from interp_runner.summary import print_summary

        print_summary(store)
    if multirun and status == "config_error":
        raise SystemExit(EXIT_CODE)


def resolved(cfg: DictConfig) -> dict:
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:  # an interpolation that does not resolve
        raise ConfigError.at(err.full_key or "<config>", str(err).splitlines()[0]) from None


def report(problems: list[tuple[str, str]]) -> None:
    for path, reason in problems:
        print(f"config error: {path}: {reason}", file=sys.stderr)


def _reraise(err: BaseException) -> None:
    """Raise ``err`` again from its frames below Hydra's ``run_job``, where Hydra's short report starts."""
    tb = err.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_name != "run_job":
        tb = tb.tb_next
    raise err.with_traceback(tb or err.__traceback__)


def main() -> None:
    """``interp-run [-v] [Hydra's arguments]``: ``-v`` shows vLLM's, torch's and transformers' log lines on the
    console too (``interp_runner.run_log``; they always go to the log file beside the store)."""
    global _verbose
    _verbose = any(arg in VERBOSE_FLAGS for arg in sys.argv[1:])
    sys.argv[1:] = [arg for arg in sys.argv[1:] if arg not in VERBOSE_FLAGS]
    hydra_reports = "HYDRA_FULL_ERROR" not in os.environ
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra raises its errors instead of printing them and exiting 1
    try:
        _main()
    except COMMAND_LINE_ERRORS as err:
        report(explain(err, sys.argv[1:], CONF_DIR, "config"))
        sys.exit(EXIT_CODE)
    except Exception as err:
        if hydra_reports:  # any other error as Hydra reports it: short, exit 1
            del os.environ["HYDRA_FULL_ERROR"]
            run_and_report(lambda: _reraise(err))
        raise
    finally:  # the engine's processes end (and free their GPUs) before this one does
        if _engines is not None:
            _engines.close()


def main_as_module() -> None:
    """``python -m``: ``main`` with the import path ``interp-run`` has. ``-m`` puts the working directory first on it,
    where a folder could shadow an installed package of its name (the repository's ``kernels/`` shadows the
    ``kernels`` package that transformers probes for, at the cost of a scan of every installed distribution)."""
    if not sys.flags.safe_path and sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    main()


if __name__ == "__main__":
    main_as_module()
