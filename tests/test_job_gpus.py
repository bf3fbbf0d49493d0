"""Sweep jobs in processes of their own each take their own GPUs (``interp_runner.engine.job_gpus``), and a `-m` sweep
through the joblib launcher (``hydra/launcher=parallel``) runs with every job's store complete."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import zarr

from conftest import REPO
from test_cli import interp_run

CLAIM = """
import sys, time
from pathlib import Path
from interp_runner.engine.job_gpus import bind_job
print(",".join(bind_job(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))), flush=True)
time.sleep(float(sys.argv[4]))  # holds its group meanwhile
"""


def claim(job: int, per_job: int, lock_dir, visible: str, hold: float = 0.0) -> subprocess.Popen:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible, "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-c", CLAIM, str(job), str(per_job), str(lock_dir), str(hold)],
                            env=env, stdout=subprocess.PIPE, text=True)


def test_a_job_takes_the_group_of_its_number(tmp_path):
    assert claim(1, 1, tmp_path, "0,1").communicate(timeout=60)[0].strip() == "1"
    assert claim(2, 1, tmp_path, "0,1").communicate(timeout=60)[0].strip() == "0"
    assert claim(1, 2, tmp_path, "4,5,6,7").communicate(timeout=60)[0].strip() == "6,7"  # TP = 2: pairs


def test_concurrent_job_processes_never_share_a_group(tmp_path):
    """Jobs 0 and 2 (same parity) at once on two GPUs: the second finds group 0 held and takes group 1."""
    first = claim(0, 1, tmp_path, "0,1", hold=20)
    assert first.stdout.readline().strip() == "0"
    second = claim(2, 1, tmp_path, "0,1")
    assert second.communicate(timeout=60)[0].strip() == "1"
    first.kill()
    first.wait()
    # the kernel released the killed process's lock: group 0 is free again
    assert claim(2, 1, tmp_path, "0,1").communicate(timeout=60)[0].strip() == "0"


def test_fewer_than_two_groups_leave_the_job_as_it_is(tmp_path, monkeypatch):
    import interp_runner.engine.job_gpus as job_gpus

    monkeypatch.setattr(job_gpus, "_bound", None)
    for visible, per_job in (("0", 1), ("0,1", 2), ("", 1)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert job_gpus.bind_job(3, per_job, tmp_path) is None
        assert os.environ["CUDA_VISIBLE_DEVICES"] == visible


@pytest.mark.engine
@pytest.mark.cli
def test_a_joblib_sweep_runs_each_job_in_its_own_process_on_its_own_gpu(tmp_path, monkeypatch):
    """Two tiny jobs through ``hydra/launcher=parallel``: each job process builds its own engine and writes a
    complete store. With two GPUs listed (ignored by the CPU engine), each job process is bound to one of them."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    sweep = tmp_path / "sweep"
    proc = interp_run("-m", "hydra/launcher=parallel", "+experiment=steering_smoke", "model=tiny_random",
                      "engine=eager", "sampling.max_tokens=2,3", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = json.loads((sweep / "sweep.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["complete", "complete"]
    for job in jobs:  # each the first run of its process: two processes, one engine each
        engine = dict(zarr.open_group(str(sweep / job["store"]), mode="r").attrs)["engine"]
        assert engine["builds_in_process"] == 1 and engine["runs_in_process"] == 1 and not engine["reused"]
    assert "job 0: GPUs 0" in proc.stderr and "job 1: GPUs 1" in proc.stderr
