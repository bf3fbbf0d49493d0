"""The servers a test session started, each in a process group of its own (so that stopping one stops its engine core
too). A session stopped from outside (SIGTERM: a CI or GPU-lane timeout) stops them first; without that they would
outlive it, holding their models and KV caches (GPU memory included) until killed by hand."""

from __future__ import annotations

import os
import signal
import subprocess

_started: list[subprocess.Popen] = []


def track(proc: subprocess.Popen) -> subprocess.Popen:
    _started.append(proc)
    return proc


def untrack(proc: subprocess.Popen) -> None:
    if proc in _started:
        _started.remove(proc)


def terminate_all() -> None:
    """SIGTERM to every tracked server's process group that is still there: each shuts down on its own meanwhile."""
    for proc in _started:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def interrupt_on_sigterm() -> None:
    """SIGTERM stops the session as Ctrl-C does, after telling the servers to stop: tests' ``finally`` blocks and
    fixtures' teardowns still run (a plain SIGTERM ends Python at once and runs neither)."""

    def handler(signum, frame):
        terminate_all()
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
