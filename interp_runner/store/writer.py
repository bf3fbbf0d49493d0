"""The zarr (v3) store of a run: results as named-dimension arrays (xarray) plus a provenance manifest.

The arrays are the experiment kind's: each kind's module under ``interp_runner.kinds`` documents those its
``dataset`` writes. Root attributes hold the manifest (``interp_runner.store.provenance``, the kind's name included) and
``status``: ``running`` while the run goes, ``complete`` only after every array was written, ``failed`` (with
``error``) otherwise.
"""

from __future__ import annotations

import os
from pathlib import Path

import xarray as xr
import zarr
from zarr.codecs import BloscCodec

STATUS_RUNNING, STATUS_COMPLETE, STATUS_FAILED = "running", "complete", "failed"


def open_store(path: Path, manifest: dict) -> zarr.Group:
    """Create the store, marked running, with the manifest written first; never replaces one (where a run writes
    its store, and what it may replace, is ``interp_runner.store.claim``'s)."""
    group = zarr.open_group(str(path), mode="w-", zarr_format=3)
    group.attrs.update({"status": STATUS_RUNNING, **manifest})
    return group


def mark(path: Path, status: str, **attrs) -> None:
    group = zarr.open_group(str(path), mode="r+")
    group.attrs.update({"status": status, **attrs})


def write_results(path: Path, ds: xr.Dataset) -> None:
    """The dataset's arrays into the store, replacing any an earlier attempt of the run wrote (a resumed run whose
    figures failed after its arrays were written)."""
    group = zarr.open_group(str(path), mode="r+")
    for name in list(group.array_keys()):
        del group[name]
    encoding = {}
    for name, var in ds.data_vars.items():
        if var.ndim == 5:  # captures: one chunk per (request, hook), all layers and positions
            # lz4 with byte shuffle: lossless, compresses activations as well as zstd at several times its speed
            # every chunk written as is: zarr's check for all-fill chunks scans each one serially in its event loop
            encoding[name] = {"chunks": (1, 1) + var.shape[2:],
                              "compressors": (BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),),
                              "write_empty_chunks": True}
    # to_zarr replaces the root attributes with the dataset's: carry the manifest over
    ds = ds.assign_attrs({**dict(group.attrs), **ds.attrs})
    # chunks in flight at once: at least one per core (zarr's default is 10), so compression keeps pace with disk
    with zarr.config.set({"async.concurrency": max(os.cpu_count() or 1, zarr.config.get("async.concurrency"))}):
        ds.to_zarr(str(path), mode="a", zarr_format=3, consolidated=False, encoding=encoding)

