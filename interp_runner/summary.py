"""A short human summary of a finished store."""

from __future__ import annotations

from pathlib import Path

import xarray as xr


def print_summary(store: Path, max_rows: int = 8) -> None:
    ds = xr.open_zarr(str(store), consolidated=False)
    attrs = ds.attrs
    print(f"\n{attrs['experiment']['name']} v{attrs['experiment']['version']}  status={attrs['status']}  "
          f"model={Path(attrs['model']['path']).name} ({attrs.get('engine', {}).get('dtype')})")
    for i in range(min(ds.sizes["request"], max_rows)):
        prompt = str(ds["prompt"].values[i])
        text = str(ds["text"].values[i])
        mean_lp = float(ds["logprob"].isel(request=i).mean(skipna=True))
        print(f"  [{ds['prompt_id'].values[i]}] {prompt!r} -> {text!r}  (mean logprob {mean_lp:.3f})")
    if ds.sizes["request"] > max_rows:
        print(f"  ... {ds.sizes['request'] - max_rows} more")
    captured = [name for name, v in ds.data_vars.items() if v.ndim == 5]
    for name in captured:
        print(f"  capture {name}: {dict(ds[name].sizes)}")
    print(f"store: {store}")
