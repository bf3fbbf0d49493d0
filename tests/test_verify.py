"""``interp-verify``: a store against itself and its rerun, perturbed and refused stores, provenance as information,
and the tolerance rules on small hand-made stores.

Two engine starts in all: the store (``interp-run`` on tiny_random) and its rerun (``interp-verify --rerun``).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import yaml
import zarr

from conftest import REPO
from interp_runner import verify
from interp_runner.verify import EXIT_ERROR, EXIT_MATCH, EXIT_MISMATCH, main

PERTURBED = (1, 1, 2, 0, 17)  # request, last_hook, last_layer, last_slot, hidden


def set_attrs(path: Path, **attrs) -> None:
    zarr.open_group(str(path), mode="r+").attrs.update(attrs)


def run_verify(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


# ------------------------------------------------------------------ a real store and its rerun


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("verify")
    path = tmp / "smoke.zarr"
    proc = subprocess.run(
        [str(REPO / ".venv" / "bin" / "interp-run"), "+experiment=steering_smoke", "model=tiny_random",
         "engine=eager", f"store.path={path}", f"hydra.run.dir={tmp / 'run'}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return path


@pytest.fixture(scope="module")
def rerun(store, tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("rerun")
    proc = subprocess.run(
        [sys.executable, "-m", "interp_runner.verify", str(store), "--rerun", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    return proc, out / "results.zarr"


def copy(store: Path, tmp_path: Path, name: str = "copy.zarr") -> Path:
    target = tmp_path / name
    shutil.copytree(store, target)
    return target


@pytest.mark.engine
def test_store_matches_itself(store, capsys):
    code, out, _ = run_verify(capsys, store, "--against", store)
    assert code == EXIT_MATCH, out
    assert "comparison: exact (both runs on CPU)" in out and "OK: all 23 arrays match" in out
    assert "provenance differences" not in out


@pytest.mark.engine
def test_rerun_reproduces_bit_for_bit(rerun, store, capsys):
    proc, new = rerun
    assert proc.returncode == EXIT_MATCH, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "OK: all 23 arrays match" in proc.stdout
    attrs = dict(zarr.open_group(str(new), mode="r").attrs)
    assert attrs["status"] == "complete" and "--rerun" in attrs["command"]
    # only where the store went differs in the config
    assert f"config.store.path: '{store}' -> '{new}'" in proc.stdout
    # and the rerun's store compares equal the other way round too
    code, out, _ = run_verify(capsys, new, "--against", store)
    assert code == EXIT_MATCH, out


@pytest.mark.engine
def test_perturbed_value_fails_and_names_the_array_and_index(store, tmp_path, capsys):
    perturbed = copy(store, tmp_path)
    last = zarr.open_group(str(perturbed), mode="r+")["last"]
    last[PERTURBED] = last[PERTURBED] + 0.5
    code, out, _ = run_verify(capsys, perturbed, "--against", store)
    assert code == EXIT_MISMATCH, out
    assert "MISMATCH: 1 of 23 arrays in both stores differ" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("last "))
    assert "request=1 ('r00001'), last_hook=1 ('post_block'), last_layer=2 (2), last_slot=0, hidden=17" in row
    assert " 0.5 " in row and "1 of 3072 elements differ" in row


@pytest.mark.engine
def test_missing_array_and_changed_token_fail(store, tmp_path, capsys):
    changed = copy(store, tmp_path)
    shutil.rmtree(changed / "text")
    tokens = zarr.open_group(str(changed), mode="r+")["tokens"]
    tokens[2, 3] = tokens[2, 3] + 1
    code, out, _ = run_verify(capsys, changed, "--against", store)
    assert code == EXIT_MISMATCH, out
    assert "1 in only one store" in out
    assert any(line.split()[:1] == ["text"] and "missing from copy.zarr" in line for line in out.splitlines())
    row = next(line for line in out.splitlines() if line.strip().startswith("tokens "))
    assert "request=2 ('r00002'), generated=3" in row and "exact" in row


@pytest.mark.engine
def test_unfinished_store_is_refused(store, tmp_path, capsys, monkeypatch):
    failed = copy(store, tmp_path)
    set_attrs(failed, status="failed", error="RuntimeError: boom")
    monkeypatch.setattr("interp_runner.pipeline.run", lambda *a, **k: pytest.fail("the rerun must not start"))
    code, _, err = run_verify(capsys, failed, "--rerun", "--out", tmp_path / "out")
    assert code == EXIT_ERROR
    assert "status is 'failed', not 'complete': RuntimeError: boom" in err
    code, _, err = run_verify(capsys, store, "--against", failed)
    assert code == EXIT_ERROR and "status is 'failed'" in err


@pytest.mark.engine
def test_other_model_weights_are_refused_before_running(store, tmp_path, capsys, monkeypatch):
    other = copy(store, tmp_path)
    model = dict(zarr.open_group(str(other), mode="r").attrs["model"])
    set_attrs(other, model={**model, "weights_sha256": "0" * 64})
    monkeypatch.setattr("interp_runner.pipeline.run", lambda *a, **k: pytest.fail("the rerun must not start"))
    code, _, err = run_verify(capsys, other, "--rerun", "--out", tmp_path / "out")
    assert code == EXIT_ERROR
    assert f"weights sha256 {'0' * 64}" in err and model["weights_sha256"] in err


@pytest.mark.engine
def test_provenance_differences_are_shown_but_do_not_fail(store, tmp_path, capsys):
    moved = copy(store, tmp_path)
    attrs = dict(zarr.open_group(str(moved), mode="r").attrs)
    set_attrs(
        moved,
        versions={**attrs["versions"], "torch": "9.9.9"},
        host={**attrs["host"], "hostname": "elsewhere"},
        package={**attrs["package"], "git_sha": "f" * 40},
        plugin={**attrs["plugin"], "fingerprint": "0123456789abcdef"},
        requests_sha256="1" * 64,
    )
    code, out, _ = run_verify(capsys, moved, "--against", store)
    assert code == EXIT_MATCH, out
    for line in ("versions.torch: '2.11.0' -> '9.9.9'", "host.hostname:", "'elsewhere'",
                 f"package.git_sha: {attrs['package']['git_sha']!r} -> '{'f' * 40}'",
                 "plugin.fingerprint:", "requests_sha256:"):
        assert line in out
    assert "OK: all 23 arrays match" in out


def test_rerun_reads_experiment_data_from_this_checkout(tmp_path):
    """A store made in another checkout (a golden store in CI) reruns with this checkout's experiments/ folder."""
    from interp_runner.provenance import EXPERIMENTS_DIR

    elsewhere = copy(REPO / "experiments" / "golden" / "causal_trace.zarr", tmp_path)
    attrs = dict(zarr.open_group(str(elsewhere), mode="r").attrs)
    set_attrs(elsewhere, experiments_dir="/elsewhere/experiments",
              config_yaml=attrs["config_yaml"].replace(attrs["experiments_dir"], "/elsewhere/experiments"))
    logged = []
    config = verify.rerun_config(verify.open_store(elsewhere), tmp_path / "new.zarr", logged.append)
    assert config["causal_trace"]["facts"] == str(EXPERIMENTS_DIR / "causal_trace" / "facts.jsonl")
    assert config["store"]["path"] == str(tmp_path / "new.zarr")
    assert logged == [f"paths under /elsewhere/experiments read from {EXPERIMENTS_DIR}"]


def test_usage_errors_exit_2(tmp_path, capsys):
    assert main([]) == EXIT_ERROR
    assert main([str(tmp_path / "x.zarr")]) == EXIT_ERROR  # neither --against nor --rerun
    code, _, err = run_verify(capsys, tmp_path / "missing.zarr", "--against", tmp_path / "other.zarr")
    assert code == EXIT_ERROR and "not a readable zarr store" in err


# ------------------------------------------------------------------ tolerance rules on hand-made stores


def make_store(path: Path, values: dict, gpus=(), batch_invariant=False, noise_floor=None, dtype="bfloat16") -> Path:
    ds = xr.Dataset({name: (("request", "x")[: np.ndim(v)], np.asarray(v)) for name, v in values.items()})
    ds.to_zarr(str(path), mode="w", zarr_format=3, consolidated=False)
    attrs = {
        "status": "complete",
        "config_yaml": yaml.safe_dump({"engine": {"batch_invariant": batch_invariant}}),
        "host": {"hostname": "h", "gpus": list(gpus)},
        "engine": {"dtype": dtype},
    }
    if noise_floor is not None:
        attrs["noise_floor"] = noise_floor
    set_attrs(path, **attrs)
    return path


BASE = {
    "answer_prob": np.array([0.5, 0.25], np.float32),
    "indirect_effect": np.array([0.1, -0.2], np.float32),
    "logprob": np.array([[-1.0, -2.0], [-3.0, np.nan]], np.float32),
    "tokens": np.array([[1, 2], [3, 4]], np.int32),
}
GPU = ("NVIDIA H100 80GB HBM3",)


def pair(tmp_path, changes: dict, **kwargs) -> tuple[Path, Path]:
    ref = make_store(tmp_path / "ref.zarr", BASE, **kwargs)
    new = make_store(tmp_path / "new.zarr", {**BASE, **changes}, **kwargs)
    return new, ref


def test_gpu_without_batch_invariance_tolerates_noise_floor(tmp_path, capsys):
    new, ref = pair(tmp_path, {"answer_prob": np.array([0.5 + 8e-4, 0.25], np.float32),
                               "indirect_effect": np.array([0.1 - 1.5e-3, -0.2], np.float32)},
                    gpus=GPU, noise_floor=1e-3)
    code, out, _ = run_verify(capsys, new, "--against", ref)
    assert code == EXIT_MATCH, out
    assert "tolerant (GPU runs without engine.batch_invariant)" in out and "within tolerance:" in out
    # beyond the noise floor: a mismatch
    new, ref = pair(tmp_path, {"answer_prob": np.array([0.5 + 3e-3, 0.25], np.float32)}, gpus=GPU, noise_floor=1e-3)
    code, out, _ = run_verify(capsys, new, "--against", ref)
    assert code == EXIT_MISMATCH and "answer_prob" in out and "0.001 (1 x noise floor)" in out


def test_gpu_tolerance_of_other_floats_scales_with_the_array(tmp_path, capsys):
    # bfloat16: rtol 5e-2 of the largest |logprob| (3.0)
    new, ref = pair(tmp_path, {"logprob": np.array([[-1.1, -2.0], [-3.0, np.nan]], np.float32)}, gpus=GPU)
    assert run_verify(capsys, new, "--against", ref)[0] == EXIT_MATCH
    new, ref = pair(tmp_path, {"logprob": np.array([[-1.2, -2.0], [-3.0, np.nan]], np.float32)}, gpus=GPU)
    code, out, _ = run_verify(capsys, new, "--against", ref)
    assert code == EXIT_MISMATCH and "request=0, x=0" in out


def test_gpu_integers_and_nan_positions_stay_exact(tmp_path, capsys):
    new, ref = pair(tmp_path, {"tokens": np.array([[1, 2], [3, 5]], np.int32)}, gpus=GPU, noise_floor=1.0)
    assert run_verify(capsys, new, "--against", ref)[0] == EXIT_MISMATCH
    new, ref = pair(tmp_path, {"logprob": np.array([[-1.0, -2.0], [-3.0, -4.0]], np.float32)}, gpus=GPU)
    code, out, _ = run_verify(capsys, new, "--against", ref)
    assert code == EXIT_MISMATCH
    row = next(line for line in out.splitlines() if line.strip().startswith("logprob "))
    assert "inf" in row and "request=1, x=1" in row and "nan -> -4" in row


def test_batch_invariant_gpu_runs_compare_exactly(tmp_path, capsys):
    changes = {"answer_prob": np.array([0.5 + 1e-7, 0.25], np.float32)}
    new, ref = pair(tmp_path, changes, gpus=GPU, batch_invariant=True, noise_floor=1e-3)
    code, out, _ = run_verify(capsys, new, "--against", ref)
    assert code == EXIT_MISMATCH and "exact (batch-invariant runs on NVIDIA H100 80GB HBM3)" in out
    new, ref = pair(tmp_path, changes, gpus=GPU, noise_floor=1e-3)
    assert run_verify(capsys, new, "--against", ref)[0] == EXIT_MATCH
    assert run_verify(capsys, new, "--against", ref, "--exact")[0] == EXIT_MISMATCH


def test_cpu_runs_compare_exactly(tmp_path, capsys):
    new, ref = pair(tmp_path, {"logprob": np.array([[-1.0, np.nextafter(np.float32(-2), 0)], [-3.0, np.nan]],
                                                   np.float32)})
    code, out, _ = run_verify(capsys, new, "--against", ref)
    assert code == EXIT_MISMATCH and "comparison: exact (both runs on CPU)" in out and "request=0, x=1" in out


def test_value_kinds():
    assert verify.value_kind("answer_prob") == verify.value_kind("restored_prob") == "probability"
    assert verify.value_kind("indirect_effect") == verify.value_kind("avg_indirect_effect") == "probability difference"
    for name in ("logprob", "answer_logprob", "restored_logprob_samples", "logit_diff", "recovered", "last"):
        assert verify.value_kind(name) == "other"


# ------------------------------------------------------------------ the engine option


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CPU behaviour")
def test_batch_invariant_is_refused_on_cpu(tiny_path):
    """A config error (the CLI exits 2) before vLLM is even imported."""
    from interp_runner.config import ConfigError
    from interp_runner.config.schema import EngineConfig
    from interp_runner.engine import VllmEngine
    from interp_runner.payload import EngineSpec

    with pytest.raises(ConfigError) as err:
        VllmEngine(str(tiny_path), EngineConfig(batch_invariant=True), EngineSpec((), (), (), 0))
    (path, reason), = err.value.problems
    assert path == "engine.batch_invariant" and "needs a GPU" in reason


def test_batch_invariant_mode_cannot_change_within_a_process(monkeypatch):
    from interp_runner import engine

    monkeypatch.setattr(engine, "on_gpu", lambda: True)
    monkeypatch.setattr(engine, "_batch_invariant_in_process", None)
    monkeypatch.setenv(engine.BATCH_INVARIANT_ENV, "1")  # the config decides, not the environment
    engine.set_batch_invariant(False)
    assert engine.os.environ[engine.BATCH_INVARIANT_ENV] == "0"
    with pytest.raises(engine.EngineError, match="cannot switch the mode within a process"):
        engine.set_batch_invariant(True)
