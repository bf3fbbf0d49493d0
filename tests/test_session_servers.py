"""A test session stopped from outside (SIGTERM, as a CI or GPU-lane timeout stops it) stops the servers its tests
started in process groups of their own, and still runs the tests' ``finally`` blocks."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from test_serve import group_ends

TESTS = Path(__file__).resolve().parent

SESSION = """
import subprocess, sys, time
from pathlib import Path
from support import servers

servers.interrupt_on_sigterm()
out = Path(sys.argv[1])
server = servers.track(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                        start_new_session=True))
(out / "pid").write_text(str(server.pid))
try:
    time.sleep(600)
finally:
    (out / "finally").write_text("ran")
"""


def test_sigterm_stops_the_sessions_servers_and_runs_finally_blocks(tmp_path):
    session = subprocess.Popen([sys.executable, "-c", SESSION, str(tmp_path)], cwd=TESTS, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.time() + 60
    while not (tmp_path / "pid").exists() and time.time() < deadline:
        time.sleep(0.05)
    server = int((tmp_path / "pid").read_text())
    session.send_signal(signal.SIGTERM)
    _, err = session.communicate(timeout=60)
    assert session.returncode != 0 and "KeyboardInterrupt: signal 15" in err
    assert (tmp_path / "finally").read_text() == "ran"
    assert group_ends(server, within=30), "the server's process group outlived the session"


def test_this_session_is_stopped_that_way():
    handler = signal.getsignal(signal.SIGTERM)
    assert getattr(handler, "__qualname__", "") == "interrupt_on_sigterm.<locals>.handler"
