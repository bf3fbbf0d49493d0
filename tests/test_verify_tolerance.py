"""``interp-verify``'s tolerance rules on small hand-made stores: GPU runs within their noise floor or exact under batch
invariance, CPU runs exact on one kernel path and within measured tolerance across paths, probabilities and their
differences, reduced-precision storage, top-k ids as sets, teacher-forced tokens that must stay greedy. No engine
starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import xarray as xr
import yaml
import zarr

from interp_runner import verify
from interp_runner.verify import EXIT_MATCH, EXIT_MISMATCH, main


def set_attrs(path: Path, **attrs) -> None:
    zarr.open_group(str(path), mode="r+").attrs.update(attrs)


def run_verify(capsys, *args) -> tuple[int, str, str]:
    """interp-verify's exit status, stdout and stderr (no rerun: it runs in this process)."""
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


CPU = {"model": "Some CPU", "vendor": "GenuineIntel", "arch": "x86_64", "isa": ["avx2", "fma"], "aten": "AVX2",
       "vllm_kernels": "avx2", "threads": 8, "env": {}}
AVX512_BF16 = {**CPU, "isa": ["avx2", "avx512_bf16", "avx512f", "fma"], "aten": "AVX512", "vllm_kernels": "avx512_bf16"}
DIMS = ("request", "x", "top_k")


def make_store(path: Path, values: dict, gpus=(), batch_invariant=False, noise_floor=None, dtype="bfloat16",
               cpu=CPU, config=None) -> Path:
    ds = xr.Dataset({name: (DIMS[: np.ndim(v)], np.asarray(v)) for name, v in values.items()})
    ds.to_zarr(str(path), mode="w", zarr_format=3, consolidated=False)
    attrs = {
        "status": "complete",
        "config_yaml": yaml.safe_dump({"engine": {"batch_invariant": batch_invariant}, **(config or {})}),
        "host": {"hostname": "h", "gpus": list(gpus), "cpu": cpu},
        "versions": {"torch": "2.11.0", "vllm": "0.26.0"},
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


def pair(tmp_path, changes: dict, new_kwargs: dict | None = None, base: dict = BASE, **kwargs) -> tuple[Path, Path]:
    ref = make_store(tmp_path / "ref.zarr", base, **kwargs)
    new = make_store(tmp_path / "new.zarr", {**base, **changes}, **{**kwargs, **(new_kwargs or {})})
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
    assert code == EXIT_MISMATCH and "exact (batch-invariant runs, same kernel path: NVIDIA H100 80GB HBM3" in out
    new, ref = pair(tmp_path, changes, gpus=GPU, noise_floor=1e-3)
    assert run_verify(capsys, new, "--against", ref)[0] == EXIT_MATCH
    assert run_verify(capsys, new, "--against", ref, "--exact")[0] == EXIT_MISMATCH


def test_cpu_runs_on_one_kernel_path_compare_exactly(tmp_path, capsys):
    new, ref = pair(tmp_path, {"logprob": np.array([[-1.0, np.nextafter(np.float32(-2), 0)], [-3.0, np.nan]],
                                                   np.float32)}, dtype="float32")
    code, out, _ = run_verify(capsys, new, "--against", ref)
    assert code == EXIT_MISMATCH and "request=0, x=1" in out
    assert ("comparison: exact (same kernel path: CPU Some CPU (x86_64; avx2/fma; ATen AVX2; vLLM avx2 kernels; "
            "8 threads), float32, torch 2.11.0, vLLM 0.26.0)") in out


@pytest.mark.parametrize("what, new_kwargs, reason", [
    ("ISA", {"cpu": AVX512_BF16}, "cpu.aten: 'AVX2' -> 'AVX512'; cpu.isa: ['avx2', 'fma'] -> ['avx2', 'avx512_bf16', "
                                  "'avx512f', 'fma']; cpu.vllm_kernels: 'avx2' -> 'avx512_bf16'"),
    ("threads", {"cpu": {**CPU, "threads": 16}}, "cpu.threads: 8 -> 16"),
    ("old store", {"cpu": "x86_64"}, "the compared run records no CPU kernel path"),
])
def test_cpu_runs_on_other_kernel_paths_compare_within_measured_tolerance(tmp_path, capsys, what, new_kwargs,
                                                                          reason):
    # float32 on a CPU: rtol 1e-4 of the largest |logprob| (3.0)
    new, ref = pair(tmp_path, {"logprob": np.array([[-1.0 + 2.9e-4, -2.0], [-3.0, np.nan]], np.float32)},
                    new_kwargs, dtype="float32")
    code, out, _ = run_verify(capsys, new, "--against", ref)
    assert code == EXIT_MATCH, out
    assert f"comparison: tolerant (CPU runs on other kernel paths: {reason}" in out
    assert "0.0003 (rtol 0.0001 (CPU float32) x scale)" in out
    new, ref = pair(tmp_path, {"logprob": np.array([[-1.0 + 3.1e-4, -2.0], [-3.0, np.nan]], np.float32)},
                    new_kwargs, dtype="float32")
    assert run_verify(capsys, new, "--against", ref)[0] == EXIT_MISMATCH


def test_differences_of_probabilities_err_as_the_probabilities_do(tmp_path, capsys):
    """An effect of 1e-3 between probabilities of 0.5 carries their rounding: its tolerance scales with the store's
    largest probability (0.5 here), not with the effect."""
    base = {"answer_prob": np.array([0.5, 0.499], np.float32), "indirect_effect": np.array([1e-3, -5e-4], np.float32)}
    new, ref = pair(tmp_path, {"indirect_effect": np.array([1e-3 + 4e-5, -5e-4], np.float32)}, {"cpu": AVX512_BF16},
                    base=base, dtype="float32")
    code, out, _ = run_verify(capsys, new, "--against", ref)
    assert code == EXIT_MATCH and "5e-05 (rtol 0.0001 (CPU float32) x probability scale)" in out, out
    new, ref = pair(tmp_path, {"indirect_effect": np.array([1e-3 + 6e-5, -5e-4], np.float32)}, {"cpu": AVX512_BF16},
                    base=base, dtype="float32")
    assert run_verify(capsys, new, "--against", ref)[0] == EXIT_MISMATCH


def test_reduced_precision_storage_allows_one_step(tmp_path, capsys):
    """A float16 capture may round to the neighbouring float16 where the float32 value moved by a hair."""
    acts = np.array([[0.5, 0.2327880859375], [1.0, -0.25]], np.float16)
    moved = acts.copy()
    moved[0, 1] = np.nextafter(moved[0, 1], np.float16(1))
    new, ref = pair(tmp_path, {"acts": moved}, {"cpu": AVX512_BF16}, base={"acts": acts}, dtype="float32")
    code, out, _ = run_verify(capsys, new, "--against", ref)
    assert code == EXIT_MATCH and "(float16 step x scale)" in out, out
    moved[0, 1] = acts[0, 1] + np.float16(0.002)  # beyond one step at the array's scale (1.0): 2 ** -10
    new, ref = pair(tmp_path, {"acts": moved}, {"cpu": AVX512_BF16}, base={"acts": acts}, dtype="float32")
    assert run_verify(capsys, new, "--against", ref)[0] == EXIT_MISMATCH


TOP_IDS = np.array([[[5, 7, 9], [3, 1, 2]]], np.int32)  # (request, x: generated, top_k)
TOP_LPS = np.array([[[-0.5, -1.0, -1.00001], [-0.1, -3.0, -4.0]]], np.float32)
GENERATED = {"tokens": np.array([[5, 3]], np.int32), "logprob": np.array([[-0.5, -0.1]], np.float32),
             "top_token_ids": TOP_IDS, "top_logprob": TOP_LPS}


@pytest.mark.parametrize("ids, lps, ok", [
    ([[[5, 9, 7], [3, 1, 2]]], [[[-0.5, -1.00001, -1.0], [-0.1, -3.0, -4.0]]], True),  # a near tie reordered
    ([[[5, 7, 8], [3, 1, 2]]], [[[-0.5, -1.0, -1.00002], [-0.1, -3.0, -4.0]]], True),  # a near tie at the edge
    ([[[3, 1, 2], [5, 7, 9]]], [[[-0.1, -3.0, -4.0], [-0.5, -1.0, -1.00001]]], False),  # steps swapped
    ([[[5, 7, 9], [3, 2, 1]]], [[[-0.5, -1.0, -1.00001], [-0.1, -3.0, -4.0]]], False),  # distinct tokens swapped
])
def test_top_k_ids_of_a_tolerant_comparison_compare_as_sets(tmp_path, capsys, ids, lps, ok):
    changes = {"top_token_ids": np.array(ids, np.int32), "top_logprob": np.array(lps, np.float32)}
    new, ref = pair(tmp_path, changes, {"cpu": AVX512_BF16}, base=GENERATED, dtype="float32")
    code, out, _ = run_verify(capsys, new, "--against", ref)
    assert code == (EXIT_MATCH if ok else EXIT_MISMATCH), out
    assert "top_token_ids" in out
    # on one kernel path, the ids are exact
    new, ref = pair(tmp_path, changes, base=GENERATED, dtype="float32")
    assert run_verify(capsys, new, "--against", ref)[0] == EXIT_MISMATCH


def test_teacher_forced_tokens_must_stay_greedy_within_tolerance(tmp_path, capsys):
    """A forced token that another token overtook beyond the tolerance: a free-running rerun would have forked
    there. Within the tolerance (a near tie), it passes."""
    tied = np.array([[[5, 7, 9], [3, 1, 2]]], np.int32), np.array([[[-0.5, -1.0, -1.00001], [-0.1, -0.1001, -4.0]]],
                                                                  np.float32)
    base = {**GENERATED, "top_token_ids": tied[0], "top_logprob": tied[1]}
    ref = make_store(tmp_path / "ref.zarr", base, dtype="float32")
    forced = {"sampling": {"temperature": 0.0, "teacher_forcing": str(ref)}}
    for name, lead, ok in (("near", 5e-5, True), ("fork", 1e-2, False)):  # token 1's lead over the forced 3
        ids, lps = tied[0].copy(), tied[1].copy()
        ids[0, 1], lps[0, 1] = [1, 3, 2], [-0.1 + lead, -0.1, -4.0]
        new = make_store(tmp_path / f"{name}.zarr", {**base, "top_token_ids": ids, "top_logprob": lps},
                         cpu=AVX512_BF16, dtype="float32", config=forced)
        code, out, _ = run_verify(capsys, new, "--against", ref)
        assert "teacher-forced to the reference's" in out
        assert code == (EXIT_MATCH if ok else EXIT_MISMATCH), out
    row = next(line for line in out.splitlines() if line.strip().startswith("tokens "))
    assert "1 of 2 reference tokens are no longer the greedy choice" in row and "request=0, x=1" in row


def test_value_kinds():
    assert verify.value_kind("answer_prob") == verify.value_kind("restored_prob") == "probability"
    assert verify.value_kind("indirect_effect") == verify.value_kind("avg_indirect_effect") == "probability difference"
    for name in ("logprob", "answer_logprob", "restored_logprob_samples", "logit_diff", "recovered", "last"):
        assert verify.value_kind(name) == "other"
