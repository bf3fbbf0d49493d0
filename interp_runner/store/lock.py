"""An exclusive lock on a store path for the whole run, naming its holder.

The lock is an OS lock (``flock`` through ``filelock``) on a lock file, so the kernel releases it when its process
dies, however it dies: a lock can only be stale in that its file is left behind. The holder writes its pid, host and
start time into the file once it holds the lock, and empties and removes the file when it releases it. So a second
run that cannot take the lock reads who holds it, and a run that takes a lock whose file still names a holder knows
that the holder was killed (``stale``) and takes it over.
"""

from __future__ import annotations

import json
import os
import socket
import time
from datetime import datetime, timezone
from pathlib import Path

from filelock import FileLock, Timeout

NAMELESS_RETRIES = 5  # tries more when the lock is held by a process that has not named itself


class StoreLocked(Exception):
    """Another process holds the lock; ``holder`` is what it wrote (None if it could not be read yet)."""

    def __init__(self, path: Path, holder: dict | None):
        self.path, self.holder = path, holder
        super().__init__(f"{path} is held by {describe_holder(holder)}")


def describe_holder(holder: dict | None) -> str:
    if not holder:
        return "another process (it has not written its name yet)"
    return f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started_at')}"


def read_holder(path: Path) -> dict | None:
    try:
        return parse_holder(Path(path).read_bytes())
    except OSError:
        return None


def parse_holder(data: bytes) -> dict | None:
    """What a holder wrote (None for an empty file; a note for one that is not what a holder writes)."""
    if not data.strip():
        return None
    try:
        holder = json.loads(data)
    except ValueError:
        holder = None
    return holder if isinstance(holder, dict) else {"pid": "?", "host": "?", "started_at": "? (unreadable record)"}


class StoreLock:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.stale: dict | None = None  # the holder a killed run left in the file, found when taking the lock
        self.holder = {"pid": os.getpid(), "host": socket.gethostname(),
                       "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds")}
        self._lock = FileLock(str(self.path), timeout=0, on_acquired=self._write_holder)

    def acquire(self) -> None:
        """Take the lock at once or raise ``StoreLocked``; an ``OSError`` where the lock file cannot be made."""
        # opened (created if missing) first, as the lock does: a file that cannot be made is not a lock held by another
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | os.O_NOFOLLOW, 0o644))
        for attempt in range(NAMELESS_RETRIES + 1):
            try:
                self._lock.acquire(blocking=False)
                return
            except Timeout:
                holder = read_holder(self.path)
                # no name: the holder is between taking the lock and writing it, or between emptying and releasing
                if holder is not None or attempt == NAMELESS_RETRIES:
                    raise StoreLocked(self.path, holder) from None
                time.sleep(0.05)

    def release(self) -> None:
        if not self._lock.is_locked:
            return
        try:  # while still held: a run that opened the file before it went takes the lock on a fresh file
            os.truncate(self.path, 0)
            self.path.unlink()
        except OSError:
            pass
        self._lock.release()

    def _write_holder(self, fd: int) -> None:
        self.stale = parse_holder(os.pread(fd, 1 << 16, 0))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.holder).encode(), 0)

