"""A vector derived by a ``steering_vectors`` run, read from its store by (method, hook, layer).

The layout that kind writes: data variable ``vector`` with dims (``method``, ``vector_hook``, ``vector_layer``,
``hidden``), coordinates ``method`` (str), ``vector_hook`` (str, ``interp_runner.sites.HOOKS``), ``vector_layer``
(int, 0-based decoder layer); ``degenerate`` (bool, its first three dims), where present, marks vectors that are
no direction, which are never read; the root attribute ``status`` is "complete" once every array is written.

Reading never runs code: the store must be zarr v3 (JSON metadata), and an array is read only if every codec it
names is a plain byte, compression or string codec (no pickle-based codec can be reached).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from interp_runner.config.errors import ConfigError

KIND = "steering_vectors"
DIMS = ("method", "vector_hook", "vector_layer", "hidden")
SAFE_CODECS = frozenset({"bytes", "transpose", "vlen-utf8", "vlen-bytes", "zstd", "blosc", "gzip", "crc32c",
                         "sharding_indexed"})


def _codec_names(node) -> set[str]:
    """Every codec name in a codec chain's description (sharding nests chains)."""
    if isinstance(node, dict):
        own = {node["name"]} if isinstance(node.get("name"), str) else set()
        return own.union(*(_codec_names(v) for v in node.values()))
    if isinstance(node, (list, tuple)):
        return set().union(*(_codec_names(v) for v in node))
    return set()


def _checked(arrays: dict, name: str, path: Path, at: str):
    if name not in arrays:
        raise ConfigError.at(at, f"{path} has no {name!r} array: not a {KIND} store (arrays: {sorted(arrays)})")
    array = arrays[name]
    unsafe = _codec_names([c.to_dict() for c in array.metadata.codecs]) - SAFE_CODECS
    if unsafe:
        raise ConfigError.at(at, f"{path}: array {name!r} uses codecs {sorted(unsafe)}, which are not read "
                                 f"(only {', '.join(sorted(SAFE_CODECS))})")
    return array


def _index(have: list, wanted, at: str, what: str, path: Path) -> int:
    if wanted not in have:
        raise ConfigError.at(at, f"{path} has no {what} {wanted!r} (has {have})")
    return have.index(wanted)


def read_store_vector(path: Path, method: str, hook: str, layer: int, where: str) -> np.ndarray:
    """The stored vector of ``method`` at (``hook``, ``layer``); ``where`` is the config key of the vector spec."""
    import zarr

    at = where + ".store"
    if not path.is_dir():
        raise ConfigError.at(at, f"{path} is not a store folder" if path.exists() else f"store not found: {path}")
    try:
        group = zarr.open_group(str(path), mode="r", zarr_format=3)
        attrs = dict(group.attrs)
        arrays = dict(group.arrays())
    except Exception as err:  # zarr raises several kinds for a folder that is no v3 group or has bad metadata
        raise ConfigError.at(at, f"{path} is not a zarr v3 store ({type(err).__name__}: {err})") from None
    if attrs.get("status") != "complete":
        raise ConfigError.at(at, f"{path} is not complete (status {attrs.get('status')!r}): a run that has not "
                                 "finished, or failed")
    kind = attrs.get("kind")  # the manifest's experiment kind (stores from before kinds were recorded lack it)
    if kind is not None and kind != KIND:
        raise ConfigError.at(at, f"{path} is a {kind!r} store, not a {KIND} store")
    vector = _checked(arrays, "vector", path, at)
    if tuple(vector.metadata.dimension_names or ()) != DIMS:
        raise ConfigError.at(at, f"{path}: 'vector' has dims {vector.metadata.dimension_names}, not {DIMS}")
    methods = [str(m) for m in _checked(arrays, "method", path, at)[:]]
    hooks = [str(h) for h in _checked(arrays, "vector_hook", path, at)[:]]
    layer_array = _checked(arrays, "vector_layer", path, at)
    if not np.issubdtype(layer_array.dtype, np.integer):
        raise ConfigError.at(at, f"{path}: 'vector_layer' holds {layer_array.dtype}, not layer numbers")
    layers = [int(v) for v in layer_array[:]]
    i = _index(methods, method, where + ".method", "method", path)
    j = _index(hooks, hook, where + ".hook", "vectors at hook", path)
    k = _index(layers, layer, where + ".layer", "vectors at layer", path)
    sizes = (len(methods), len(hooks), len(layers))
    if tuple(vector.shape[:3]) != sizes:
        raise ConfigError.at(at, f"{path}: 'vector' has shape {list(vector.shape)}, but its coordinates name "
                                 f"{list(sizes)} (method, vector_hook, vector_layer): a damaged store")
    if "degenerate" in arrays:  # stores from before degeneracy was recorded lack it
        flags = _checked(arrays, "degenerate", path, at)
        if tuple(flags.metadata.dimension_names or ()) != DIMS[:3] or tuple(flags.shape) != sizes:
            raise ConfigError.at(at, f"{path}: 'degenerate' has dims {flags.metadata.dimension_names} and shape "
                                     f"{list(flags.shape)}, not {DIMS[:3]} of {list(sizes)}: a damaged store")
        if bool(flags[i, j, k]):
            raise ConfigError.at(where, f"{path}: its {method} vector at {hook} layer {layer} is degenerate (the "
                                        "pairs' differences there are rounding noise of the activations: no "
                                        "direction)")
    vec = np.asarray(vector[i, j, k, :])
    if np.issubdtype(vec.dtype, np.floating) and not np.isfinite(vec).all():
        raise ConfigError.at(where, f"{path} holds no {method} vector at {hook} layer {layer} (not finite: the "
                                    "method found no direction there)")
    return vec
