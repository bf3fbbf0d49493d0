"""Opening a finished store's arrays for reading (``interp-verify``, ``interp-report``): an array whose metadata zarr
cannot load (an unknown codec, a malformed ``zarr.json``) is an ``UnreadableStore`` naming it.

zarr loads a group's members concurrently and abandons the other loads when one fails: their errors surface later
as pages of asyncio "Task exception was never retrieved". Each array's metadata is therefore loaded on its own,
one after another, before xarray lists the group.
"""

from __future__ import annotations

from pathlib import Path


class UnreadableStore(Exception):
    """A store, or one of its arrays, that cannot be read; the message names it."""


def member_names(path: Path) -> list[str]:
    """The arrays and groups directly under the store (folders holding a ``zarr.json``), read from the disk."""
    try:
        return sorted(p.name for p in Path(path).iterdir() if (p / "zarr.json").is_file())
    except OSError as err:
        raise UnreadableStore(f"{path}: cannot list its arrays ({err})") from None


def check_metadata(path: Path) -> dict:
    """Load the root group and then each array's metadata, one at a time; the first that fails is an
    ``UnreadableStore`` naming the array. The root attributes."""
    import zarr

    path = Path(path)
    try:
        group = zarr.open_group(str(path), mode="r")
    except Exception as err:  # zarr raises several kinds for a missing or foreign folder
        raise UnreadableStore(f"{path}: not a readable zarr store ({_why(err)})") from None
    for name in member_names(path):
        try:
            group[name]
        except Exception as err:  # an unknown codec, a malformed zarr.json, ...
            raise UnreadableStore(f"{path}: array {name!r} cannot be read ({_why(err)})") from None
    return dict(group.attrs)


def open_dataset(path: Path):
    """The store's arrays as a lazy ``xarray.Dataset``; ``UnreadableStore`` for an array zarr cannot load."""
    import xarray as xr

    check_metadata(path)
    try:
        return xr.open_zarr(str(path), consolidated=False)
    except Exception as err:  # zarr and xarray raise several kinds for arrays they cannot read
        raise UnreadableStore(f"{path}: cannot read its arrays ({_why(err)})") from None


def _why(err: Exception) -> str:
    return f"{type(err).__name__}: {err}".replace("\n", " ")
