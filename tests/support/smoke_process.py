"""One ``interp-run`` of the steering smoke experiment on tiny_random as a process of its own, its engine core in a
process of its own too (``VLLM_ENABLE_V1_MULTIPROCESSING=1``, as with tensor parallelism): started once per session
for the tests that read its exit status, console, store, report and log (tests/test_cli.py, tests/test_run_log.py),
which only read what it wrote."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SmokeRun:
    proc: subprocess.CompletedProcess
    folder: Path  # the store, its report and log, and Hydra's run folder (``run``)

    @property
    def store(self) -> Path:
        return self.folder / "smoke.zarr"


_done: list[SmokeRun] = []


def smoke_process(tmp_path_factory) -> SmokeRun:
    """The session's run, started on first use."""
    if not _done:
        folder = tmp_path_factory.mktemp("smoke_process")
        proc = subprocess.run(
            [str(REPO / ".venv" / "bin" / "interp-run"), "+experiment=steering_smoke", "model=tiny_random",
             "engine=eager", f"store.path={folder / 'smoke.zarr'}", f"hydra.run.dir={folder / 'run'}"],
            cwd=REPO, capture_output=True, text=True, timeout=600,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
        _done.append(SmokeRun(proc, folder))
    return _done[0]
