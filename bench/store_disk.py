"""The filesystem side of ``store_bandwidth.py``: ``dd`` on the store's filesystem (through the page cache and
flushed, or around it), every file and folder of a tree fsynced, a tree's bytes, the filesystem's type and mount."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path


# -- filesystem -------------------------------------------------------------------------------------------


def fsync_tree(root: Path) -> int:
    """fsync every file and directory under ``root`` (and ``root``'s parent); returns the files' total size."""
    total = 0
    for folder, dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
        fsync_dir(Path(folder))
    fsync_dir(root.parent)
    return total


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tree_bytes(root: Path, under: str | None = None) -> int:
    base = root / under if under else root
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(base) for f in fs)


def filesystem(path: Path) -> dict:
    info = {"dir": str(path)}
    for key, cmd in (("fstype", ["stat", "-f", "-c", "%T", str(path)]),
                     ("mount", ["findmnt", "-n", "-T", str(path), "-o", "SOURCE,FSTYPE,OPTIONS"])):
        try:
            info[key] = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            info[key] = None
    usage = shutil.disk_usage(path)
    info["free_gb"] = usage.free / 1e9
    return info


# -- dd -------------------------------------------------------------------------------------------------

DD_FLAGS = {"fdatasync": "conv=fdatasync", "direct": "oflag=direct"}
DD_RATE = re.compile(r"copied, ([\d.]+) s, ([\d.]+) ([kMGT]?B)/s")
UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def dd_once(folder: Path, gib: float, mode: str) -> dict:
    path = folder / "dd.bin"
    count = max(1, round(gib * 1024 / 64))
    cmd = ["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={count}", DD_FLAGS[mode]]
    try:
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
        if proc.returncode == 0:
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(folder)
        seconds = time.perf_counter() - t0
        size = path.stat().st_size if path.exists() else 0
    finally:
        path.unlink(missing_ok=True)
    last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
    if proc.returncode != 0:
        return {"mode": mode, "command": " ".join(cmd), "error": last or f"dd exited with {proc.returncode}"}
    out = {"mode": mode, "command": " ".join(cmd), "bytes": size, "seconds": seconds, "mb_s": size / seconds / 1e6,
           "dd_says": last}
    found = DD_RATE.search(last)
    if found:
        out["dd_seconds"] = float(found.group(1))
        out["dd_mb_s"] = float(found.group(2)) * UNITS[found.group(3)] / 1e6
    return out
