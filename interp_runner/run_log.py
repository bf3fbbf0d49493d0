"""A quiet console and a kept log: vLLM's, torch's and transformers' log lines go to the run's log file beside the
store (``<store name>.log``, a companion like its report: ``interp_runner.store.claim``) and to Hydra's run-folder
log; the console shows the runner's own lines, the library warnings a user must know of (said in the runner's words,
``NOTABLE``) and library errors. ``interp-run -v`` shows every library line on the console too.

vLLM's own mechanism configures its logger in every process it starts: ``VLLM_LOGGING_CONFIG_PATH`` names a
``logging.config.dictConfig`` file (written here) whose handlers are this module's, so spawned engine cores and
tensor-parallel workers log to the same file. Where they log is an environment variable (``FILE_ENV``), read at each
record: a record is appended only while that file exists, never creating it (a worker that outlives its run, in a
sweep, writes nothing into a published log). Torch's and transformers' loggers get the same handlers in this process.
"""

from __future__ import annotations

import atexit
import json
import logging
import logging.config
import os
import re
import sys
import tempfile

FILE_ENV = "INTERP_RUNNER_LOG_FILE"  # the log file of the run that goes, unset between runs
VERBOSE_ENV = "INTERP_RUNNER_VERBOSE"  # "1": library lines on the console too
FORMAT = "%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"
LIBRARIES = ("torch", "transformers", "py.warnings")  # beside vLLM's, routed in this process
RUNNER = "interp_runner.console"  # the runner's own lines, kept in the log file beside the library lines

MAX_PENDING = 100
_pending: list[str] = []  # the runner's lines said before the log file begins
_also: list[logging.Handler] = []  # Hydra's run-folder log file (this process only)
_config_path: str | None = None  # the dictConfig file (``VLLM_LOGGING_CONFIG_PATH``), removed as this process ends


def _concurrency(args) -> str | None:
    tokens, times = args
    if float(times) >= 2:
        return None
    return (f"warning: the KV cache holds {float(times):.2f} sequences of {tokens} tokens (engine.max_model_len): "
            "requests will run nearly one at a time; raise engine.kv_cache_memory_bytes (CPU) or "
            "engine.gpu_memory_utilization (GPU), or lower engine.max_model_len")


# library messages (their templates) a user must know of -> the runner's line for them (None: not this time)
NOTABLE = {
    "Casting %s to %s.": lambda a: f"warning: the model's weights are {a[0]}; the engine casts them to {a[1]} "
                                   "(engine.dtype)",
    "Your device %s doesn't support %s. Falling back to %s for compatibility.":
        lambda a: f"warning: the device {a[0]} does not support {a[1]}: the engine computes in {a[2]} (engine.dtype)",
    "The model's config.json does not contain any of the keys to determine the original maximum length of the "
    "model. Assuming the model's maximum length is %d.":
        lambda a: f"warning: the model's config.json gives no maximum length: vLLM assumes {a[0]} tokens "
                  "(engine.max_model_len)",
    "Maximum concurrency for %s tokens per request: %.2fx": _concurrency,
}
NOTABLE_TEXT = {  # messages formatted before they are logged: their fixed start
    re.compile(r"Token indices sequence length is longer than the specified maximum sequence length"):
        lambda text: f"warning: a prompt is longer than the tokenizer's maximum ({text.split('(')[-1].split(')')[0]}"
                     " tokens): the model may not handle it",
}


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def notable(record: logging.LogRecord) -> str | None:
    """The runner's line for a library record a user must see, else None."""
    rule = NOTABLE.get(record.msg) if isinstance(record.msg, str) else None
    if rule is not None:
        try:
            return rule(tuple(record.args or ()))
        except (TypeError, ValueError, IndexError):
            return None
    text = record.getMessage()
    for pattern, say in NOTABLE_TEXT.items():
        if pattern.match(text):
            return say(text)
    return None


class LineFormatter(logging.Formatter):
    """vLLM's line format (level, time, file:line) for every library's records."""

    def format(self, record: logging.LogRecord) -> str:
        record.fileinfo = record.filename
        return super().format(record)


class RunFileHandler(logging.Handler):
    """Appends each record to the file ``FILE_ENV`` names, only while it exists (and, in this process, hands it to
    Hydra's log file too)."""

    def emit(self, record: logging.LogRecord) -> None:
        path = os.environ.get(FILE_ENV)
        try:
            text = self.format(record) + "\n"
            if not path and record.name == RUNNER and len(_pending) < MAX_PENDING:
                _pending.append(text)  # the runner's lines before its run's log begins (the plan)
            elif path:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # never created here: the runner creates it
                try:
                    os.write(fd, text.encode("utf-8", "backslashreplace"))
                finally:
                    os.close(fd)
        except FileNotFoundError:
            pass
        except Exception:
            self.handleError(record)
        for handler in _also:
            if record.levelno >= handler.level:
                handler.handle(record)


class ConsoleHandler(logging.Handler):
    """The console's share of library records: all of them with ``-v``; otherwise notable ones in the runner's words
    and errors."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if verbose():
                line = self.format(record)
            elif (said := notable(record)) is not None:
                line = said
            elif record.levelno >= logging.ERROR:
                line = f"{record.name.split('.')[0]} {record.levelname.lower()}: {record.getMessage()}"
            else:
                return
            stream = sys.stdout
            stream.write(line + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def dict_config(library_loggers=()) -> dict:
    """The dictConfig of vLLM's logger (and ``library_loggers``, torch's: it replaces the console handlers their
    library gave them at import, before vLLM's) in every process (``VLLM_LOGGING_CONFIG_PATH``)."""
    ours = {"handlers": ["interp_file", "interp_console"], "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": {"class": f"{__name__}.LineFormatter", "datefmt": DATE_FORMAT, "format": FORMAT}},
        "handlers": {"interp_file": {"class": f"{__name__}.RunFileHandler", "formatter": "vllm", "level": "DEBUG"},
                     "interp_console": {"class": f"{__name__}.ConsoleHandler", "formatter": "vllm",
                                        "level": "DEBUG"}},
        "loggers": {"vllm": {**ours, "level": os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()},
                    **{name: dict(ours) for name in library_loggers}},
    }


def _write_config(library_loggers=()) -> None:
    global _config_path
    if _config_path is None:
        fd, _config_path = tempfile.mkstemp(prefix="interp-runner-logging-", suffix=".json")
        os.close(fd)
        atexit.register(_remove, _config_path)
    with open(_config_path, "w") as f:
        json.dump(dict_config(library_loggers), f)
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = _config_path


def install(verbose_console: bool = False) -> None:
    """Route library logs as the module docstring says, in this process and in the processes it starts."""
    if verbose_console:
        os.environ[VERBOSE_ENV] = "1"
    _write_config()
    if "vllm.logger" in sys.modules:  # configured at its import already: again, as vLLM would now
        logging.config.dictConfig(dict_config())
    _also[:] = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    _pending.clear()
    runner = logging.getLogger(RUNNER)
    runner.setLevel(logging.INFO)
    runner.propagate = False
    if not any(isinstance(h, RunFileHandler) for h in runner.handlers):
        runner.addHandler(_handler(RunFileHandler))
    logging.captureWarnings(True)
    route_libraries()


def route_libraries() -> None:
    """Torch's, transformers' and Python's warnings' loggers (those imported by now) to this module's handlers, in
    place of the libraries' own console handlers."""
    names = [n for n in LIBRARIES if n == "py.warnings" or n in sys.modules]
    if "torch" in sys.modules:
        from torch._logging._internal import _is_torch_handler, log_registry

        names += [n for n in log_registry.get_log_qnames() if n != "torch"]
        for name in names:
            for h in logging.getLogger(name).handlers:
                if _is_torch_handler(h) and type(h) is logging.StreamHandler:
                    h.setLevel(logging.CRITICAL + 1)  # torch's console handler: ours prints instead
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(h, RunFileHandler) for h in logger.handlers):
            logger.addHandler(_handler(RunFileHandler))
            logger.addHandler(_handler(ConsoleHandler))
        logger.propagate = False


def _handler(cls) -> logging.Handler:
    handler = cls()
    handler.setFormatter(LineFormatter(FORMAT, datefmt=DATE_FORMAT))
    return handler


def installed() -> bool:
    """Whether ``install`` routes this process's logs (and its environment, which a caller may restore, still says
    so)."""
    return _config_path is not None and os.environ.get("VLLM_LOGGING_CONFIG_PATH") == _config_path


def begin(path) -> None:
    """Where ``install`` routed the logs: log to ``path`` from now on (created, or appended to where a resumed run's
    is). Nothing without ``install`` (the runner used as a library writes no log file)."""
    if not installed():
        return
    from torch._logging._internal import log_registry  # the engine's next: torch's loggers exist from now on

    _write_config(sorted(log_registry.get_log_qnames()))  # for the engine's processes, which import torch first
    with open(path, "a") as f:
        f.write("".join(_pending))
    _pending.clear()
    os.environ[FILE_ENV] = str(path)
    route_libraries()


def end() -> None:
    """Log to no file from now on (the run's log is complete)."""
    os.environ.pop(FILE_ENV, None)


def say(line: str) -> None:
    """A runner line: on the console and in the run's log file."""
    print(line, flush=True)
    logging.getLogger(RUNNER).info(line, stacklevel=2)  # the file and line that said it


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
