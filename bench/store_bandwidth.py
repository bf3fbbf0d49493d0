"""Store bandwidth: a large capture written to a run's zarr store, against ``dd`` on the same filesystem.

Goal: writing a large capture (every prompt position of many layers) to the store reaches at least 80% of the write
bandwidth ``dd`` gets in the same directory.

- ``dd``: ``dd if=/dev/zero of=DIR/dd.bin bs=64M count=N`` (``--gib``), once per ``--dd-modes``: ``fdatasync``
  (``conv=fdatasync``: through the page cache, flushed before dd exits, as the store's files are written) and
  ``direct`` (``oflag=direct``: around the page cache). Timed here around the dd process plus an fsync of the file
  and its directory; dd's own reported rate is kept beside it. A mode the filesystem refuses is recorded and left
  out.
- store: a plan compiled by the prompts kind (``interp_runner.kinds.prompts``) from a capture config (``positions:
  all_prompt`` at every layer of ``--hook``) on synthetic model facts of ``--shape`` (requests, positions, layers,
  hidden), with results as the engine hands them over (float32 values per site; with ``--values bfloat16`` they
  are bf16-representable, as a bf16 engine produces them). The pipeline's own functions turn them into the store:
  ``open_store`` (untimed, as the pipeline opens the store before the run), the kind's ``dataset`` (timed apart:
  "build") and ``write_results``, timed from its start to the end of an fsync of every file and directory of the
  store. Bytes: on disk (the sizes of the store's files) and logical (the captured array at the dtype the store
  keeps: ``float32`` for float32 and bfloat16 layouts, ``float16`` for float16). The store compresses captures
  (its codecs are recorded), so both rates are reported: on disk against dd says how much of the disk's bandwidth
  the store uses; logical against dd says whether a capture is persisted as fast as dd writes its raw bytes.
- Each repeat runs every dd mode then one store write, in the same directory; files are deleted between repeats;
  medians are reported. The written store is read back once with ``xarray.open_zarr`` and spot-checked.
- ``--variants`` (diagnostics, not the product's settings): the same dataset written by ``write_results`` with
  the captures' compressor changed (``uncompressed``; ``zstd-1``: zstd level 1 instead of the default level;
  ``blosc-lz4``: blosc lz4 with byte shuffle) or with zarr's ``async.concurrency`` (chunks encoded and written at
  once) set to the CPU count (``concurrency``) or to N (``concurrency-N``); the store itself uses the larger of
  the CPU count and zarr's 10. ``--profile`` writes once more under cProfile and
  prints where the time goes, with the time spent inside zarr's worker threads (compression, file writes, the
  empty-chunk check) added up apart.

MB = 10^6 bytes, as dd counts. Prints a table last; ``--json`` keeps everything.

    python bench/store_bandwidth.py                                        # 64 x 512 x 28 x 1024, dd 2 GiB
    python bench/store_bandwidth.py --gib 0.25 --shape 16,256,16,1024 --repeats 2 --profile   # CPU smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from store_disk import DD_FLAGS, dd_once, filesystem, fsync_tree, tree_bytes  # noqa: E402

GOAL = 0.80
CAPTURE = "acts"
CONCURRENCY = max(os.cpu_count() or 1, 1)
COMPRESSORS = {  # diagnostic compressors of the captures
    "uncompressed": None,
    "zstd-1": [{"name": "zstd", "configuration": {"level": 1}}],
    "blosc-lz4": [{"name": "blosc", "configuration": {"cname": "lz4", "clevel": 5, "shuffle": "shuffle"}}],
}
VARIANTS = (*COMPRESSORS, "concurrency")  # also concurrency-N: N chunks at once


def concurrency_of(name: str) -> int | None:
    """Chunks in flight of a concurrency variant (``concurrency``: the CPU count; ``concurrency-N``: N)."""
    if name == "concurrency":
        return CONCURRENCY
    head, _, n = name.partition("-")
    return int(n) if head == "concurrency" and n.isdigit() and int(n) > 0 else None


# -- synthetic capture ------------------------------------------------------------------------------------


def synthetic_plan(shape: tuple[int, int, int, int], hook: str, dtype: str):
    """(plan, facts): every prompt position of every layer of ``hook`` captured, compiled from a config."""
    from interp_runner.kinds.prompts import KIND
    from interp_runner.config.run import validate_config
    from interp_runner.models.facts import ModelFacts

    requests, positions, layers, hidden = shape
    config = {
        "model": {"name": "synthetic"},
        "engine": {"max_model_len": positions + 16},
        "prompts": {"items": [f"request {i}" for i in range(requests)]},
        "sampling": {"max_tokens": 1},
        "capture": [{"name": CAPTURE, "hooks": [hook], "layers": "all", "positions": "all_prompt", "dtype": dtype}],
    }
    facts = ModelFacts(path="synthetic", architecture="LlamaForCausalLM", num_layers=layers, hidden_size=hidden,
                       vocab_size=32000, weights_sha256="synthetic")

    def tokenize(text: str) -> list[int]:  # every prompt is ``positions`` tokens long
        seed = int(text.split()[-1])
        return [int(t) for t in np.random.default_rng(seed).integers(1, 32000, positions)]

    return KIND.compile(validate_config(config), facts, tokenize), facts


def synthetic_results(plan, hidden: int, values: str, seed: int) -> dict:
    """Results by request id as ``VllmEngine.run`` returns them: per captured site, (positions, float32 values)."""
    from interp_runner.engine.results import RequestResult
    from interp_runner.payload import unpack_positions

    rng = np.random.default_rng(seed)
    results = {}
    for request in plan.requests:
        captures = {}
        for capture in request.payload.capture:
            positions = unpack_positions(capture.positions).astype(np.int32)
            for site in capture.sites:
                v = rng.standard_normal((len(positions), hidden), dtype=np.float32)
                if values == "bfloat16":  # what a bf16 engine hands over: float32 with bf16's 16 bits
                    v.view(np.uint32)[...] &= np.uint32(0xFFFF0000)
                captures[site] = (positions, v)
        results[request.rid] = RequestResult(
            rid=request.rid, prompt_index=request.prompt.index, token_ids=[1], text="x", logprobs=[-0.5],
            captures=captures,
        )
    return results


def spot_check(path: Path, plan, results: dict) -> dict:
    """Read the store back: the capture's shape and dtype, and a few values where they must have landed."""
    import xarray as xr

    from interp_runner.sites import site_id

    ds = xr.open_zarr(str(path), consolidated=False)
    acts = ds[CAPTURE]
    layout = plan.captures[0]
    checked = 0
    for r in (0, len(plan.requests) - 1):
        request = plan.requests[r]
        for l in (0, len(layout.layers) - 1):
            positions, values = results[request.rid].captures[site_id(layout.layers[l], layout.hooks[0])]
            for slot in (0, len(positions) - 1):
                got = np.asarray(acts[r, 0, l, slot].values)
                want = values[slot].astype(acts.dtype)
                if layout.dtype == "bfloat16":  # rounded to bf16, kept as float32
                    import torch

                    want = torch.from_numpy(values[slot]).bfloat16().float().numpy()
                if not np.array_equal(got, want):
                    raise RuntimeError(f"store holds other values at request {r}, layer {l}, slot {slot}")
                checked += 1
    return {"shape": list(acts.shape), "dtype": str(acts.dtype), "stored_dtype": acts.attrs.get("stored_dtype"),
            "values_checked": checked}


# -- store ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def variant(name: str | None):
    """Diagnostic settings around ``write_results``: the captures' compressor, or zarr's concurrency."""
    if name is None:
        yield
        return
    chunks_in_flight = concurrency_of(name)
    if chunks_in_flight:
        import zarr

        with zarr.config.set({"async.concurrency": chunks_in_flight}):
            yield
        return
    import xarray as xr

    compressors = COMPRESSORS[name]
    original = xr.Dataset.to_zarr

    def to_zarr(self, *args, encoding=None, **kwargs):  # write_results sets an encoding for captures only
        encoding = {k: {**v, "compressors": compressors} for k, v in (encoding or {}).items()}
        return original(self, *args, encoding=encoding, **kwargs)

    xr.Dataset.to_zarr = to_zarr
    try:
        yield
    finally:
        xr.Dataset.to_zarr = original


def store_once(folder: Path, plan, results: dict, hidden: int, name: str | None = None, check: bool = False,
               profile: bool = False) -> dict:
    from interp_runner.kinds.prompts import KIND
    from interp_runner.store.writer import open_store, write_results

    path = folder / "results.zarr"
    shutil.rmtree(path, ignore_errors=True)
    open_store(path, {"schema": "interp-runner/1", "bench": "store_bandwidth"})
    fsync_tree(path)
    t0 = time.perf_counter()
    ds = KIND.dataset(plan, results, hidden)
    build = time.perf_counter() - t0
    logical = int(ds[CAPTURE].nbytes)
    profiler = cProfile.Profile() if profile else None
    threads = ThreadTimes() if profile else contextlib.nullcontext()
    try:
        with variant(name), threads:
            t0 = time.perf_counter()
            if profiler:
                profiler.enable()
            write_results(path, ds)
            written = time.perf_counter() - t0
            on_disk = fsync_tree(path)
            seconds = time.perf_counter() - t0
            if profiler:
                profiler.disable()
        del ds
        out = {
            "variant": name or "product", "build_s": build, "write_s": written, "seconds": seconds,
            "bytes": on_disk, "capture_bytes": tree_bytes(path, CAPTURE), "logical_bytes": logical,
            "mb_s": on_disk / seconds / 1e6, "logical_mb_s": logical / seconds / 1e6,
        }
        if check:
            import zarr

            array = zarr.open_array(str(path / CAPTURE), mode="r")
            out["capture_chunks"] = list(array.chunks)
            out["capture_codecs"] = [c.to_dict() for c in array.metadata.codecs]
            out["read_back"] = spot_check(path, plan, results)
        if profile:
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats("cumulative").print_stats(18)
            stats.sort_stats("tottime").print_stats(12)
            out["profile"] = text.getvalue()
            out["thread_times"] = threads.summary()
        return out
    finally:
        shutil.rmtree(path, ignore_errors=True)


class ThreadTimes:
    """Adds up the wall time spent in zarr's and numcodecs' workhorse functions, whatever thread runs them
    (cProfile sees only the calling thread, which waits on zarr's event loop)."""

    def __init__(self):
        self.spent = defaultdict(float)
        self.calls = defaultdict(int)
        self.lock = threading.Lock()
        self.patched = []

    def targets(self):
        import numcodecs
        import zarr.codecs.blosc as zblosc
        import zarr.codecs.bytes as zbytes
        import zarr.core.buffer.core as zbuffer
        import zarr.storage._local as zlocal

        return [(numcodecs.Zstd, "encode", "compress (numcodecs Zstd.encode)"),
                (zblosc.BloscCodec, "_encode_sync", "compress (BloscCodec)"),
                (zbytes.BytesCodec, "_encode_sync", "serialize (BytesCodec)"),
                (zbuffer.NDBuffer, "all_equal", "empty-chunk check (NDBuffer.all_equal)"),
                (zlocal, "_put", "file write (LocalStore _put)")]

    def __enter__(self):
        for owner, attr, label in self.targets():
            original = getattr(owner, attr, None)
            if original is None:
                continue
            self.patched.append((owner, attr, original))
            setattr(owner, attr, self._timed(original, label))
        return self

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self.patched):
            setattr(owner, attr, original)
        self.patched = []

    def _timed(self, fn, label):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.spent[label] += time.perf_counter() - t0
                    self.calls[label] += 1

        return timed

    def summary(self) -> dict:
        return {label: {"seconds_summed": self.spent[label], "calls": self.calls[label]} for label in self.spent}


# -- driver -----------------------------------------------------------------------------------------------


def median_of(runs: list[dict], key: str):
    values = [r[key] for r in runs if key in r]
    return statistics.median(values) if values else None


def summarize(result: dict) -> dict:
    dd = {}
    for mode, runs in result["dd"].items():
        ok = [r for r in runs if "error" not in r]
        if ok:
            dd[mode] = {"seconds": median_of(ok, "seconds"), "bytes": ok[0]["bytes"], "mb_s": median_of(ok, "mb_s"),
                        "dd_mb_s": median_of(ok, "dd_mb_s"), "runs": len(ok)}
        else:
            dd[mode] = {"error": runs[0]["error"] if runs else "not run"}
    stores = {}
    for name, runs in result["store"].items():
        stores[name] = {key: median_of(runs, key) for key in
                        ("seconds", "write_s", "build_s", "bytes", "logical_bytes", "mb_s", "logical_mb_s")}
        stores[name]["runs"] = len(runs)
    rates = [d["mb_s"] for d in dd.values() if "mb_s" in d]
    best = max(rates) if rates else None
    product = stores.get("product")
    verdict = {}
    if best and product:
        verdict = {"dd_best_mb_s": best, "ratio_on_disk": product["mb_s"] / best,
                   "ratio_logical": product["logical_mb_s"] / best, "goal": GOAL}
        verdict["met_on_disk"] = verdict["ratio_on_disk"] >= GOAL
        verdict["met_logical"] = verdict["ratio_logical"] >= GOAL
    return {"dd": dd, "store": stores, "verdict": verdict}


def table(result: dict) -> str:
    summary = result["summary"]
    dd = summary["dd"]
    modes = [m for m in dd if "mb_s" in dd[m]]
    best = summary["verdict"].get("dd_best_mb_s")
    head = ("what", "median s", "MB", "MB/s") + tuple(f"vs dd {m}" for m in modes) + ("goal", "met?", "runs")
    rows = [head]
    for mode, d in dd.items():
        if "error" in d:
            rows.append((f"dd {DD_FLAGS[mode]}", d["error"][:60], "", "") + ("",) * len(modes) + ("", "", "0"))
            continue
        rows.append((f"dd {DD_FLAGS[mode]}", f"{d['seconds']:.3f}", f"{d['bytes'] / 1e6:.0f}", f"{d['mb_s']:.0f}")
                    + tuple(f"{d['mb_s'] / dd[m]['mb_s']:.2f}" for m in modes) + ("", "", str(d["runs"])))

    def store_row(label, seconds, size, goal):
        rate = size / seconds / 1e6
        met = ("yes" if rate / best >= GOAL else "NO") if goal and best else ""
        return ((label, f"{seconds:.3f}", f"{size / 1e6:.0f}", f"{rate:.0f}")
                + tuple(f"{rate / dd[m]['mb_s']:.2f}" for m in modes)
                + (f">={GOAL:.2f}" if goal and best else "", met))

    for name, s in summary["store"].items():
        tag = "store" if name == "product" else f"diag {name}" + (f"={CONCURRENCY}" if name == "concurrency" else "")
        goal = name == "product"
        rows.append(store_row(f"{tag}: write+fsync, on disk", s["seconds"], s["bytes"], goal) + (str(s["runs"]),))
        rows.append(store_row(f"{tag}: write+fsync, logical", s["seconds"], s["logical_bytes"], goal)
                    + (str(s["runs"]),))
        if name == "product":
            rows.append(store_row("store: build (dataset)", s["build_s"], s["logical_bytes"], False)
                        + (str(s["runs"]),))
            rows.append(store_row("store: build + write, logical", s["build_s"] + s["seconds"], s["logical_bytes"],
                                  False) + (str(s["runs"]),))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    notes = []
    if best:
        notes.append(f"goal: store MB/s >= {GOAL:.0%} of the best dd mode ({best:.0f} MB/s); MB = 10^6 bytes")
    codecs = result.get("capture_codecs")
    if codecs:
        notes.append(f"capture codecs: {json.dumps(codecs, separators=(',', ':'))}; chunks {result['capture_chunks']}")
    return "\n".join(lines + notes)


def default_dir() -> Path:
    out = os.environ.get("OUT")
    return Path(out) if out else Path(tempfile.gettempdir())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="", help="filesystem to measure (default: $OUT if set, else the temp dir); "
                                               "a scratch folder is made and removed in it")
    ap.add_argument("--gib", type=float, default=2.0, help="dd file size in GiB")
    ap.add_argument("--shape", default="64,512,28,1024", help="requests,positions,layers,hidden")
    ap.add_argument("--hook", default="post_block")
    ap.add_argument("--capture-dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                    help="the capture entry's dtype (the store keeps bfloat16 as float32)")
    ap.add_argument("--values", choices=["bfloat16", "float32"], default="bfloat16",
                    help="precision of the synthetic activations (a bf16 engine hands over bf16 values)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dd-modes", default="fdatasync,direct", help="comma list of fdatasync, direct")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"diagnostic writes, comma list of {', '.join(VARIANTS)} ('' for none)")
    ap.add_argument("--profile", action="store_true", help="one more product write under cProfile, printed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="write all numbers here")
    args = ap.parse_args(argv)

    shape = tuple(int(x) for x in args.shape.split(","))
    if len(shape) != 4 or min(shape) < 1:
        ap.error("--shape: requests,positions,layers,hidden")
    modes = [m for m in args.dd_modes.split(",") if m]
    variants = [v for v in args.variants.split(",") if v]
    if set(modes) - set(DD_FLAGS) or {v for v in variants if v not in VARIANTS and not concurrency_of(v)}:
        ap.error(f"--dd-modes from {', '.join(DD_FLAGS)}; --variants from {', '.join(VARIANTS)}, concurrency-N")
    base = Path(args.dir) if args.dir else default_dir()
    base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="store-bandwidth-", dir=base))

    if args.capture_dtype == "bfloat16":
        import torch  # noqa: F401  (the dataset build rounds with it: imported here, outside the timed build)
    t0 = time.perf_counter()
    plan, facts = synthetic_plan(shape, args.hook, args.capture_dtype)
    results = synthetic_results(plan, facts.hidden_size, args.values, args.seed)
    synth_s = time.perf_counter() - t0
    result = {
        "shape": dict(zip(("requests", "positions", "layers", "hidden"), shape)), "hook": args.hook,
        "capture_dtype": args.capture_dtype, "values": args.values, "repeats": args.repeats, "gib": args.gib,
        "filesystem": filesystem(scratch), "cpus": os.cpu_count(), "synthesis_s": synth_s,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "concurrency_variant": CONCURRENCY,
        "dd": {m: [] for m in modes}, "store": {"product": []},
    }
    try:
        import xarray
        import zarr

        result["versions"] = {"zarr": zarr.__version__, "xarray": xarray.__version__,
                              "async.concurrency": zarr.config.get("async.concurrency")}
        print(f"capture {shape} -> {plan.captures[0].dtype}, {len(plan.requests)} requests; synthesized in "
              f"{synth_s:.1f} s; measuring in {scratch}", flush=True)
        for r in range(args.repeats):
            for mode in modes:
                result["dd"][mode].append(dd_once(scratch, args.gib, mode))
            run = store_once(scratch, plan, results, facts.hidden_size, check=(r == 0))
            if r == 0:
                for key in ("capture_chunks", "capture_codecs", "read_back"):
                    result[key] = run.pop(key)
            result["store"]["product"].append(run)
            print(f"repeat {r}: " + ", ".join(
                f"dd {m} {runs[-1].get('mb_s', float('nan')):.0f} MB/s" for m, runs in result["dd"].items())
                + f", store {run['mb_s']:.0f} MB/s on disk, {run['logical_mb_s']:.0f} MB/s logical", flush=True)
        for name in variants:
            result["store"][name] = [store_once(scratch, plan, results, facts.hidden_size, name=name)
                                     for _ in range(args.repeats)]
            print(f"diagnostic {name}: {statistics.median(r['logical_mb_s'] for r in result['store'][name]):.0f} "
                  f"MB/s logical", flush=True)
        if args.profile:
            profiled = store_once(scratch, plan, results, facts.hidden_size, profile=True)
            result["profile"] = profiled
            print(profiled["profile"])
            print(f"write {profiled['seconds']:.3f} s (under the profiler); time summed over zarr's threads:")
            for label, t in sorted(profiled["thread_times"].items(), key=lambda kv: -kv[1]["seconds_summed"]):
                print(f"  {label:42s} {t['seconds_summed']:8.3f} s in {t['calls']} calls")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        result["summary"] = summarize(result)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
