"""``interp-verify STORE --rerun --out OUT`` for several stores in one process of its own, started with an
environment of the caller's (one read once per process, as oneDNN's ``ONEDNN_MAX_CPU_ISA``): each rerun through
``main`` (``support.inprocess``), the later ones on the first one's engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support.inprocess import Completed

REPO = Path(__file__).resolve().parents[2]

# argv: the tests folder, the file for what each rerun returned, then STORE OUT for each rerun
RERUNS = """
import functools, json, sys
sys.path.insert(0, sys.argv[1])
from interp_runner import pipeline
from support.inprocess import SHARED, interp_verify
pipeline.run = functools.partial(pipeline.run, engines=SHARED)
done = [vars(interp_verify(store, "--rerun", "--out", out)) for store, out in zip(sys.argv[3::2], sys.argv[4::2])]
open(sys.argv[2], "w").write(json.dumps(done))
SHARED.shutdown()
"""


def verify_reruns(stores_and_outs: list[tuple[Path, Path]], results: Path, **env) -> list[Completed]:
    """What each rerun returned, in order; ``env`` is there before the process's first GEMM."""
    args = [str(a) for pair in stores_and_outs for a in pair]
    proc = subprocess.run([sys.executable, "-c", RERUNS, str(REPO / "tests"), str(results), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert proc.returncode == 0 and results.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return [Completed(**done) for done in json.loads(results.read_text())]
