"""``interp-verify`` on arrays derived from others (a kind's ``verify_rules``): a threshold flag may flip only beside
its threshold, a mean or difference is allowed the summed tolerance of its sources, and a change beyond tolerance
still fails; CPU runs on one kernel path stay exact. Hand-made stores of the causal_trace and steering_vectors
kinds (no engine); the expected tolerances are computed by hand in each test from ``rules``' tables.

Also: stores whose arrays zarr cannot load give ``interp-verify`` and ``interp-report`` one clean line and exit 2.
The GPU test reruns the golden stores on the GPU (``@pytest.mark.gpu``).
"""

from __future__ import annotations

import json
import os
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
from interp_runner.verify import EXIT_ERROR, EXIT_MATCH, EXIT_MISMATCH, main
from support.inprocess import interp_report, interp_verify

GPU = ["NVIDIA H100 80GB HBM3"]
CPU = {"model": "Some CPU", "vendor": "GenuineIntel", "arch": "x86_64", "isa": ["avx2", "fma"], "aten": "AVX2",
       "vllm_kernels": "avx2", "threads": 8, "env": {}}
GOLDEN = REPO / "experiments" / "golden"


def write_store(path: Path, kind: str, arrays: dict, gpus=(), cpu=CPU, **attrs) -> Path:
    """A complete float32 store of ``kind`` (its manifest's ``kind``): arrays as name -> (dims, values)."""
    xr.Dataset(arrays).to_zarr(str(path), mode="w", zarr_format=3, consolidated=False)
    zarr.open_group(str(path), mode="r+").attrs.update({
        "status": "complete", "kind": kind, "config_yaml": yaml.safe_dump({"engine": {"batch_invariant": False}}),
        "host": {"hostname": "h", "gpus": list(gpus), "cpu": cpu}, "versions": {"torch": "2.11.0", "vllm": "0.26.0"},
        "engine": {"dtype": "float32"}, **attrs,
    })
    return path


def verify(capsys, new: Path, ref: Path) -> tuple[int, str]:
    code = main([str(new), "--against", str(ref)])
    return code, capsys.readouterr().out


def row(out: str, name: str) -> str:
    return next(line for line in out.splitlines() if line.strip().split()[:1] == [name])


# ------------------------------------------------------------------ causal tracing: above_noise_floor, recovered

GRID = ("fact", "token")
FLOOR = 1e-3  # GPU runs without batch invariance: probability differences within 2 x noise floor = 2e-3
EFFECT = np.array([[0.0015, 0.05, -0.0009, 0.2]], np.float32)  # indirect_effect, one fact


def trace(path: Path, effect, flag=None, noise_floor=FLOOR, **kwargs) -> Path:
    effect = np.asarray(effect, np.float32)
    flag = np.abs(effect) > noise_floor if flag is None else np.asarray(flag)
    return write_store(path, "causal_trace", {"indirect_effect": (GRID, effect), "above_noise_floor": (GRID, flag)},
                       noise_floor=noise_floor, **kwargs)


def test_a_flag_flipping_beside_its_threshold_passes(tmp_path, capsys):
    """0.0015 -> 0.0008 moves the effect by 7e-4 (within 2e-3) across the floor 1e-3: the flag flips, as it may."""
    ref = trace(tmp_path / "ref.zarr", EFFECT, gpus=GPU)
    moved = EFFECT.copy()
    moved[0, 0] = 0.0008
    new = trace(tmp_path / "new.zarr", moved, gpus=GPU)
    assert not np.array_equal(*(xr.open_zarr(str(p), consolidated=False)["above_noise_floor"] for p in (new, ref)))
    code, out = verify(capsys, new, ref)
    assert code == EXIT_MATCH, out
    flag = row(out.split("within tolerance:")[1], "above_noise_floor")
    assert "1 of 4 elements flip, each beside the threshold (noise_floor 0.001 -> 0.001)" in flag
    assert "flips where |indirect_effect| is within 0.002 of noise_floor" in flag


def test_a_flag_flipping_far_from_its_threshold_fails(tmp_path, capsys):
    """The flag of an effect of 0.05 (50 x the floor) flips while the effect itself matches: a real change."""
    ref = trace(tmp_path / "ref.zarr", EFFECT, gpus=GPU)
    flag = np.abs(EFFECT) > FLOOR
    flag[0, 1] = False
    new = trace(tmp_path / "new.zarr", EFFECT, flag=flag, gpus=GPU)
    code, out = verify(capsys, new, ref)
    assert code == EXIT_MISMATCH, out
    line = row(out.split("MISMATCH")[1], "above_noise_floor")
    assert "1 of 4 elements flip, |indirect_effect| away from the threshold" in line and "token=1" in line
    assert "True (indirect_effect 0.0500000007) -> False (indirect_effect 0.0500000007)" in line


def test_a_source_change_beyond_tolerance_still_fails(tmp_path, capsys):
    """The effect 0.0015 -> 0.0045 moves by 3e-3 > 2e-3: its flag does not flip, the effect itself fails."""
    ref = trace(tmp_path / "ref.zarr", EFFECT, gpus=GPU)
    moved = EFFECT.copy()
    moved[0, 0] = 0.0045
    code, out = verify(capsys, trace(tmp_path / "new.zarr", moved, gpus=GPU), ref)
    assert code == EXIT_MISMATCH, out
    assert "beyond tolerance" in row(out.split("MISMATCH")[1], "indirect_effect")
    # a flip beside the threshold whose source moved beyond its tolerance there fails as well
    moved[0, 0], moved[0, 2] = 0.0008, -0.0045  # 0.0015 -> 0.0008 flips; -0.0009 -> -0.0045 flips too, 3.6e-3 away
    code, out = verify(capsys, trace(tmp_path / "new2.zarr", moved, gpus=GPU), ref)
    assert code == EXIT_MISMATCH, out
    flag = row(out.split("MISMATCH")[1], "above_noise_floor")
    assert "1 of 4 elements flip, |indirect_effect| away from the threshold" in flag and "token=2" in flag


def test_a_flag_whose_threshold_moved_beyond_its_tolerance_fails(tmp_path, capsys):
    """CPU runs on other kernel paths (float32: rtol 1e-4 x its scale, 2e-3): the noise floor may move by 2e-7;
    1e-3 -> 2e-3 is a real change, even where the flipped cell (0.0015) lies beside both floors."""
    other = {**CPU, "threads": 16}
    ref = trace(tmp_path / "ref.zarr", EFFECT)
    new = trace(tmp_path / "new.zarr", EFFECT, noise_floor=2e-3, cpu=other)
    code, out = verify(capsys, new, ref)
    assert code == EXIT_MISMATCH, out
    assert "the threshold moved beyond its tolerance" in row(out.split("MISMATCH")[1], "above_noise_floor")


def test_cpu_runs_on_one_kernel_path_compare_flags_exactly(tmp_path, capsys):
    ref = trace(tmp_path / "ref.zarr", EFFECT)
    moved = EFFECT.copy()
    moved[0, 0] = np.nextafter(np.float32(FLOOR), np.float32(0))  # a hair below the floor: the flag flips
    code, out = verify(capsys, trace(tmp_path / "new.zarr", moved), ref)
    assert code == EXIT_MISMATCH and "comparison: exact (same kernel path" in out, out
    line = row(out.split("MISMATCH")[1], "above_noise_floor")
    assert "1 of 4 elements differ" in line and "exact" in line


def test_a_ratio_is_allowed_what_its_sources_make_of_it(tmp_path, capsys):
    """recovered = indirect_effect / total_effect on a GPU (noise floor 1e-3: both sources within 2e-3). At
    0.05 / 0.1 that allows 2e-3 / 0.1 + 0.05 x 2e-3 / 0.1^2 = 0.03, where recovered's own rule (1e-3 x 0.5) allows
    5e-4: a move of 0.01 passes, one of 0.05 fails."""
    effect, total = np.array([[0.05, 0.02]], np.float32), np.array([0.1], np.float32)

    def store(path: Path, shift: float) -> Path:
        recovered = effect / total[:, None] + np.array([[shift, 0.0]], np.float32)
        arrays = {"indirect_effect": (GRID, effect), "total_effect": (("fact",), total), "recovered": (GRID, recovered)}
        return write_store(path, "causal_trace", arrays, gpus=GPU, noise_floor=FLOOR)

    ref = store(tmp_path / "ref.zarr", 0.0)
    code, out = verify(capsys, store(tmp_path / "near.zarr", 0.01), ref)
    assert code == EXIT_MATCH, out
    line = row(out.split("within tolerance:")[1], "recovered")
    assert "0.0005 (rtol 0.001 (GPU float32) x scale), or what indirect_effect / total_effect allow, up to 0.03" in line
    code, out = verify(capsys, store(tmp_path / "far.zarr", 0.05), ref)
    assert code == EXIT_MISMATCH, out
    line = row(out.split("MISMATCH")[1], "recovered")
    assert "1 of 2 elements beyond tolerance" in line and "0.03 there" in line and "fact=0, token=0" in line


# ------------------------------------------------------------------ means and differences: steering_vectors' effects

# (prompt, layer, scale): large logit differences, small effects, a smaller mean (0.05 at most)
STEERED = np.array([[[8.0, 7.8], [7.95, 7.9]], [[7.9, 8.0], [7.85, 7.9]]], np.float32)
BASELINE = np.array([7.9, 7.9], np.float32)  # (prompt,)


def vectors(path: Path, steered=STEERED, baseline=BASELINE, mean_shift=0.0, **kwargs) -> Path:
    effect = steered - baseline[:, None, None]
    mean = effect.mean(axis=0) + np.float32(mean_shift)
    return write_store(path, "steering_vectors", {
        "steered_logit_diff": (("prompt", "layer", "scale"), steered),
        "baseline_logit_diff": (("prompt",), baseline),
        "effect": (("prompt", "layer", "scale"), effect),
        "mean_effect": (("layer", "scale"), mean.astype(np.float32)),
    }, **kwargs)


def test_a_mean_of_differences_is_allowed_its_sources_tolerance(tmp_path, capsys):
    """GPU float32: rtol 1e-3 of each array's largest |value|. mean_effect's own scale (0.05) would allow 5e-5;
    the effect it averages allows what its sources do, 1e-3 x 8 (steered) + 1e-3 x 7.9 (baseline) = 0.0159. A move
    of 1e-3 of the mean passes; one of 0.02 fails."""
    ref = vectors(tmp_path / "ref.zarr", gpus=GPU)
    code, out = verify(capsys, vectors(tmp_path / "new.zarr", mean_shift=1e-3, gpus=GPU), ref)
    assert code == EXIT_MATCH, out
    line = row(out.split("within tolerance:")[1], "mean_effect")
    assert "0.0159 (sum of its sources': effect)" in line
    code, out = verify(capsys, vectors(tmp_path / "far.zarr", mean_shift=0.02, gpus=GPU), ref)
    assert code == EXIT_MISMATCH, out
    assert "beyond tolerance" in row(out.split("MISMATCH")[1], "mean_effect")


def test_a_source_of_a_difference_beyond_its_tolerance_still_fails(tmp_path, capsys):
    """steered 8.0 -> 8.012 (beyond 1e-3 x 8 = 0.008): steered fails; the effect and its mean, recomputed from it,
    move by 0.012 and 0.006, within their summed tolerance 0.0159."""
    ref = vectors(tmp_path / "ref.zarr", gpus=GPU)
    steered = STEERED.copy()
    steered[0, 0, 0] = 8.012
    code, out = verify(capsys, vectors(tmp_path / "new.zarr", steered=steered, gpus=GPU), ref)
    assert code == EXIT_MISMATCH, out
    mismatched = out.split("MISMATCH")[1]
    assert "MISMATCH: 1 of 4 arrays" in out and "beyond tolerance" in row(mismatched, "steered_logit_diff")
    assert "0.0159 (sum of its sources': steered_logit_diff + baseline_logit_diff)" in row(out, "effect")


def test_derived_arrays_stay_exact_on_one_cpu_kernel_path(tmp_path, capsys):
    ref = vectors(tmp_path / "ref.zarr")
    code, out = verify(capsys, vectors(tmp_path / "new.zarr", mean_shift=1e-6), ref)
    assert code == EXIT_MISMATCH and "exact" in row(out.split("MISMATCH")[1], "mean_effect"), out


# ------------------------------------------------------------------ arrays zarr cannot load


def with_unknown_codec(store: Path, arrays=None) -> None:
    """Name ``numcodecs.pickle`` (no codec of zarr's) as the compressor of the given arrays (default: all)."""
    for meta in sorted(store.glob("*/zarr.json")):
        if arrays is not None and meta.parent.name not in arrays:
            continue
        node = json.loads(meta.read_text())
        node["codecs"] = [c if c["name"] in ("bytes", "vlen-utf8") else
                          {"name": "numcodecs.pickle", "configuration": {"protocol": 5}} for c in node["codecs"]]
        meta.write_text(json.dumps(node))


def run_tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("arrays", [None, ["mean_effect"]], ids=["every array", "one array"])
def test_an_unknown_codec_is_one_clean_error_of_both_tools(tmp_path, arrays):
    store = tmp_path / "pickled.zarr"
    shutil.copytree(GOLDEN / "steering_vectors.zarr", store)
    with_unknown_codec(store, arrays)
    # the first unloadable array, by name
    first = min(arrays or (m.parent.name for m in store.glob("*/zarr.json")))
    expected = f"{store}: array {first!r} cannot be read (UnknownCodecError: Unknown codec: 'numcodecs.pickle')"
    # each tool's main in this process (``support.inprocess``): its exit status and what it prints
    calls = {
        "interp-verify": (interp_verify, store, "--against", GOLDEN / "steering_vectors.zarr"),
        "interp-verify (as the reference)": (interp_verify, GOLDEN / "steering_vectors.zarr", "--against", store),
        "interp-verify --rerun": (interp_verify, store, "--rerun", "--out", tmp_path / "out"),
        "interp-report": (interp_report, store),
    }
    for what, (tool_main, *args) in calls.items():
        proc = tool_main(*args)
        tool = "interp-report" if what == "interp-report" else "interp-verify"
        assert proc.returncode == EXIT_ERROR, (what, proc.stderr[-2000:])
        assert proc.stderr.splitlines() == [f"{tool}: error: {expected}"], (what, proc.stderr[-2000:])
        assert proc.stdout == "", what
    assert not (tmp_path / "out").exists()  # refused before any rerun
    assert not Path(f"{store}.report.html").exists()  # the report beside it (StoreTarget.report)


# ------------------------------------------------------------------ the CPU golden stores rerun on a GPU


def rerun_on_gpu(store: Path, out: Path) -> subprocess.CompletedProcess:
    proc = run_tool("-m", "interp_runner.verify", store, "--rerun", "--out", out)
    print(proc.stdout[-6000:], proc.stderr[-3000:])  # the comparison, in the test's log
    return proc


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["steering_smoke", "causal_trace", "steering_vectors"])
def test_a_gpu_rerun_of_each_cpu_golden_passes(tmp_path, name):
    """``make verify`` on a GPU: each golden store (made on a CPU) rerun from its provenance matches within the
    tolerances of a run on another device."""
    proc = rerun_on_gpu(GOLDEN / f"{name}.zarr", tmp_path / "out")
    assert proc.returncode == EXIT_MATCH, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "comparison: tolerant (one run on GPU, one on CPU)" in proc.stdout
    assert zarr.open_group(str(tmp_path / "out" / "results.zarr"), mode="r").attrs["host"]["gpus"]


@pytest.mark.gpu
def test_a_gpu_rerun_still_fails_on_a_real_change(tmp_path):
    """Two real changes to the steering_vectors golden, each caught by a GPU rerun: its recorded config steers at
    scale 2 instead of 1 (the rerun's steered logit differences move beyond tolerance), and a copy whose
    mean_effect was moved by 0.5 (30 x its summed tolerance on a GPU, about 0.016)."""
    rescaled = tmp_path / "rescaled.zarr"
    shutil.copytree(GOLDEN / "steering_vectors.zarr", rescaled)
    group = zarr.open_group(str(rescaled), mode="r+")
    config = yaml.safe_load(group.attrs["config_yaml"])
    config["steering_vectors"]["eval"]["scales"] = [-1.0, -0.5, 0.5, 2.0]
    group.attrs["config_yaml"] = yaml.safe_dump(config, sort_keys=True)
    proc = rerun_on_gpu(rescaled, tmp_path / "out-rescaled")
    assert proc.returncode == EXIT_MISMATCH, proc.stdout[-6000:] + proc.stderr[-3000:]
    mismatched = proc.stdout.split("MISMATCH")[1]
    assert "beyond tolerance" in row(mismatched, "steered_logit_diff") and "scale=3" in row(mismatched,
                                                                                              "steered_logit_diff")
    moved = tmp_path / "moved.zarr"
    shutil.copytree(GOLDEN / "steering_vectors.zarr", moved)
    mean = zarr.open_group(str(moved), mode="r+")["mean_effect"]
    mean[1, 2] = mean[1, 2] + 0.5
    proc = rerun_on_gpu(moved, tmp_path / "out-moved")
    assert proc.returncode == EXIT_MISMATCH, proc.stdout[-6000:] + proc.stderr[-3000:]
    line = row(proc.stdout.split("MISMATCH")[1], "mean_effect")
    assert "1 of 16 elements beyond tolerance" in line and "layer=1" in line and "sum of its sources'" in line
    assert "MISMATCH: 1 of" in proc.stdout  # nothing else
