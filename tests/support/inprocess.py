"""``interp-run``, ``interp-verify`` and ``interp-report`` in this process, for tests not about the process itself:
the ``main`` their console scripts call, the command line in ``sys.argv``, the output captured and the exit status
returned, as a subprocess would give them, without a process's vLLM import and (with ``SHARED``) its engine start.
Engines started here get a KV cache of ``KV_CACHE_BYTES`` where the config leaves it open.

``SHARED`` keeps engines for the session, one per model, engine settings and weights seed: what a multirun process
does across its jobs, across tests. A run on it may be told its engine was reused; a test about a process's own
engine count or start passes ``engines=None`` (a pool of its own, closed when the run ends, as in a process).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KV_CACHE_BYTES = 256 << 20  # 128k tokens of tiny_random, 5k of SmolLM2-135M (the CLI's CPU default: 1 GiB)


@dataclass
class Completed:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would have returned."""

    args: list[str]
    returncode: int
    stdout: str
    stderr: str


class SharedEngines:
    """The ``EnginePool`` interface the pipeline drives, over one pool per (model folder, engine settings, weights
    seed); the least recently used engine closes when more than ``keep`` would be alive. A run's ``close`` leaves
    them open; ``shutdown`` (the session's end) closes them."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.pools: list[tuple[tuple, object]] = []  # (key, EnginePool), least recently used first
        self.log = None
        self.startup = None
        self.builds = 0
        self.runs = 0

    def get(self, model_path, cfg, spec, weights_seed=None):
        from interp_runner.engine.pool import EnginePool

        key = (str(model_path), cfg, weights_seed)
        found = [entry for entry in self.pools if entry[0] == key]  # settings compare equal, not hash
        if found:
            self.pools.remove(found[0])
            pool = found[0][1]
        else:
            while len(self.pools) >= self.keep:
                self.pools.pop(0)[1].close()
            pool = EnginePool()
        self.pools.append((key, pool))
        pool.log = self.log
        builds = pool.builds
        engine = pool.get(model_path, cfg, spec, weights_seed)
        self.builds += pool.builds - builds
        self.runs += 1
        self.startup = pool.startup
        return engine

    def close(self) -> None:
        """A run ended: its engine stays for the next."""

    def shutdown(self) -> None:
        while self.pools:
            self.pools.pop()[1].close()


SHARED = SharedEngines()


def _loggers() -> dict[str, logging.Logger]:
    return {"": logging.getLogger(), **{name: logger for name, logger in logging.Logger.manager.loggerDict.items()
                                        if isinstance(logger, logging.Logger)}}


@contextlib.contextmanager
def _as_a_process(argv: list[str], cwd: Path, env: dict[str, str] | None):
    """``argv``, ``cwd`` and ``env`` (added to os.environ) for the call; afterwards they, os.environ and every
    logger's handlers, level and propagation (a run configures logging: Hydra, ``interp_runner.run_log``) as they
    were, and the handlers the run added closed."""
    saved_argv, saved_cwd, saved_env = sys.argv, os.getcwd(), dict(os.environ)
    saved_logging = {name: (logger.handlers[:], logger.level, logger.propagate, logger.disabled)
                     for name, logger in _loggers().items()}
    warnings_logged = logging._warnings_showwarning is not None
    sys.argv = argv
    os.environ.update(env or {})
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        kept = {h for handlers, *_ in saved_logging.values() for h in handlers}
        for name, logger in _loggers().items():
            added = [h for h in logger.handlers if h not in kept]
            if name in saved_logging:
                logger.handlers[:], level, logger.propagate, logger.disabled = saved_logging[name]
                logger.setLevel(level)
            else:
                logger.handlers[:] = [h for h in logger.handlers if h in kept]
            for handler in added:
                handler.close()
        logging.captureWarnings(warnings_logged)


class _Captured(io.StringIO):
    """A stream's text, kept; its file descriptor the process's (vLLM silences the descriptor while it sets up)."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd = fd

    def fileno(self) -> int:
        return self.fd


@contextlib.contextmanager
def _small_kv_cache():
    """An engine started meanwhile gets a KV cache of ``KV_CACHE_BYTES`` on a CPU, where the config leaves it open:
    several engines live in this process, and an engine's memory is not all given back when it closes."""
    from interp_runner.engine import settings as engine

    saved = engine.CPU_KV_CACHE_BYTES
    engine.CPU_KV_CACHE_BYTES = min(saved, KV_CACHE_BYTES)
    try:
        yield
    finally:
        engine.CPU_KV_CACHE_BYTES = saved


def _call(main, argv: list[str], cwd: Path, env: dict[str, str] | None) -> Completed:
    out, err = _Captured(1), _Captured(2)
    with _as_a_process(argv, cwd, env), _small_kv_cache(), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            code = main()
        except SystemExit as stop:
            code = stop.code
        except Exception:  # uncaught: shown as the interpreter would, exit status 1
            traceback.print_exc()
            code = 1
    if isinstance(code, str):  # sys.exit("message")
        err.write(code + "\n")
        code = 1
    return Completed(argv, 0 if code is None else code, out.getvalue(), err.getvalue())


def interp_run(*args, cwd: Path = REPO, engines: SharedEngines | None = SHARED,
               env: dict[str, str] | None = None) -> Completed:
    """``interp-run ARGS`` run in ``cwd``; its engine from ``engines`` (None: one of its own, closed at the end)."""
    from interp_runner import cli

    saved = cli._engines
    cli._engines = engines
    try:
        return _call(cli.main, ["interp-run", *map(str, args)], cwd, env)
    finally:
        cli._engines = saved


def interp_verify(*args, cwd: Path = REPO, env: dict[str, str] | None = None) -> Completed:
    """``interp-verify ARGS`` run in ``cwd`` (a rerun starts an engine of its own, closed at its end)."""
    from interp_runner import verify

    argv = ["interp-verify", *map(str, args)]
    return _call(lambda: verify.main(argv[1:]), argv, cwd, env)


def interp_report(*args, cwd: Path = REPO, env: dict[str, str] | None = None) -> Completed:
    """``interp-report ARGS`` run in ``cwd``."""
    from interp_runner.report import cli

    argv = ["interp-report", *map(str, args)]
    return _call(lambda: cli.main(argv[1:]), argv, cwd, env)
