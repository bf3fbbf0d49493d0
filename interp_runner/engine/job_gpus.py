"""One GPU group per sweep job process: a multirun whose launcher runs jobs in processes of their own (joblib,
submitit's local executor) gives each process its own ``engine.tensor_parallel_size`` GPUs, so the jobs' engines
share no GPU. The launcher schedules the jobs; this only says which visible GPUs a job process takes.

A process takes the group ``job number mod groups``, or the next one that no other process of this user holds
(an OS lock per group, held while the process lives and released by the kernel when it ends); where every group
is held, the job number's. It binds through ``CUDA_VISIBLE_DEVICES`` before anything starts CUDA, and keeps its
group for every later job it runs (a joblib worker runs several): CUDA reads the variable once per process.
"""

from __future__ import annotations

import fcntl
import glob
import os
import tempfile
from pathlib import Path

ENV = "CUDA_VISIBLE_DEVICES"
_bound: tuple[str, ...] | None = None
_held = []  # open lock files of the group this process holds


def visible_gpus() -> list[str]:
    """The GPUs this process may use, without starting CUDA: ``CUDA_VISIBLE_DEVICES`` where set, else NVML's
    count (the driver's device files where NVML is missing)."""
    listed = os.environ.get(ENV)
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return sorted((p.removeprefix("/dev/nvidia") for p in glob.glob("/dev/nvidia[0-9]*")), key=int)


def groups_of(gpus: list[str], per_job: int) -> list[tuple[str, ...]]:
    return [tuple(gpus[i:i + per_job]) for i in range(0, len(gpus) - per_job + 1, per_job)]


def _claim(group: tuple[str, ...], lock_dir: Path) -> bool:
    lock_dir.mkdir(parents=True, exist_ok=True)
    f = open(lock_dir / f"gpus-{'-'.join(group)}.lock", "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return False
    _held.append(f)
    return True


def bind_job(job_num: int, per_job: int, lock_dir: Path | None = None) -> tuple[str, ...] | None:
    """Restrict this process to one group of ``per_job`` visible GPUs (see the module); the group, or None where
    the visible GPUs make fewer than two groups (nothing to spread: the job keeps what it sees)."""
    global _bound
    if _bound is not None:
        return _bound
    groups = groups_of(visible_gpus(), max(1, per_job))
    if len(groups) < 2:
        return None
    lock_dir = lock_dir or Path(tempfile.gettempdir()) / f"interp-runner-{os.getuid()}"
    order = [groups[(job_num + i) % len(groups)] for i in range(len(groups))]
    chosen = next((g for g in order if _claim(g, lock_dir)), order[0])
    os.environ[ENV] = ",".join(chosen)
    _bound = chosen
    return chosen
