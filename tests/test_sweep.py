"""Hydra multirun: engine reuse across jobs, the sweep index, the sweep as one dataset, and the shipped launcher
configs. Sweeps of Hydra's basic launcher (jobs in the ``interp-run`` process) run through the CLI's ``main`` in this
process, on an engine pool of their own as in a process of their own (``support.inprocess``); a launcher's sweep runs
as a real process."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr

import interp_runner
from conftest import REPO
from interp_runner.engine.pool import EnginePool
from interp_runner.payload import EngineSpec
from interp_runner.sweep import record_job, swept_parameters
from support import inprocess
from test_cli import interp_run

TINY = ("+experiment=steering_smoke", "model=tiny_random", "engine=eager")


def attrs_of(store) -> dict:
    return dict(zarr.open_group(str(store), mode="r").attrs)


@pytest.mark.engine
def test_multirun_reuses_the_engine_until_its_settings_change(tmp_path):
    sweep = tmp_path / "sweep"
    proc = inprocess.interp_run("-m", *TINY, "engine.max_num_seqs=8,16", "sampling.max_tokens=3,5",
                                f"hydra.sweep.dir={sweep}", engines=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = json.loads((sweep / "sweep.json").read_text())["jobs"]
    assert [j["num"] for j in jobs] == [0, 1, 2, 3] and {j["status"] for j in jobs} == {"complete"}
    engines = [attrs_of(sweep / j["store"])["engine"] for j in jobs]
    # jobs run in override order: (8, 3), (8, 5), (16, 3), (16, 5): one engine per max_num_seqs
    assert [e["builds_in_process"] for e in engines] == [1, 1, 2, 2]
    assert [e["reused"] for e in engines] == [False, True, False, True]
    assert proc.stdout.count("engine reused") == 2 and proc.stdout.count("engine started") == 2
    # the sweep's page links every job's report (written beside its store); two overrides differ: no plot
    index = (sweep / "index.html").read_text()
    for job in jobs:
        assert f'<a href="{job["num"]}/results.zarr.report.html">' in index
        assert (sweep / str(job["num"]) / "results.zarr.report.html").is_file()
    assert "<img" not in index and "no single parameter to plot against" in index

    ds = interp_runner.open_sweep(sweep)
    assert ds.sizes["job"] == 4 and list(ds["job_num"].values) == [0, 1, 2, 3]
    assert list(ds["engine.max_num_seqs"].values) == [8, 8, 16, 16]
    assert list(ds["sampling.max_tokens"].values) == [3, 5, 3, 5]
    assert ds["last"].dims[0] == "job" and ds["last"].shape[1:3] == (3, 2)
    generated = ds["num_generated"].values
    assert (generated[[0, 2]] == 3).all() and (generated[[1, 3]] == 5).all()
    # a reused engine gives what a fresh one gives
    np.testing.assert_array_equal(ds["tokens"].values[0], ds["tokens"].values[2])


@pytest.mark.engine
def test_a_causal_trace_sweep_on_one_engine_gives_what_fresh_engines_give(tmp_path):
    """The second job reuses the first's engine: the values its clean runs kept on the workers are freed for it,
    and its cells equal those of a run on an engine of its own."""
    trace = ("+experiment=causal_trace", "model=tiny_random", "engine=eager", "causal_trace.num_facts=1",
             "causal_trace.noise.samples=1", "causal_trace.window=2", "causal_trace.filter=false",
             "causal_trace.plots=false")
    sweep = tmp_path / "sweep"
    proc = inprocess.interp_run("-m", *trace, "causal_trace.noise.k=1,2", f"hydra.sweep.dir={sweep}", engines=None)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("engine reused") == 1
    alone = tmp_path / "alone.zarr"
    solo = inprocess.interp_run(*trace, "causal_trace.noise.k=2", f"store.path={alone}",
                                f"hydra.run.dir={tmp_path / 'solo'}", engines=None)
    assert solo.returncode == 0, solo.stderr[-3000:]
    reused, fresh = (zarr.open_group(str(p), mode="r") for p in (sweep / "1" / "results.zarr", alone))
    assert reused.attrs["engine"]["reused"] is True
    for name in ("restored_logprob_samples", "corrupt_logprob_samples", "clean_logit_diff"):
        np.testing.assert_array_equal(reused[name][...], fresh[name][...], err_msg=name)


@pytest.mark.engine
@pytest.mark.cli
def test_the_submitit_launcher_config_runs_a_sweep_locally(tmp_path):
    sweep = tmp_path / "sweep"
    proc = interp_run("-m", "hydra/launcher=local", *TINY, "sampling.max_tokens=2,3", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = json.loads((sweep / "sweep.json").read_text())["jobs"]
    assert [j["status"] for j in jobs] == ["complete", "complete"]
    for job in jobs:  # each job ran in its own process, so it built its own engine
        attrs = attrs_of(sweep / job["store"])
        assert attrs["status"] == "complete" and attrs["engine"]["builds_in_process"] == 1
    assert list(interp_runner.open_sweep(sweep)["sampling.max_tokens"].values) == [2, 3]


def test_launcher_configs_compose():
    from hydra import compose, initialize_config_dir

    import interp_runner.cli  # noqa: F401  registers the experiments_dir resolver

    targets = {}
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        for name in ("parallel", "slurm", "local"):
            cfg = compose(config_name="config", overrides=[f"hydra/launcher={name}"], return_hydra_config=True)
            targets[name] = cfg.hydra.launcher._target_
    assert targets["parallel"].endswith("JoblibLauncher")
    assert targets["slurm"].endswith("SlurmLauncher") and targets["local"].endswith("LocalLauncher")


def test_the_index_keeps_one_entry_per_job(tmp_path):
    record_job(tmp_path, 1, ["a=2", "b=x"], tmp_path / "1" / "results.zarr", "failed")
    record_job(tmp_path, 0, ["a=1", "b=x"], tmp_path / "0" / "results.zarr", "complete")
    record_job(tmp_path, 1, ["a=2", "b=x"], tmp_path / "1" / "results.zarr", "complete")  # a rerun of job 1
    jobs = json.loads((tmp_path / "sweep.json").read_text())["jobs"]
    assert [(j["num"], j["status"], j["store"]) for j in jobs] == [
        (0, "complete", "0/results.zarr"), (1, "complete", "1/results.zarr")]
    assert swept_parameters(jobs) == {"a": [1, 2]}  # b is the same everywhere


def test_engine_pool_rebuilds_with_the_union_of_sites():
    built = []

    class Engine:
        def __init__(self, path, cfg, spec):
            self.spec = spec
            built.append(spec)

        def supports(self, spec):
            return self.spec.covers(spec)

        def close(self):
            pass

    from interp_runner.config.schema import EngineConfig

    pool = EnginePool(Engine)
    cfg = EngineConfig()
    a, b = EngineSpec((1,), (2,)), EngineSpec((3,), (), (4,), 10)
    first = pool.get("m", cfg, a)
    assert pool.get("m", cfg, a) is first
    second = pool.get("m", cfg, b)  # needs sites the engine lacks: rebuilt with both
    assert second.spec == EngineSpec((1, 3), (2,), (4,), 10) and pool.get("m", cfg, a) is second
    pool.get("m", EngineConfig(max_num_seqs=8), a)  # other settings: rebuilt
    pool.get("other", EngineConfig(max_num_seqs=8), a)  # another model: rebuilt
    assert len(built) == 4 and (pool.builds, pool.runs) == (4, 6)
