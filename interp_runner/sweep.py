"""Hydra multirun sweeps: an index of the jobs' stores in the sweep folder, and the whole sweep as one dataset.

``<sweep dir>/sweep.json``: ``{"jobs": [{"num", "overrides", "store", "status"}]}``, one entry per job, written
under a file lock as each job ends (launchers may run jobs in parallel processes), and ``<sweep dir>/index.html``
beside it, the page ``interp_runner.report.sweep_index`` makes of it (handed in as ``on_recorded``: this module
imports nothing of the report).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import yaml

INDEX = "sweep.json"


def record_job(sweep_dir: Path, num: int, overrides: list[str], store: Path | None, status: str,
               on_recorded: Callable[[Path, list[dict]], object] | None = None) -> None:
    """Adds (or replaces) job ``num`` in the sweep's index; ``on_recorded(sweep_dir, jobs)`` runs under the same lock,
    so pages made of the index follow its order of writes."""
    from filelock import FileLock

    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    index = sweep_dir / INDEX
    with FileLock(str(index) + ".lock"):
        jobs = json.loads(index.read_text())["jobs"] if index.exists() else []
        jobs = [j for j in jobs if j["num"] != num]
        entry = {"num": num, "overrides": list(overrides), "status": status,
                 "store": None if store is None else _relative(Path(store), sweep_dir)}
        jobs = sorted(jobs + [entry], key=lambda j: j["num"])
        tmp = index.with_suffix(".tmp")
        tmp.write_text(json.dumps({"jobs": jobs}, indent=1))
        tmp.replace(index)
        if on_recorded is None:
            return
        try:  # a job's result never depends on its page: `interp-report SWEEP_DIR` writes it again
            on_recorded(sweep_dir, jobs)
        except Exception as err:
            print(f"warning: the sweep's index page was not written ({type(err).__name__}: {err}); "
                  f"`interp-report {sweep_dir}` writes it", file=sys.stderr)


def read_jobs(sweep_dir: Path) -> list[dict]:
    return json.loads((Path(sweep_dir) / INDEX).read_text())["jobs"]


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())


def _value(text: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def swept_parameters(jobs: list[dict]) -> dict[str, list]:
    """Override keys whose value differs between jobs -> the value of each job (None where a job lacks it)."""
    per_job = [dict(o.split("=", 1) for o in job["overrides"] if "=" in o) for job in jobs]
    keys = sorted({k for overrides in per_job for k in overrides})
    return {k: [_value(o[k]) if k in o else None for o in per_job]
            for k in keys if len({o.get(k) for o in per_job}) > 1}


def open_sweep(path):
    """Every complete job's store of a sweep folder as one xarray Dataset along dim ``job``, with the swept
    parameters as coordinates on it (``job_num``, and one per swept override key)."""
    import xarray as xr

    sweep_dir = Path(path)
    jobs = [j for j in read_jobs(sweep_dir) if j["status"] == "complete"]
    if not jobs:
        raise FileNotFoundError(f"{sweep_dir / INDEX} lists no complete job")
    datasets = []
    for job in jobs:
        store = Path(job["store"]) if Path(job["store"]).is_absolute() else sweep_dir / job["store"]
        ds = xr.open_zarr(str(store), consolidated=False)
        # dims without coordinates get positions, so stores of different sizes align (padded with NaN)
        ds = ds.assign_coords({d: np.arange(n) for d, n in ds.sizes.items() if d not in ds.coords})
        datasets.append(ds)
    combined = xr.concat(datasets, dim="job", join="outer", combine_attrs="drop_conflicts",
                         data_vars="all", coords="different", compat="equals")
    coords = {"job_num": ("job", [j["num"] for j in jobs])}
    for key, values in swept_parameters(jobs).items():
        coords[key.lstrip("+")] = ("job", np.array([str(v) if isinstance(v, (list, dict)) else v for v in values],
                                                   dtype=object if any(v is None for v in values) else None))
    return combined.assign_coords(coords)
