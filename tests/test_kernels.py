"""Row kernels (``kernels/``, package ``interp_runner_kernels``).

Three layers:
- CPU: the torch path (the reference) against a naive per-row loop written here, bit for bit.
- CPU: the Triton kernels run by Triton's interpreter (small shapes), against the reference.
- GPU (``gpu`` marker): the Triton kernels against the reference on CUDA at model sizes, int64 offsets, and one
  CUDA graph replayed over changed buffers.

Every test draws fresh seeded inputs; persistent outputs start as NaN, so a row that is not written shows.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import interp_runner_kernels as kernels
from interp_runner_kernels.reference import capture_rows_ref

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
NAN = float("nan")
DTYPES = [torch.float32, torch.bfloat16]
SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11, torch.float32: 24}

# name -> (rows, which rows are masked, alpha): alpha None draws one per row in [0, 1)
CASES = {
    "mixed": (9, "some", None),
    "one_row": (1, "all", None),
    "none_masked": (6, "none", None),
    "all_masked": (6, "all", None),
    "alpha0": (7, "all", 0.0),
    "alpha1": (7, "all", 1.0),
}


# ---------------------------------------------------------------- inputs and oracles


def make_inputs(seed: int, rows: int, d: int, dtype, device="cpu", masked="some", alpha=None, spare=3,
                slots=5, bank_rows=11) -> dict:
    """Inputs of every primitive; per-row buffers are ``spare`` rows longer than x, as the plugin's are."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    n = rows + spare
    table = randn(slots, d)
    table[0] = 0  # slot 0: no steering
    if masked == "some":
        mask = torch.rand(n, generator=g, device=device) < 0.5
        mask[0], mask[min(1, rows - 1)] = True, False  # at least one row of each kind when rows > 1
    else:
        mask = torch.full((n,), masked == "all", device=device)
    if alpha is None:
        alpha_rows = torch.rand(n, generator=g, device=device)
    else:
        alpha_rows = torch.full((n,), float(alpha), device=device)
    return {
        "x": randn(rows, d),
        "extra": randn(rows, d),
        "table": table,
        "row_slot": torch.randint(0, slots, (n,), generator=g, device=device),
        "bank": randn(bank_rows, d),
        "idx": torch.randint(0, bank_rows, (n,), generator=g, device=device),
        "coef": torch.stack([1 - alpha_rows, alpha_rows], 1).float(),
        "mask": mask,
    }


def naive_steer(x, table, row_slot):
    out = torch.full_like(x, NAN)
    for i in range(x.shape[0]):
        out[i] = (x[i].float() + table[int(row_slot[i])].float()).to(x.dtype)
    return out


def naive_patched(value32, bank, idx, coef, i):
    """Row i patched, float32: a * value + b * bank[idx[i]]."""
    return coef[i, 0] * value32 + coef[i, 1] * bank[int(idx[i])].float()


def naive_patch_rows(x, bank, idx, coef, mask):
    out = torch.full_like(x, NAN)
    for i in range(x.shape[0]):
        out[i] = naive_patched(x[i].float(), bank, idx, coef, i).to(x.dtype) if bool(mask[i]) else x[i]
    return out


def naive_patch_pair(x, extra, bank, idx, coef, mask):
    out, extra_out = torch.full_like(x, NAN), torch.full_like(extra, NAN)
    for i in range(x.shape[0]):
        if bool(mask[i]):
            out[i] = naive_patched(x[i].float() + extra[i].float(), bank, idx, coef, i).to(x.dtype)
            extra_out[i] = 0
        else:
            out[i], extra_out[i] = x[i], extra[i]
    return out, extra_out


def naive_capture(x, extra, src_rows, dest_rows, count, out):
    out = out.clone()
    for j in range(min(int(count[0]), len(src_rows))):
        value = x[int(src_rows[j])].float()
        if extra is not None:
            value = value + extra[int(src_rows[j])].float()
        out[int(dest_rows[j])] = value.to(out.dtype)
    return out


def capture_setup(seed, rows, d, dtype, out_dtype, count, device="cpu", max_rows=6, out_rows=10):
    """Source rows (repeats allowed), distinct destination rows, a one-element count, a NaN output buffer."""
    g = torch.Generator(device=device).manual_seed(seed + 1)
    src = torch.randint(0, rows, (max_rows,), generator=g, device=device)
    dest = torch.randperm(out_rows, generator=g, device=device)[:max_rows]
    count_t = torch.tensor([count], dtype=torch.int32, device=device)
    return src, dest, count_t, torch.full((out_rows, d), NAN, dtype=out_dtype, device=device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN bits included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_int = {2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


def ulp(t: torch.Tensor) -> torch.Tensor:
    """The spacing of t's dtype at each value of t (float32)."""
    mag = t.float().abs().clamp_min(torch.finfo(t.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(mag)) - (SIGNIFICAND_BITS[t.dtype] - 1))


def assert_within_ulp(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None):
    """|got - want| at most one unit in the last place of want, plus float32 rounding of ``scale`` (the size of
    the terms summed, where the result may cancel)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got.isnan().any(), "NaN in the output: a row was not written"
    tol = ulp(want)
    if scale is not None:
        tol = tol + 4 * torch.finfo(torch.float32).eps * scale
    err = (got.float() - want.float()).abs()
    if not bool((err <= tol).all()):
        worst = int(err.argmax())
        raise AssertionError(f"largest error {err.max():.3g} (tolerance there {tol.view(-1)[worst]:.3g})")


def lerp_scale(value, inp):
    """|a * value| + |b * bank row| per element: the float32 error bound of a lerp that cancels."""
    n = value.shape[0]
    bank = inp["bank"].index_select(0, inp["idx"][:n]).float()
    return (inp["coef"][:n, :1] * value.float()).abs() + (inp["coef"][:n, 1:] * bank).abs()


# ---------------------------------------------------------------- CPU: the torch path against the naive loop


def test_backend_on_cpu():
    assert kernels.backend("cpu") == "torch"


def test_steering_outside_graphs_runs_the_kernel_from_a_size_on(monkeypatch):
    """Outside CUDA graphs a small call steers through ATen (less host time), a large one through the kernel (fewer
    device bytes); inside them always the kernel."""
    ran = []

    class Kernels:
        @staticmethod
        def steer_add(x, table, row_slot, out=None):
            ran.append(x.shape[0])
            return out

    monkeypatch.setattr(kernels, "_kernels", lambda x: Kernels)
    width = 64
    table = torch.randn(3, width)
    slots = torch.randint(0, 3, (kernels.EAGER_KERNEL_ELEMENTS // width,))
    small, large = torch.zeros(8, width), torch.zeros(len(slots), width)
    kernels.steer_add(small, table, slots, eager=True, out=small)
    assert ran == [] and torch.equal(small, table[slots[:8]])
    kernels.steer_add(large, table, slots, eager=True, out=large)
    kernels.steer_add(small, table, slots, eager=False, out=small)
    assert ran == [len(slots), 8]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_steer_add_cpu(case, dtype):
    rows, masked, alpha = CASES[case]
    inp = make_inputs(10, rows, 24, dtype, masked=masked, alpha=alpha)
    out = kernels.steer_add(inp["x"], inp["table"], inp["row_slot"])
    assert same(out, naive_steer(inp["x"], inp["table"], inp["row_slot"]))
    in_place = inp["x"].clone()
    assert kernels.steer_add(in_place, inp["table"], inp["row_slot"], out=in_place) is in_place
    assert same(in_place, out)
    unsteered = inp["row_slot"][:rows] == 0
    assert same(out[unsteered], (inp["x"][unsteered].float() + 0.0).to(dtype))  # slot 0 adds zeros


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_patch_rows_cpu(case, dtype):
    rows, masked, alpha = CASES[case]
    inp = make_inputs(20, rows, 24, dtype, masked=masked, alpha=alpha)
    x, args = inp["x"], (inp["bank"], inp["idx"], inp["coef"], inp["mask"])
    want = naive_patch_rows(x, *args)
    assert same(kernels.patch_rows(x, *args), want)
    poisoned = torch.full_like(x, NAN)
    assert kernels.patch_rows(x, *args, out=poisoned) is poisoned and same(poisoned, want)
    in_place = x.clone()
    kernels.patch_rows(in_place, *args, out=in_place)
    assert same(in_place, want)
    if case == "alpha0":
        assert same(want, x)
    if case == "alpha1":
        assert same(want, inp["bank"][inp["idx"][:rows]])
    kept = ~inp["mask"][:rows]
    assert same(want[kept], x[kept])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_patch_pair_cpu(case, dtype):
    rows, masked, alpha = CASES[case]
    inp = make_inputs(30, rows, 24, dtype, masked=masked, alpha=alpha)
    args = (inp["x"], inp["extra"], inp["bank"], inp["idx"], inp["coef"], inp["mask"])
    out, extra_out = kernels.patch_pair(*args)
    want, want_extra = naive_patch_pair(*args)
    assert same(out, want) and same(extra_out, want_extra)
    x, extra = inp["x"].clone(), inp["extra"].clone()
    got, got_extra = kernels.patch_pair(x, extra, *args[2:], in_place=True)
    assert got is x and got_extra is extra and same(x, want) and same(extra, want_extra)
    if case == "alpha0":
        assert same(out, (inp["x"].float() + inp["extra"].float()).to(dtype))
    if case == "alpha1":
        assert same(out, inp["bank"][inp["idx"][:rows]])
    m = inp["mask"][:rows]
    assert same(out[~m], inp["x"][~m]) and same(extra_out[~m], inp["extra"][~m])
    assert same(extra_out[m], torch.zeros_like(inp["extra"][m]))


@pytest.mark.parametrize("out_dtype", ["x", "float32"])
@pytest.mark.parametrize("with_extra", [False, True], ids=["x", "x+extra"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("count", [0, 1, 4, 6, 9])
def test_capture_rows_cpu(count, dtype, with_extra, out_dtype):
    inp = make_inputs(40, 8, 24, dtype)
    extra = inp["extra"] if with_extra else None
    odt = dtype if out_dtype == "x" else torch.float32
    src, dest, count_t, out = capture_setup(40, 8, 24, dtype, odt, count)
    want = naive_capture(inp["x"], extra, src, dest, count_t, out)
    assert kernels.capture_rows(inp["x"], extra, src, dest, count_t, out) is out
    assert same(out, want)
    written = torch.zeros(out.shape[0], dtype=torch.bool)
    written[dest[: min(count, len(src))]] = True
    assert not out[written].isnan().any() and out[~written].isnan().all()
    assert same(capture_rows_ref(inp["x"], extra, src, dest, count_t.long(), torch.full_like(out, NAN)), want)


def float32_stream(inp: dict) -> torch.Tensor:
    """A float32 x that bfloat16 cannot hold, for inputs drawn in bfloat16: the stream vLLM keeps in float32 between
    two fused adds under torch.compile, while the steering table, the patch bank and the other half stay bfloat16."""
    g = torch.Generator(device=inp["x"].device).manual_seed(7)
    return inp["x"].float() + 1e-3 * torch.randn(inp["x"].shape, generator=g, device=inp["x"].device)


def check_float32_stream(rows_mod, inp: dict, x: torch.Tensor, check=None) -> None:
    """Steering, patching (one tensor and two halves) and capture of a float32 x with bfloat16 values, by
    ``rows_mod``'s primitives, against the naive loops: float32 sums kept in float32."""
    check = check or (lambda got, want: same(got, want))
    args = (inp["bank"], inp["idx"], inp["coef"], inp["mask"])
    steered = rows_mod.steer_add(x, inp["table"], inp["row_slot"])
    assert steered.dtype == torch.float32 and check(steered, naive_steer(x, inp["table"], inp["row_slot"]))
    assert check(rows_mod.patch_rows(x, *args), naive_patch_rows(x, *args))
    pair = x.clone(), inp["extra"].clone()
    rows_mod.patch_pair(*pair, *args, in_place=True)
    want, want_extra = naive_patch_pair(x, inp["extra"], *args)
    assert check(pair[0], want) and same(pair[1], want_extra)
    src, dest, count_t, out = capture_setup(47, x.shape[0], x.shape[1], torch.float32, torch.float32, 4,
                                            device=x.device)
    want = naive_capture(x, inp["extra"], src, dest, count_t, out)
    assert same(rows_mod.capture_rows(x, inp["extra"], src, dest, count_t.long(), out), want)


@pytest.mark.parametrize("case", ["mixed", "alpha1"])
def test_float32_stream_with_bfloat16_values_cpu(case):
    rows, masked, alpha = CASES[case]
    inp = make_inputs(45, rows, 24, torch.bfloat16, masked=masked, alpha=alpha)
    check_float32_stream(kernels, inp, float32_stream(inp))


# ---------------------------------------------------------------- CPU: the Triton kernels under the interpreter


def test_kernels_under_the_triton_interpreter():
    """tests/support/interpreter_kernels.py in a fresh process: vLLM's import reconfigures Triton on a machine
    without a GPU driver, after which the interpreter cannot run every kernel, so it must not share this process."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(Path(__file__).parent / "support" / "interpreter_kernels.py")],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]


# ---------------------------------------------------------------- GPU: Triton against the reference on CUDA

GPU_D = [576, 1024, 4096]
GPU_T = [1, 7, 512, 8192]


def poison_allocator(*shapes_dtypes):
    """Hand NaN-filled blocks back to the CUDA caching allocator, so that the fresh outputs of the next call
    reuse them and an unwritten row shows as NaN."""
    blocks = [torch.full(shape, NAN, dtype=dtype, device="cuda") for shape, dtype in shapes_dtypes]
    del blocks


def gpu_rows():
    from interp_runner_kernels import triton_rows

    return triton_rows


@pytest.mark.gpu
def test_backend_on_cuda():
    assert kernels.backend("cuda") == "triton", kernels.triton_import_error()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", GPU_D)
@pytest.mark.parametrize("rows", GPU_T)
def test_gpu_steer_add(rows, d, dtype):
    inp = make_inputs(rows * 7 + d, rows, d, dtype, device="cuda", slots=17)
    poison_allocator(((rows, d), dtype))
    got = gpu_rows().steer_add(inp["x"], inp["table"], inp["row_slot"])
    assert same(got, kernels.reference.gather_add(inp["x"], inp["table"], inp["row_slot"]))
    in_place = inp["x"].clone()
    assert gpu_rows().steer_add(in_place, inp["table"], inp["row_slot"], out=in_place) is in_place
    assert same(in_place, got)


@pytest.mark.gpu
@pytest.mark.parametrize("alpha", [None, 0.0, 1.0], ids=["lerp", "alpha0", "alpha1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", GPU_D)
@pytest.mark.parametrize("rows", GPU_T)
def test_gpu_patch(rows, d, dtype, alpha):
    rows_mod = gpu_rows()
    inp = make_inputs(rows * 13 + d, rows, d, dtype, device="cuda", alpha=alpha, bank_rows=64)
    x, args = inp["x"], (inp["bank"], inp["idx"], inp["coef"], inp["mask"])
    m = inp["mask"][:rows]

    want = kernels.reference.patch_rows(x, *args)
    poison_allocator(((rows, d), dtype))
    got = rows_mod.patch_rows(x, *args)
    in_place = x.clone()
    rows_mod.patch_rows(in_place, *args, out=in_place)
    for result in (got, in_place):
        if alpha is None:
            assert_within_ulp(result, want, lerp_scale(x, inp))
        else:
            assert same(result, want)
        assert same(result[~m], x[~m])
    if alpha == 1.0:
        assert same(got[m], inp["bank"][inp["idx"][:rows][m]])

    want, want_extra = kernels.reference.patch_pair(x, inp["extra"], *args)
    poison_allocator(((rows, d), dtype), ((rows, d), dtype))
    got, got_extra = rows_mod.patch_pair(x, inp["extra"], *args)
    if alpha is None:
        assert_within_ulp(got, want, lerp_scale(x.float() + inp["extra"].float(), inp))
    else:
        assert same(got, want)
    assert same(got_extra, want_extra) and same(got[~m], x[~m])
    pair = x.clone(), inp["extra"].clone()
    returned = rows_mod.patch_pair(*pair, *args, in_place=True)
    assert returned[0] is pair[0] and returned[1] is pair[1]  # the same tensors, changed in place
    assert same(pair[0], got) and same(pair[1], got_extra)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", GPU_D)
@pytest.mark.parametrize("rows", GPU_T)
def test_gpu_capture(rows, d, dtype):
    rows_mod = gpu_rows()
    inp = make_inputs(rows * 17 + d, rows, d, dtype, device="cuda")
    max_rows = min(rows, 64)
    for count in (0, max_rows // 2, max_rows):
        for extra, odt in [(None, dtype), (inp["extra"], torch.float32), (inp["extra"], dtype)]:
            src, dest, count_t, out = capture_setup(rows + count, rows, d, dtype, odt, count, device="cuda",
                                                    max_rows=max_rows, out_rows=2 * max_rows + 3)
            want = capture_rows_ref(inp["x"], extra, src, dest, count_t, out.clone())
            rows_mod.capture_rows(inp["x"], extra, src, dest, count_t, out)
            assert same(out, want)
            assert int(out.isnan().all(1).sum()) == out.shape[0] - count


@pytest.mark.gpu
@pytest.mark.parametrize("d", GPU_D)
def test_gpu_float32_stream_with_bfloat16_values(d):
    inp = make_inputs(d + 3, 512, d, torch.bfloat16, device="cuda", slots=17, bank_rows=64)
    check_float32_stream(gpu_rows(), inp, float32_stream(inp))


@pytest.mark.gpu
def test_gpu_row_strides():
    """x and out as column slices of wider buffers (row stride larger than D)."""
    rows_mod = gpu_rows()
    inp = make_inputs(5, 33, 1024, torch.bfloat16, device="cuda")
    wide = torch.randn(33, 1024 + 96, device="cuda").to(torch.bfloat16)
    wide[:, :1024] = inp["x"]
    x = wide[:, :1024]
    tail = wide[:, 1024:].clone()
    assert same(rows_mod.steer_add(x, inp["table"], inp["row_slot"]),
                kernels.reference.gather_add(inp["x"], inp["table"], inp["row_slot"]))
    args = (inp["bank"], inp["idx"], inp["coef"], inp["mask"])
    want = kernels.reference.patch_rows(inp["x"], *args)
    rows_mod.patch_rows(x, *args, out=x)
    assert_within_ulp(x.contiguous(), want, lerp_scale(inp["x"], inp))
    assert same(wide[:, 1024:], tail)  # the columns past D are not touched


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """Rows past element 2**31 of a buffer: table, bank and capture output of 2**31 + 4 rows' worth (4.3 GB
    each in bf16)."""
    rows_mod = gpu_rows()
    d = 4096
    big = 2**31 // d + 4
    dt = torch.bfloat16
    inp = make_inputs(6, 5, d, dt, device="cuda", masked="all", alpha=1.0)
    last = big - 1
    table = torch.empty(big, d, dtype=dt, device="cuda")
    table[last] = inp["table"][1]
    row_slot = torch.full((5,), last, dtype=torch.int64, device="cuda")
    assert same(rows_mod.steer_add(inp["x"], table, row_slot), naive_steer(inp["x"], inp["table"],
                                                                            torch.ones(5, dtype=torch.int64)))
    table[last - 1] = inp["bank"][3]  # the same buffer serves as the bank
    idx = torch.full((5,), last - 1, dtype=torch.int64, device="cuda")
    got = rows_mod.patch_rows(inp["x"], table, idx, inp["coef"], inp["mask"])
    assert same(got, inp["bank"][3].expand(5, d).contiguous())
    del table
    out = torch.full((big, d), NAN, dtype=dt, device="cuda")
    dest = torch.tensor([last, last - 2, 0], device="cuda")
    src = torch.tensor([4, 0, 2], device="cuda")
    rows_mod.capture_rows(inp["x"], None, src, dest, torch.tensor([3], device="cuda"), out)
    assert same(out[dest], inp["x"][src]) and out[last - 1].isnan().all()


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_reads_buffers():
    """steer_add -> patch_pair -> capture_rows captured once in a CUDA graph on static buffers; replays after
    changing row slots, mask, coefficients, count and destination rows give what eager reference calls give on
    the new contents."""
    rows_mod = gpu_rows()
    rows, d, dt = 64, 1024, torch.bfloat16
    inp = make_inputs(7, rows, d, dt, device="cuda", slots=9, bank_rows=32)
    x, extra, table, bank = inp["x"], inp["extra"], inp["table"], inp["bank"]
    row_slot, idx, coef, mask = inp["row_slot"], inp["idx"], inp["coef"], inp["mask"]
    max_rows = 16
    src = torch.arange(max_rows, device="cuda")
    dest = torch.arange(max_rows, device="cuda")
    count = torch.tensor([3], dtype=torch.int32, device="cuda")
    captured = torch.full((2 * max_rows, d), NAN, dtype=torch.float32, device="cuda")

    def step():
        steered = rows_mod.steer_add(x, table, row_slot)
        out, extra_out = rows_mod.patch_pair(steered, extra, bank, idx, coef, mask)
        rows_mod.capture_rows(out, extra_out, src, dest, count, captured)
        return steered, out, extra_out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile the kernels outside the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steered, out, extra_out = step()

    g = torch.Generator(device="cuda").manual_seed(99)
    for state in range(3):
        row_slot.copy_(torch.randint(0, 9, row_slot.shape, generator=g, device="cuda"))
        mask.copy_(torch.rand(mask.shape, generator=g, device="cuda") < (0.3, 0.0, 1.0)[state])
        alpha = torch.rand(coef.shape[0], generator=g, device="cuda")
        coef.copy_(torch.stack([1 - alpha, alpha], 1))
        idx.copy_(torch.randint(0, 32, idx.shape, generator=g, device="cuda"))
        count.fill_((5, 0, max_rows)[state])
        dest.copy_(torch.randperm(2 * max_rows, generator=g, device="cuda")[:max_rows])
        src.copy_(torch.randint(0, rows, (max_rows,), generator=g, device="cuda"))
        captured.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()

        want_steered = kernels.reference.gather_add(x, table, row_slot)
        want_out, want_extra = kernels.reference.patch_pair(want_steered, extra, bank, idx, coef, mask)
        want_captured = capture_rows_ref(want_out, want_extra, src, dest, count, torch.full_like(captured, NAN))
        assert same(steered, want_steered)
        assert_within_ulp(out, want_out, lerp_scale(want_steered.float() + extra.float(), inp))
        assert same(extra_out, want_extra)
        # captured from the graph's own out: compare with the reference capture of that same out
        assert same(captured, capture_rows_ref(out, extra_out, src, dest, count, torch.full_like(captured, NAN)))
        assert int(captured.isnan().all(1).sum()) == 2 * max_rows - int(count[0])
        assert torch.equal(want_captured.isnan(), captured.isnan())
