"""``interp-verify``: does a store reproduce? Compare it with a golden store, or rerun it from its own provenance.

    interp-verify STORE --against GOLDEN     compare two finished stores
    interp-verify STORE --rerun [--out DIR]  rerun STORE's resolved config (same model, checked first), compare

Every data variable and coordinate must exist in both stores with the same dims, shape and dtype. Values:

- exact (NaN equals NaN, and NaN only matches NaN) when both runs were on CPU, or both on the same GPU model(s)
  with ``engine.batch_invariant``; always for integer, boolean and string arrays (a flipped token or flag is a
  changed result);
- otherwise (a GPU without batch invariance: results depend on what each request was batched with) float arrays
  may differ by a tolerance tied to the runs' measured noise: probabilities (``*_prob``) by the larger recorded
  ``noise_floor`` of the two stores (itself the largest |in-batch - solo| probability of one run), differences of
  probabilities (``*effect``) by twice that, never less than 1e-6; other floats (log-probabilities, logit
  differences, ratios, activations, or probabilities of a run without a noise floor) by ``rtol`` times the
  array's largest finite |value|, with ``rtol`` from the engine's compute dtype (``RTOL``).

Provenance differences (library versions, model weights, host, git sha, plugin fingerprint, request and config
hashes) are printed as information. Exit 0 when every result array matches, 1 on any mismatch (a missing or extra
array included), 2 when no comparison could be made (usage, unreadable or unfinished store, other weights, a
config that no longer validates, a rerun that failed).
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

EXIT_MATCH, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2

# root attributes written by the provenance manifest and the run's status, not results
MANIFEST_KEYS = frozenset({
    "schema", "config_yaml", "config_sha256", "command", "overrides", "experiment", "experiments_dir", "package",
    "versions", "model", "seeds", "requests_sha256", "num_requests", "plugin", "host", "started_at",
    "finished_at", "status", "error", "engine", "figures",
})
# relative tolerance of non-probability floats off batch-invariant GPUs, by the engine's compute dtype
RTOL = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
MIN_PROB_ATOL = 1e-6
BLOCK_ELEMENTS = 1 << 24  # compare large arrays in slabs of about this many elements


class VerifyError(Exception):
    """No comparison possible (exit 2)."""


# ------------------------------------------------------------------ stores


@dataclass
class Store:
    path: Path
    ds: object  # xarray.Dataset
    attrs: dict

    @property
    def on_gpu(self) -> bool:
        return bool((self.attrs.get("host") or {}).get("gpus"))

    @property
    def config(self) -> dict:
        import yaml

        return yaml.safe_load(self.attrs.get("config_yaml") or "{}") or {}

    @property
    def batch_invariant(self) -> bool:
        return bool((self.config.get("engine") or {}).get("batch_invariant", False))

    @property
    def compute_dtype(self) -> str:
        return (self.attrs.get("engine") or {}).get("dtype") or (self.attrs.get("model") or {}).get("dtype") or ""


def open_store(path: Path) -> Store:
    """Open a finished store; refuse one that is missing or not ``complete``."""
    import xarray as xr
    import zarr

    path = Path(path)
    try:
        attrs = dict(zarr.open_group(str(path), mode="r").attrs)
    except Exception as err:  # zarr raises several kinds for a missing or foreign folder
        raise VerifyError(f"{path}: not a readable zarr store ({type(err).__name__}: {err})") from None
    status = attrs.get("status")
    if status != "complete":
        why = f": {attrs['error']}" if attrs.get("error") else ""
        raise VerifyError(f"{path}: status is {status!r}, not 'complete'{why}; only finished stores can be verified")
    return Store(path, xr.open_zarr(str(path), consolidated=False), attrs)


# ------------------------------------------------------------------ tolerance


@dataclass(frozen=True)
class Tolerance:
    exact: bool
    reason: str
    noise_floor: float | None = None  # the larger recorded noise floor of the two stores
    rtol: float = 0.0

    def atol(self, name: str, kind: str, scale: Callable[[], float]) -> tuple[float, str]:
        """(allowed |difference|, how it was chosen) for a float array; 0 when exact."""
        if self.exact:
            return 0.0, "exact"
        if self.noise_floor is not None and kind in ("probability", "probability difference"):
            factor = 2.0 if kind == "probability difference" else 1.0
            return max(factor * self.noise_floor, MIN_PROB_ATOL), f"{factor:g} x noise floor"
        return self.rtol * scale(), f"rtol {self.rtol:g} x scale"

    def describe(self) -> str:
        if self.exact:
            return f"exact ({self.reason})"
        scaled = f"within {self.rtol:g} x the array's largest |value|"
        if self.noise_floor is None:
            floats = f"floats {scaled} (no noise floor recorded)"
        else:
            floats = (f"probabilities within max(noise floor {self.noise_floor:.3g}, {MIN_PROB_ATOL:g}), "
                      f"differences of probabilities within twice that, other floats {scaled}")
        return f"tolerant ({self.reason}): {floats}; integers, booleans and strings exact"


def value_kind(name: str) -> str:
    """How a float array's values scale: probabilities, differences of probabilities, or anything else."""
    if "logprob" in name or "logit" in name:
        return "other"
    if name.endswith("_prob") or name == "prob":
        return "probability"
    if name.endswith("effect"):
        return "probability difference"
    return "other"


def choose_tolerance(new: Store, ref: Store, exact: bool = False) -> Tolerance:
    if exact:
        return Tolerance(True, "--exact")
    if not new.on_gpu and not ref.on_gpu:
        return Tolerance(True, "both runs on CPU")
    gpus = [tuple(s.attrs["host"].get("gpus") or ()) for s in (new, ref)]
    if new.batch_invariant and ref.batch_invariant and gpus[0] == gpus[1]:
        return Tolerance(True, f"batch-invariant runs on {', '.join(gpus[0])}")
    if new.on_gpu != ref.on_gpu:
        reason = "one run on GPU, one on CPU"
    elif new.batch_invariant and ref.batch_invariant:
        reason = "batch-invariant runs, but on different GPUs"
    else:
        reason = "GPU runs without engine.batch_invariant"
    floors = [s.attrs["noise_floor"] for s in (new, ref) if isinstance(s.attrs.get("noise_floor"), (int, float))]
    dtypes = [s.compute_dtype for s in (new, ref)]
    rtol = max(RTOL.get(d, max(RTOL.values())) for d in dtypes)
    return Tolerance(False, reason, max(floors) if floors else None, rtol)


# ------------------------------------------------------------------ arrays


@dataclass
class Difference:
    name: str
    role: str  # data | coord
    note: str  # what differs
    max_abs: float | None = None
    max_rel: float | None = None
    where: str = ""  # the worst (float) or first (exact) differing element, by dim
    values: str = ""
    allowed: str = ""
    tolerated: bool = False  # differs, but within the tolerance


def _slabs(var) -> Iterator[tuple[int, object]]:
    """(offset along the first dim, slab) covering ``var`` in pieces of about BLOCK_ELEMENTS elements."""
    if var.ndim == 0 or var.size <= BLOCK_ELEMENTS:
        yield 0, var
        return
    step = max(1, BLOCK_ELEMENTS // max(1, var.size // var.shape[0]))
    for start in range(0, var.shape[0], step):
        yield start, var.isel({var.dims[0]: slice(start, start + step)})


def _where(var, index: tuple[int, ...]) -> str:
    parts = []
    for dim, i in zip(var.dims, index):
        label = ""
        if dim in var.coords and var.coords[dim].ndim == 1 and dim != var.name:
            value = var.coords[dim].values[i]
            label = f" ({value!r})" if isinstance(value, str) else f" ({value})"
        parts.append(f"{dim}={i}{label}")
    return ", ".join(parts) or "(scalar)"


def _fmt(x, width: int = 32) -> str:
    if isinstance(x, (float, np.floating)):
        return f"{float(x):.9g}"
    text = repr(x.item() if hasattr(x, "item") else x)
    return text if len(text) <= width else text[: width - 3] + "..."


def _is_float(dtype) -> bool:
    return np.dtype(dtype).kind in "fc"


def _is_numeric(dtype) -> bool:
    return np.dtype(dtype).kind in "iufcb"


def compare_variable(name: str, role: str, new, ref, tolerance: Tolerance) -> Difference | None:
    """None when the DataArray ``new`` matches ``ref`` (the reference: relative differences are to it)."""
    if new.dims != ref.dims:
        return Difference(name, role, f"dims {new.dims} vs {ref.dims}")
    if new.shape != ref.shape:
        return Difference(name, role, f"shape {new.shape} vs {ref.shape}")
    if new.dtype != ref.dtype and not (new.dtype.kind in "OTU" and ref.dtype.kind in "OTU"):
        return Difference(name, role, f"dtype {new.dtype} vs {ref.dtype}")
    if new.size == 0:
        return None
    if not _is_float(new.dtype):
        return _compare_exact(name, role, new, ref)

    kind = value_kind(name)

    def scale() -> float:
        peak = 0.0
        for _, slab in _slabs(ref):
            v = np.abs(slab.values.astype(np.float64))
            v = v[np.isfinite(v)]
            peak = max(peak, float(v.max(initial=0.0)))
        return peak

    atol, how = tolerance.atol(name, kind, scale)
    worst, worst_at, worst_pair, max_rel, over, differing = -1.0, None, None, 0.0, 0, 0
    for (start, new_slab), (_, ref_slab) in zip(_slabs(new), _slabs(ref)):
        a = np.asarray(new_slab.values, dtype=np.complex128 if new.dtype.kind == "c" else np.float64)
        b = np.asarray(ref_slab.values, dtype=a.dtype)
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        diff = np.where(same, 0.0, np.abs(a - b))
        diff = np.where(np.isnan(diff), np.inf, diff)  # NaN against a number, or infinities of opposite sign
        with np.errstate(divide="ignore", invalid="ignore"):
            rel = np.where(diff == 0, 0.0, diff / np.abs(b))
        rel = np.where(np.isnan(rel), np.inf, rel)
        over += int((diff > atol).sum())
        differing += int((diff > 0).sum())
        max_rel = max(max_rel, float(rel.max()))
        at = np.unravel_index(int(np.argmax(diff)), diff.shape)
        if diff[at] > worst:
            worst = float(diff[at])
            worst_at = (at[0] + start,) + tuple(at[1:]) if diff.ndim else ()
            worst_pair = (a[at], b[at])
    if differing == 0:
        return None
    if not over:
        note = f"{differing} of {new.size} elements differ"
    else:
        note = f"{over} of {new.size} elements " + ("differ" if atol == 0 else "beyond tolerance")
    return Difference(
        name, role, note, worst, max_rel, _where(new, worst_at), f"{_fmt(worst_pair[1])} -> {_fmt(worst_pair[0])}",
        "exact" if atol == 0 else f"{atol:.3g} ({how})", tolerated=over == 0,
    )


def _compare_exact(name: str, role: str, new, ref) -> Difference | None:
    count, first, first_pair, max_abs = 0, None, None, None
    numeric = _is_numeric(new.dtype) and new.dtype.kind != "b"
    for (start, new_slab), (_, ref_slab) in zip(_slabs(new), _slabs(ref)):
        a, b = np.asarray(new_slab.values), np.asarray(ref_slab.values)
        unequal = np.asarray(a != b)
        n = int(unequal.sum())
        if not n:
            continue
        if numeric:
            gap = np.abs(a.astype(np.float64) - b.astype(np.float64))
            peak = float(gap.max())
            if max_abs is None or peak > max_abs:
                max_abs = peak
                at = np.unravel_index(int(np.argmax(gap)), gap.shape)
                first, first_pair = ((at[0] + start,) + tuple(at[1:]) if gap.ndim else ()), (a[at], b[at])
        elif first is None:
            at = tuple(int(i) for i in np.argwhere(unequal)[0])
            first, first_pair = ((at[0] + start,) + at[1:] if at else ()), (a[at], b[at])
        count += n
    if not count:
        return None
    return Difference(
        name, role, f"{count} of {new.size} elements differ", max_abs, None, _where(new, first),
        f"{_fmt(first_pair[1])} -> {_fmt(first_pair[0])}", "exact",
    )


# ------------------------------------------------------------------ provenance


PROVENANCE = (
    ("versions", lambda a: a.get("versions")),
    ("model.weights_sha256", lambda a: (a.get("model") or {}).get("weights_sha256")),
    ("host", lambda a: a.get("host")),
    ("package.git_sha", lambda a: (a.get("package") or {}).get("git_sha")),
    ("package.git_dirty", lambda a: (a.get("package") or {}).get("git_dirty")),
    ("plugin.fingerprint", lambda a: (a.get("plugin") or {}).get("fingerprint")),
    ("engine.dtype", lambda a: (a.get("engine") or {}).get("dtype")),
    ("requests_sha256", lambda a: a.get("requests_sha256")),
    ("config_sha256", lambda a: a.get("config_sha256")),
)


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: value}


def provenance_differences(new: Store, ref: Store) -> list[tuple[str, object, object]]:
    """(key, reference value, new value) for each provenance entry that differs; dicts key by key."""
    out = []
    for key, get in PROVENANCE:
        a, b = get(ref.attrs), get(new.attrs)
        if isinstance(a, dict) or isinstance(b, dict):
            fa, fb = _flat(a or {}, key), _flat(b or {}, key)
            out += [(k, fa.get(k), fb.get(k)) for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]
        elif a != b:
            out.append((key, a, b))
    if ref.attrs.get("config_sha256") != new.attrs.get("config_sha256"):
        fa, fb = _flat(ref.config, "config"), _flat(new.config, "config")
        out += [(k, fa.get(k), fb.get(k)) for k in sorted(fa.keys() | fb.keys()) if fa.get(k) != fb.get(k)]
    return out


def result_attribute_differences(new: Store, ref: Store) -> list[tuple[str, object, object]]:
    """Root attributes that are results (noise floor, filtered facts, voided requests, ...), shown as context:
    the arrays they summarize are compared already."""
    keys = (ref.attrs.keys() | new.attrs.keys()) - MANIFEST_KEYS
    return [(k, ref.attrs.get(k), new.attrs.get(k)) for k in sorted(keys) if ref.attrs.get(k) != new.attrs.get(k)]


# ------------------------------------------------------------------ comparison


@dataclass
class Report:
    new: Store
    ref: Store
    tolerance: Tolerance
    differences: list[Difference] = field(default_factory=list)  # mismatches
    tolerated: list[Difference] = field(default_factory=list)  # differences within the tolerance
    provenance: list[tuple[str, object, object]] = field(default_factory=list)
    attributes: list[tuple[str, object, object]] = field(default_factory=list)
    compared: int = 0

    @property
    def ok(self) -> bool:
        return not self.differences


def compare(new: Store, ref: Store, exact: bool = False) -> Report:
    """Compare ``new`` with the reference ``ref``: every data variable and coordinate."""
    tolerance = choose_tolerance(new, ref, exact)
    report = Report(new, ref, tolerance)
    for role, names in (("data", lambda ds: ds.data_vars), ("coord", lambda ds: ds.coords)):
        new_names, ref_names = set(names(new.ds)), set(names(ref.ds))
        for name in sorted(ref_names - new_names):
            report.differences.append(Difference(str(name), role, f"missing from {new.path.name}"))
        for name in sorted(new_names - ref_names):
            report.differences.append(Difference(str(name), role, f"not in {ref.path.name}"))
        for name in sorted(new_names & ref_names):
            report.compared += 1
            found = compare_variable(str(name), role, new.ds[name], ref.ds[name], tolerance)
            if found is not None:
                (report.tolerated if found.tolerated else report.differences).append(found)
    report.provenance = provenance_differences(new, ref)
    report.attributes = result_attribute_differences(new, ref)
    return report


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _short(value, width: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def print_report(report: Report, out=None) -> None:
    p = lambda *a: print(*a, file=out or sys.stdout)  # noqa: E731
    p(f"reference: {report.ref.path}")
    p(f"compared:  {report.new.path}")
    p(f"comparison: {report.tolerance.describe()}")
    if report.provenance:
        p("\nprovenance differences (information only):")
        for key, a, b in report.provenance:
            p(f"  {key}: {_short(a)} -> {_short(b)}")
    if report.attributes:
        p("\nresult attributes that differ (their arrays are compared below):")
        for key, a, b in report.attributes:
            p(f"  {key}: {_short(a)} -> {_short(b)}")
    if report.tolerated:
        p("\nwithin tolerance:")
        _table(report.tolerated, p)
    if report.ok:
        p(f"\nOK: all {report.compared} arrays match" + (" (within tolerance)" if report.tolerated else ""))
        return
    one_sided = sum(1 for d in report.differences if d.note.startswith(("missing from", "not in")))
    p(f"\nMISMATCH: {len(report.differences) - one_sided} of {report.compared} arrays in both stores differ"
      + (f", {one_sided} in only one store" if one_sided else ""))
    _table(report.differences, p)


def _table(differences: list[Difference], p) -> None:
    header = ("array", "max abs diff", "max rel diff", "allowed", "where (worst)", "reference -> compared", "what")
    rows = [(f"{d.name}{' (coord)' if d.role == 'coord' else ''}", _num(d.max_abs), _num(d.max_rel), d.allowed or "-",
             d.where or "-", d.values or "-", d.note) for d in differences]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    p("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    for row in rows:
        p("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())


# ------------------------------------------------------------------ rerun


def _remap_experiments_dir(config, recorded: str | None, here: str, log: Callable[[str], None]):
    """Paths under the recorded checkout's ``experiments/`` read from this checkout's, so a store made elsewhere
    (a golden store in CI) reruns with the experiment data of the code being verified."""
    if not recorded or recorded == here:
        return config

    def walk(value):
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        if isinstance(value, str) and (value == recorded or value.startswith(recorded.rstrip("/") + "/")):
            return here + value[len(recorded.rstrip("/")):]
        return value

    remapped = walk(config)
    if remapped != config:
        log(f"paths under {recorded} read from {here}")
    return remapped


def rerun_config(store: Store, new_store: Path, log: Callable[[str], None] = print) -> dict:
    """The store's resolved config, writing to ``new_store``; refuses (VerifyError) other model weights."""
    from .config import ConfigError, validate_config
    from .config.schema import resolve_path
    from .models.facts import weights_sha256
    from .models.materialize import model_path
    from .provenance import EXPERIMENTS_DIR

    config = store.config
    if not config:
        raise VerifyError(f"{store.path}: no config_yaml in its provenance")
    config = _remap_experiments_dir(config, store.attrs.get("experiments_dir"), str(EXPERIMENTS_DIR), log)
    config["store"] = {**(config.get("store") or {}), "path": str(new_store)}
    config["dry_run"] = False
    try:
        cfg = validate_config(config)
    except ConfigError as err:
        raise VerifyError(f"{store.path}: its config no longer validates:\n  {err}".replace("\n", "\n  ")) from None
    if cfg.model.path:
        folder = resolve_path(cfg.model.path, Path.cwd())
    else:
        try:
            folder = model_path(cfg.model.name)
        except FileNotFoundError as err:
            raise VerifyError(f"model {cfg.model.name!r}: {err}") from None
    recorded = (store.attrs.get("model") or {}).get("weights_sha256")
    current = weights_sha256(folder) if (folder / "config.json").exists() else None
    if current is None:
        raise VerifyError(f"model folder {folder} is missing (config.json not found)")
    if recorded != current:
        raise VerifyError(
            f"{store.path} was made with model weights sha256 {recorded}; the rerun would load {folder} with "
            f"{current}: refusing to compare runs of different models"
        )
    return config


def rerun(store: Store, out: Path, log: Callable[[str], None] = print) -> Path:
    """Rerun ``store``'s experiment into ``out``/results.zarr; the new store's path."""
    from .config import ConfigError
    from .pipeline import run

    new_store = (out / "results.zarr").resolve()
    if new_store == store.path.resolve() or store.path.resolve() in new_store.parents:
        raise VerifyError(f"--out {out} would overwrite {store.path}")
    config = rerun_config(store, new_store, log)
    overrides = [*(store.attrs.get("overrides") or []), f"store.path={new_store}"]  # as the rerun really ran
    log(f"rerunning {store.path} ({(store.attrs.get('experiment') or {}).get('name')}) into {new_store}")
    try:
        path = run(config, out, overrides=overrides, log=log)
    except ConfigError as err:
        raise VerifyError(f"{store.path}: its config is refused:\n  {err}".replace("\n", "\n  ")) from None
    except Exception as err:  # the run itself failed: nothing to compare
        traceback.print_exc()
        raise VerifyError(f"rerun failed: {type(err).__name__}: {err}") from err
    return path


# ------------------------------------------------------------------ CLI


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="interp-verify",
        description="Check that a store reproduces: compare it with a golden store (--against) or rerun its "
                    "experiment from its own provenance and compare (--rerun). Exit 0: results match; 1: they "
                    "differ; 2: no comparison possible.",
    )
    ap.add_argument("store", type=Path, metavar="STORE", help="a finished store (results.zarr)")
    how = ap.add_mutually_exclusive_group(required=True)
    how.add_argument("--against", type=Path, metavar="GOLDEN", help="the reference store to compare STORE with")
    how.add_argument("--rerun", action="store_true", help="rerun STORE's config and compare the new store with it")
    ap.add_argument("--out", type=Path, metavar="DIR", help="with --rerun: folder for the new store (kept); default a temporary "
                    "folder, removed when the results match")
    ap.add_argument("--exact", action="store_true", help="compare every value exactly, whatever the devices")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as stop:  # argparse exits 2 on usage errors, 0 for --help
        return int(stop.code or 0)
    if args.out is not None and not args.rerun:
        print("interp-verify: error: --out needs --rerun", file=sys.stderr)
        return EXIT_ERROR
    temporary = None
    try:
        store = open_store(args.store)
        if args.rerun:
            out = args.out
            if out is None:
                out = temporary = Path(tempfile.mkdtemp(prefix="interp-verify-"))
            new, ref = open_store(rerun(store, out)), store
        else:
            new, ref = store, open_store(args.against)
        report = compare(new, ref, exact=args.exact)
    except VerifyError as err:
        print(f"interp-verify: error: {err}", file=sys.stderr)
        return EXIT_ERROR
    print()
    print_report(report)
    if temporary is not None:
        if report.ok:
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            print(f"\nthe rerun's store is kept for inspection: {temporary / 'results.zarr'}")
    return EXIT_MATCH if report.ok else EXIT_MISMATCH


if __name__ == "__main__":
    sys.exit(main())
