"""The CLI end to end on tiny_random: store layout, provenance, status; the first two as real processes, the
causal trace through ``main`` in this process on a shared engine (``support.inprocess``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import zarr

from conftest import REPO
from support import inprocess
from support.smoke_process import smoke_process

pytestmark = pytest.mark.engine

MANIFEST_KEYS = {
    "config_yaml", "config_sha256", "command", "overrides", "experiment", "package", "versions", "model",
    "seeds", "requests_sha256", "plugin", "host", "started_at", "finished_at", "status", "engine", "run_key",
}


def interp_run(*args, cwd=REPO):
    """``interp-run ARGS`` as a process of its own."""
    cli = REPO / ".venv" / "bin" / "interp-run"
    return subprocess.run([str(cli), *args], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.cli
def test_cli_run_writes_a_complete_store(tmp_path_factory):
    """``interp-run +experiment=steering_smoke`` as a process of its own (the session's one, shared with
    tests/test_run_log.py: ``support.smoke_process``)."""
    smoke = smoke_process(tmp_path_factory)
    proc, store, folder = smoke.proc, smoke.store, smoke.folder
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the store and its report, each said once
    assert proc.stdout.count(f"store: {store}") == 1, proc.stdout
    assert proc.stdout.count(f"report: {folder / 'smoke.zarr.report.html'}") == 1, proc.stdout
    assert (folder / "smoke.zarr.report.html").is_file()

    ds = xr.open_zarr(str(store), consolidated=False)
    attrs = dict(zarr.open_group(str(store), mode="r").attrs)
    assert attrs["status"] == "complete"
    assert MANIFEST_KEYS <= set(attrs)
    assert attrs["model"]["weights_sha256"] and attrs["package"]["git_sha"] is not None
    assert {"vllm", "torch", "transformers", "zarr"} <= set(attrs["versions"])
    assert attrs["overrides"][0] == "+experiment=steering_smoke"
    assert attrs["experiment"] == {"name": "steering_smoke", "version": 1}

    assert ds.sizes["request"] == 3
    assert ds["last"].dims == ("request", "last_hook", "last_layer", "last_slot", "hidden")
    assert list(ds["last_hook"].values) == ["pre_attn", "post_block"]
    assert ds["last"].shape == (3, 2, 4, 1, 128)
    assert (ds["last_position"].values[:, 0] == ds["prompt_len"].values - 1).all()
    assert np.isfinite(ds["last"].values).all()
    # generated positions: num_generated - 1 of them (the last token is never fed back), NaN padded
    gen = ds["gen"].values
    for i, n in enumerate(ds["num_generated"].values):
        positions = ds["gen_position"].values[i]
        assert (positions >= 0).sum() == n - 1
        assert np.isfinite(gen[i, :, :, : n - 1]).all() and np.isnan(gen[i, :, :, n - 1 :]).all()
    assert ds["gen"].attrs["stored_dtype"] == "float16"
    assert isinstance(ds["text"].values[0], str) and ds["tokens"].dtype == np.int32
    assert ds["top_logprob"].shape[-1] == 3


@pytest.mark.cli
def test_cli_config_error_exits_2_and_starts_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = interp_run("+experiment=steering_smoke", "model=tiny_random", "capture.0.layers=[9]",
                      f"hydra.run.dir={run_dir}")
    assert proc.returncode == 2
    assert "capture[0].layers[0]: 9 out of range, model has 4 layers" in proc.stderr
    assert not (run_dir / "results.zarr").exists()


def test_cli_causal_trace_writes_grids_and_figures(tmp_path):
    store = tmp_path / "trace.zarr"
    proc = inprocess.interp_run(
        "+experiment=causal_trace", "model=tiny_random", "engine=eager", "causal_trace.num_facts=2",
        "causal_trace.noise.samples=2", "causal_trace.window=2", "causal_trace.layers=[0,3]",
        "causal_trace.filter=false",  # a random model predicts none of the answers
        f"store.path={store}", f"hydra.run.dir={tmp_path / 'run'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stage 1:" in proc.stdout and f"store: {store}" in proc.stdout
    ds = xr.open_zarr(str(store), consolidated=False)
    attrs = dict(zarr.open_group(str(store), mode="r").attrs)
    assert attrs["status"] == "complete" and attrs["experiment"]["name"] == "causal_trace"
    assert ds["indirect_effect"].dims == ("fact", "component", "layer", "token")
    assert ds["indirect_effect"].shape[:3] == (2, 3, 2) and list(ds["layer"].values) == [0, 3]
    for f, n in enumerate(ds["num_tokens"].values):
        assert np.isfinite(ds["restored_prob"].values[f, :, :, :n]).all()
        assert np.isnan(ds["restored_prob"].values[f, :, :, n:]).all()
    assert ds["restored_logprob_samples"].sizes["sample"] == 2
    figures = [Path(p) for p in attrs["figures"]]
    assert len(figures) == 2 * 3 + 1 and all(p.exists() and p.stat().st_size > 0 for p in figures)
