"""A vLLM process of an interp engine (an engine core, a tensor-parallel worker) ends once the process that started it
is gone. A run or a server killed with SIGKILL would otherwise leave its engine core running, holding the model and
its KV cache (GPU memory included) until someone kills it by hand."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time

POLL_S = 1.0


def start() -> None:
    """In a process that multiprocessing started (never the run's or server's own process, which may well outlive
    the shell that started it), a daemon thread that ends this process when its parent has exited."""
    if multiprocessing.parent_process() is None:
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:  # an orphan's parent becomes init (or a subreaper)
            time.sleep(POLL_S)
        os._exit(1)  # nothing left to report to: the parent and its pipes are gone

    threading.Thread(target=watch, name="interp-parent-watch", daemon=True).start()
