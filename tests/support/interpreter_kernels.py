"""The Triton kernels on CPU tensors under Triton's interpreter, against the naive oracles of test_kernels.

Not collected by default (the name does not start with ``test_``): ``test_kernels.py`` runs this module in a
fresh process, since vLLM's import changes Triton for the rest of its process on a machine without a GPU.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import interp_runner_kernels as kernels
from interp_runner_kernels.reference import capture_rows_ref
from test_kernels import (CASES, DTYPES, KERNELS_DIR, NAN, assert_within_ulp, capture_setup, check_float32_stream,
                          float32_stream, lerp_scale, make_inputs, same)

# Triton's interpreter runs the kernels with numpy on CPU tensors. TRITON_INTERPRET=1 is read when a kernel is
# decorated, so the test loads its own copy of kernels/triton_rows.py with the variable set (the package's copy,
# the CUDA one, is left alone), and MAX_BLOCK_D is lowered so that rows span several column blocks with a masked
# tail. The interpreter rounds float32 -> bfloat16 toward zero where the GPU rounds to nearest even: in bfloat16
# a rounded result is checked within one unit in the last place; copies, bank rows and zeros stay exact.

INTERP_D = 40  # three column blocks of 16 (the last one masked)


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    module = _interpreted_module()
    monkeypatch.setattr(module, "MAX_BLOCK_D", 16)
    return module


_INTERPRETED = {}


def _interpreted_module():
    if "module" not in _INTERPRETED:
        spec = importlib.util.spec_from_file_location("interp_rows_interpreted", KERNELS_DIR / "triton_rows.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _INTERPRETED["module"] = module
    return _INTERPRETED["module"]


def check_rounded(got, want, scale=None):
    if want.dtype == torch.float32:
        assert same(got, want)
    else:
        assert_within_ulp(got, want, scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_interpreter_steer_add(interpreted, dtype):
    inp = make_inputs(50, 7, INTERP_D, dtype)
    got = interpreted.steer_add(inp["x"], inp["table"], inp["row_slot"])
    check_rounded(got, kernels.steer_add(inp["x"], inp["table"], inp["row_slot"]))
    in_place = inp["x"].clone()
    assert interpreted.steer_add(in_place, inp["table"], inp["row_slot"], out=in_place) is in_place
    assert same(in_place, got)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ["mixed", "none_masked", "alpha1"])
def test_interpreter_patch(interpreted, case, dtype):
    rows, masked, alpha = CASES[case]
    inp = make_inputs(60, rows, INTERP_D, dtype, masked=masked, alpha=alpha)
    x, args = inp["x"], (inp["bank"], inp["idx"], inp["coef"], inp["mask"])
    m = inp["mask"][:rows]

    want = kernels.patch_rows(x, *args)
    got = interpreted.patch_rows(x, *args, out=torch.full_like(x, NAN))
    check_rounded(got, want, lerp_scale(x, inp))
    in_place = x.clone()
    assert interpreted.patch_rows(in_place, *args, out=in_place) is in_place
    check_rounded(in_place, want, lerp_scale(x, inp))
    assert same(got[~m], x[~m]) and same(in_place[~m], x[~m])

    want, want_extra = kernels.patch_pair(x, inp["extra"], *args)
    got, got_extra = interpreted.patch_pair(x, inp["extra"], *args)
    check_rounded(got, want, lerp_scale(x.float() + inp["extra"].float(), inp))
    assert same(got_extra, want_extra) and same(got[~m], x[~m])
    pair = x.clone(), inp["extra"].clone()
    returned = interpreted.patch_pair(*pair, *args, in_place=True)
    assert returned[0] is pair[0] and returned[1] is pair[1]  # the same tensors, changed in place
    assert same(pair[0], got) and same(pair[1], got_extra)
    if case == "alpha1":
        assert same(got, want)  # bank rows: nothing to round


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("count", [0, 4, 6])
def test_interpreter_capture(interpreted, dtype, count):
    inp = make_inputs(70, 8, INTERP_D, dtype)
    for extra, odt in [(None, dtype), (inp["extra"], torch.float32), (inp["extra"], dtype)]:
        src, dest, count_t, out = capture_setup(70, 8, INTERP_D, dtype, odt, count)
        want = capture_rows_ref(inp["x"], extra, src, dest, count_t, out.clone())
        assert interpreted.capture_rows(inp["x"], extra, src, dest, count_t.long(), out) is out
        written = torch.zeros(out.shape[0], dtype=torch.bool)
        written[dest[:count]] = True
        assert out[~written].isnan().all()
        if extra is None or odt == torch.float32:
            assert same(out, want)  # a copy, or a float32 sum: exact
        else:
            check_rounded(out[written], want[written])


def test_interpreter_float32_stream_with_bfloat16_values(interpreted):
    inp = make_inputs(80, 9, INTERP_D, torch.bfloat16)
    check_float32_stream(interpreted, inp, float32_stream(inp))
