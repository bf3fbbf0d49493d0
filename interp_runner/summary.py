"""A short human summary of a finished store: a header, the lines its experiment kind gives, where its figures,
exports, log, report and the store itself are (each path once)."""

from __future__ import annotations

from pathlib import Path

import xarray as xr

from interp_runner.kinds import kind_of_store
from interp_runner.store.result_flags import nonfinite_lines
from interp_runner.store.claim import StoreTarget


def print_summary(store: Path) -> None:
    ds = xr.open_zarr(str(store), consolidated=False)
    attrs = ds.attrs
    print(f"\n{attrs['experiment']['name']} v{attrs['experiment']['version']}  status={attrs['status']}  "
          f"model={Path(attrs['model']['path']).name} ({attrs.get('engine', {}).get('dtype')})")
    for line in [*kind_of_store(attrs).summary(ds), *nonfinite_lines(attrs)]:
        print(f"  {line}")
    for what in ("figures", "exports"):
        for path in attrs.get(what, [])[:1]:
            print(f"  {what}: {Path(path).parent}")
    target = StoreTarget.at(store)
    if target.log.exists():
        print(f"log: {target.log}")  # vLLM's, torch's and transformers' lines (``interp_runner.run_log``)
    if target.report.exists():
        print(f"report: {target.report}")
    print(f"store: {store}")
