"""A finished store as ``interp-verify`` reads it: its arrays, its manifest and what the manifest says it ran."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from interp_runner.kinds import kind_of_store
from interp_runner.store.read import UnreadableStore, check_metadata, open_dataset

EXIT_MATCH, EXIT_MISMATCH, EXIT_ERROR = 0, 1, 2


class VerifyError(Exception):
    """No comparison possible (exit 2)."""


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

        try:  # safe_load: a python tag in a store's config is refused, never run
            config = yaml.safe_load(self.attrs.get("config_yaml") or "{}") or {}
        except yaml.YAMLError as err:
            raise VerifyError(f"{self.path}: its config_yaml is not plain YAML ({err})".replace("\n", " ")) from None
        if not isinstance(config, dict):
            raise VerifyError(f"{self.path}: its config_yaml is not a mapping")
        return config

    @cached_property
    def kind(self):
        """The experiment kind that wrote the store (``interp_runner.kinds``)."""
        try:
            return kind_of_store(self.attrs)
        except LookupError as err:
            raise VerifyError(f"{self.path}: {err}") from None

    @property
    def batch_invariant(self) -> bool:
        return bool((self.config.get("engine") or {}).get("batch_invariant", False))

    @property
    def compute_dtype(self) -> str:
        """The dtype the engine computed in (``engine.dtype``, written at the end); the configured one for a store
        without it."""
        return (self.attrs.get("engine") or {}).get("dtype") or (self.attrs.get("model") or {}).get("dtype") or ""

    @property
    def greedy(self) -> bool:
        return float((self.config.get("sampling") or {}).get("temperature", 0.0) or 0.0) == 0.0

    def teacher_forced_by(self, other: Store) -> bool:
        """Whether this run's generated tokens were forced to ``other``'s (``sampling.teacher_forcing``)."""
        source = (self.config.get("sampling") or {}).get("teacher_forcing")
        return bool(source) and Path(source).resolve() == other.path.resolve()


def open_store(path: Path) -> Store:
    """Open a finished store; refuse one that is missing, not ``complete`` or with an array zarr cannot load."""
    path = Path(path)
    try:  # array by array: a failure names its array, and leaves no zarr task behind
        attrs = check_metadata(path)
    except UnreadableStore as err:
        raise VerifyError(str(err)) from None
    status = attrs.get("status")
    if status != "complete":
        why = f": {attrs['error']}" if attrs.get("error") else ""
        raise VerifyError(f"{path}: status is {status!r}, not 'complete'{why}; only finished stores can be verified")
    try:  # zarr has no codec that unpickles: an object array is refused here
        ds = open_dataset(path)
    except UnreadableStore as err:
        raise VerifyError(str(err)) from None
    return Store(path, ds, attrs)


def check_readable(store: Store) -> None:
    """Read every array once: a chunk that does not decode is a VerifyError naming its array."""
    from interp_runner.verify.arrays import slabs

    for name in [*store.ds.data_vars, *store.ds.coords]:
        try:
            for _, slab in slabs(store.ds[name]):
                slab.values
        except Exception as err:  # the codecs raise several kinds for a chunk they cannot decode
            raise VerifyError(f"{store.path}: array {str(name)!r} cannot be read ({type(err).__name__}: {err})"
                              ) from None
