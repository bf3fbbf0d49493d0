"""Row-kernel microbenchmark: the Triton kernels of kernels/triton_rows.py against the torch reference, on CUDA.

For each kernel and shape (T rows x D columns, bf16) it times the Triton kernel and the reference with
``triton.testing.do_bench`` (median, L2 flushed between repetitions) and turns the kernel's time into a bandwidth:
the bytes the kernel must move at least (every input row read once, every output row written once, the index
and mask bytes, a steering table counted once), over its time. That bandwidth is set against a device-to-device
copy of a 1 GiB tensor timed in the same run (read + write counted): ``% copy`` near 100 means the kernel runs at
memory speed. Kernels:

- ``steer_add``: x + table[row_slot] (16-row table), fresh output.
- ``patch_rows``: half the rows patched toward their own bank row (bank of T rows), fresh output.
- ``patch_rows_inplace``: the same into x itself; only the patched rows move.
- ``patch_pair``: x and extra in, both halves out, half the rows patched.
- ``capture_rows``: every row of x + extra into a float32 buffer (count = T, read on the device).
- ``capture_rows_empty``: count = 0 on a grid of T programs: the cost of a step that captures nothing.

The reference's capture reads the count on the host, so its time includes a device sync.

Then the host's side of a call, which bounds a step run outside CUDA graphs on a small model (the plugin's ops are
Python calls there, one per site): each kernel's launcher and its torch reference are called ``LAUNCH_CALLS`` times
back to back at the shapes of ``LAUNCH_SHAPES`` (SmolLM2's width at decode, mixed and prefill step sizes, and an
8B-wide step), and the host's wall time per call is reported, the device synchronized only after the loop; beside
them the copy a site with nothing to do made in a step before the ops worked in place (a fresh output each).
Prints the tables last; ``--json`` keeps everything. Needs a CUDA GPU; under a minute on an H100.

    python bench/kernels.py --json $OUT/kernels.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
ROWS = (32, 512, 8192, 16384)
DIMS = (1024, 4096)
TABLE_SLOTS = 16
COPY_BYTES = 1 << 30
LAUNCH_SHAPES = ((64, 576), (256, 576), (2048, 576), (256, 4096))
LAUNCH_CALLS = 2000


def load_kernels():
    """interp_runner_kernels as installed, else the repo's kernels/ folder under that name."""
    try:
        import interp_runner_kernels
    except ImportError:
        folder = REPO / "kernels"
        spec = importlib.util.spec_from_file_location("interp_runner_kernels", folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        interp_runner_kernels = importlib.util.module_from_spec(spec)
        sys.modules["interp_runner_kernels"] = interp_runner_kernels
        spec.loader.exec_module(interp_runner_kernels)
    from interp_runner_kernels import reference, triton_rows

    return interp_runner_kernels, reference, triton_rows


def bench_ms(fn, warmup: int, rep: int) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def copy_bandwidth(warmup: int, rep: int) -> dict:
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup, rep)
    return {"bytes": 2 * COPY_BYTES, "ms": ms, "gb_s": 2 * COPY_BYTES / ms / 1e6}


def cases(rows: int, d: int, reference, triton_rows, dev: str = "cuda"):
    """(kernel name, bytes moved at least, Triton call, reference call) for one shape."""
    dt = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(rows + d)
    x = torch.randn(rows, d, generator=g, device=dev).to(dt)
    row_bytes = d * x.element_size()
    extra = torch.randn(rows, d, generator=g, device=dev).to(dt)
    table = torch.randn(TABLE_SLOTS, d, generator=g, device=dev).to(dt)
    table[0] = 0
    row_slot = torch.randint(0, TABLE_SLOTS, (rows,), generator=g, device=dev)
    bank = torch.randn(rows, d, generator=g, device=dev).to(dt)
    idx = torch.randperm(rows, generator=g, device=dev)
    alpha = torch.rand(rows, generator=g, device=dev)
    coef = torch.stack([1 - alpha, alpha], 1)
    mask = torch.arange(rows, device=dev) % 2 == 0
    patched = int(mask.sum())
    src = torch.arange(rows, device=dev)
    dest = torch.randperm(rows, generator=g, device=dev)
    count_all = torch.tensor([rows], dtype=torch.int32, device=dev)
    count_none = torch.zeros(1, dtype=torch.int32, device=dev)
    captured = torch.zeros(rows, d, dtype=torch.float32, device=dev)
    inplace_x = x.clone()
    per_row_patch = 8 + 8 + 1  # idx, coef, mask

    return [
        ("steer_add", 2 * rows * row_bytes + TABLE_SLOTS * row_bytes + 8 * rows,
         lambda: triton_rows.steer_add(x, table, row_slot),
         lambda: reference.gather_add(x, table, row_slot)),
        ("patch_rows", 2 * rows * row_bytes + patched * row_bytes + per_row_patch * rows,
         lambda: triton_rows.patch_rows(x, bank, idx, coef, mask),
         lambda: reference.patch_rows(x, bank, idx, coef, mask)),
        ("patch_rows_inplace", 3 * patched * row_bytes + rows + (8 + 8) * patched,
         lambda: triton_rows.patch_rows(inplace_x, bank, idx, coef, mask, out=inplace_x),
         lambda: inplace_x.copy_(reference.patch_rows(inplace_x, bank, idx, coef, mask))),
        ("patch_pair", 4 * rows * row_bytes + patched * row_bytes + per_row_patch * rows,
         lambda: triton_rows.patch_pair(x, extra, bank, idx, coef, mask),
         lambda: reference.patch_pair(x, extra, bank, idx, coef, mask)),
        ("capture_rows", 2 * rows * row_bytes + rows * d * 4 + 16 * rows,
         lambda: triton_rows.capture_rows(x, extra, src, dest, count_all, captured),
         lambda: reference.capture_rows_ref(x, extra, src, dest, count_all, captured)),
        ("capture_rows_empty", 0,
         lambda: triton_rows.capture_rows(x, extra, src, dest, count_none, captured),
         lambda: reference.capture_rows_ref(x, extra, src, dest, count_none, captured)),
    ]


def host_us(fn, calls: int = LAUNCH_CALLS) -> float:
    """The host's wall time of one call (µs), over ``calls`` calls back to back; the device waited for after."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return 1e6 * elapsed / calls


def launch_text(result: dict) -> str:
    lines = [f"host time of one call (µs), {LAUNCH_CALLS} calls back to back",
             f"{'kernel':<20}{'T':>7}{'D':>6}{'triton':>9}{'torch':>9}"]
    lines += [f"{r['kernel']:<20}{r['T']:>7}{r['D']:>6}{r['triton_us']:>9.1f}{r['torch_us']:>9.1f}"
              for r in result["launch"]]
    return "\n".join(lines)


def table_text(result: dict) -> str:
    copy = result["copy"]["gb_s"]
    lines = [f"device: {result['device']} | copy bandwidth (read + write): {copy:.0f} GB/s",
             f"{'kernel':<20}{'T':>7}{'D':>6}{'triton us':>11}{'GB/s':>8}{'% copy':>8}{'torch us':>10}{'speedup':>9}"]
    order = {}
    for r in result["rows"]:
        order.setdefault(r["kernel"], len(order))
    for r in sorted(result["rows"], key=lambda r: (order[r["kernel"]], r["D"], r["T"])):
        gb_s = f"{r['gb_s']:.0f}" if r["bytes"] else "-"
        frac = f"{100 * r['gb_s'] / copy:.0f}" if r["bytes"] else "-"
        lines.append(f"{r['kernel']:<20}{r['T']:>7}{r['D']:>6}{1e3 * r['triton_ms']:>11.1f}{gb_s:>8}{frac:>8}"
                     f"{1e3 * r['torch_ms']:>10.1f}{r['torch_ms'] / r['triton_ms']:>8.1f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="", help="write all numbers here")
    ap.add_argument("--rows", type=int, nargs="*", default=list(ROWS), help="T values")
    ap.add_argument("--dims", type=int, nargs="*", default=list(DIMS), help="D values")
    ap.add_argument("--warmup", type=int, default=10, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=40, help="do_bench repetitions, ms")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU and this machine has none", file=sys.stderr)
        return 1
    package, reference, triton_rows = load_kernels()
    import triton

    t0 = time.perf_counter()
    result = {
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "python": platform.python_version()},
        "kernels_from": str(Path(package.__file__).parent),
        "dtype": "bfloat16",
        "do_bench": {"warmup_ms": args.warmup, "rep_ms": args.rep, "return_mode": "median"},
        "copy": copy_bandwidth(args.warmup, args.rep),
        "rows": [],
    }
    for d in args.dims:
        for rows in args.rows:
            for name, nbytes, fast, slow in cases(rows, d, reference, triton_rows):
                fast_ms = bench_ms(fast, args.warmup, args.rep)
                slow_ms = bench_ms(slow, args.warmup, args.rep)
                result["rows"].append({"kernel": name, "T": rows, "D": d, "bytes": nbytes, "triton_ms": fast_ms,
                                       "torch_ms": slow_ms, "gb_s": nbytes / fast_ms / 1e6})
            torch.cuda.empty_cache()
    result["launch"] = []
    for rows, d in LAUNCH_SHAPES:
        for name, _, fast, slow in cases(rows, d, reference, triton_rows):
            result["launch"].append({"kernel": name, "T": rows, "D": d, "triton_us": host_us(fast),
                                     "torch_us": host_us(slow)})
        x = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
        result["launch"].append({"kernel": "clone (plain site)", "T": rows, "D": d, "triton_us": float("nan"),
                                 "torch_us": host_us(x.clone)})
    result["seconds"] = time.perf_counter() - t0
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(table_text(result))
    print(launch_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
