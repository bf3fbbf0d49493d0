"""Loading steering vectors from their configured sources, with errors that name the config key."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from interp_runner.config.errors import ConfigError
from interp_runner.config.schema import DEFAULT_STORE_METHOD, VectorSpec, resolve_path


def random_direction(seed: int, norm: float, size: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(size)
    return (v / np.linalg.norm(v) * norm).astype(np.float32)


def _load_control_vector(path: Path, layer: int, where: str) -> np.ndarray:
    """llama.cpp's ``direction.<layer>``: what it adds to decoder layer ``layer``'s output (``post_block``)."""
    from interp_runner.vectors.control import ControlVectorError, read_gguf

    try:
        directions = read_gguf(path).directions
    except ControlVectorError as err:
        raise ConfigError.at(where + ".file", str(err)) from None
    if layer not in directions:
        raise ConfigError.at(where + ".layer", f"{path} has no direction for layer {layer} (has layers "
                                               f"{sorted(directions)}; llama.cpp's control vectors start at 1)")
    return directions[layer]


def _load_file(path: Path, key: str | None, where: str, layer: int | None = None) -> np.ndarray:
    if not path.exists():
        raise ConfigError.at(where + ".file", f"vector file not found: {path}")
    if not path.is_file():
        raise ConfigError.at(where + ".file", f"{path} is a folder, not a file")
    suffix = path.suffix
    if suffix == ".gguf":
        return _load_control_vector(path, layer, where)
    if suffix == ".npy":
        try:
            return np.load(path, allow_pickle=False)
        except (ValueError, EOFError, OSError) as err:
            raise ConfigError.at(where + ".file", f"{path} is not a plain numeric .npy ({err})") from None
    if suffix == ".safetensors":
        from safetensors.numpy import load_file

        try:
            tensors = load_file(str(path))
        except Exception as err:  # safetensors raises its own error types for damaged files
            raise ConfigError.at(where + ".file", f"{path} is not a readable .safetensors ({err})") from None
        return _pick(tensors, key, path, where)
    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # weights_only refuses any pickle that is not plain tensors and containers
        raise ConfigError.at(where + ".file", f"{path} does not hold plain tensors ({type(err).__name__})") from None
    if isinstance(obj, dict):
        obj = _pick(obj, key, path, where)
    if not isinstance(obj, torch.Tensor):
        raise ConfigError.at(where + ".file", f"{path} holds a {type(obj).__name__}, not a tensor")
    if not obj.is_floating_point():
        raise ConfigError.at(where, f"vector has dtype {str(obj.dtype).removeprefix('torch.')}, not a float dtype")
    return obj.detach().double().numpy()  # float64 holds every float dtype exactly


def _pick(tensors: dict, key: str | None, path: Path, where: str):
    if key is None:
        if len(tensors) != 1:
            raise ConfigError.at(where + ".key", f"{path} holds {sorted(tensors)}: say which with 'key'")
        return next(iter(tensors.values()))
    if key not in tensors:
        raise ConfigError.at(where + ".key", f"no tensor {key!r} in {path} (has {sorted(tensors)})")
    return tensors[key]


def load_vector(
    spec: VectorSpec, where: str, hidden_size: int, named: dict[str, np.ndarray], base: Path | None
) -> np.ndarray:
    """The vector as float32 [hidden_size]; ``where`` is the config key path of ``spec``."""
    if spec.name is not None:
        if spec.name not in named:
            raise ConfigError.at(where, f"no vector named {spec.name!r} under 'vectors' (has {sorted(named)})")
        return named[spec.name]
    if spec.values is not None:
        vec = np.asarray(spec.values, dtype=np.float64)
    elif spec.random is not None:
        vec = random_direction(spec.random.seed, spec.random.norm, hidden_size)
    elif spec.store is not None:
        from interp_runner.vectors.store import read_store_vector

        vec = read_store_vector(resolve_path(spec.store, base), spec.method or DEFAULT_STORE_METHOD, spec.hook,
                                spec.layer, where)
    else:
        vec = _load_file(resolve_path(spec.file, base), spec.key, where, spec.layer)
    return checked_vector(vec, where, hidden_size)


def checked_vector(vec, where: str, hidden_size: int) -> np.ndarray:
    """A float vector of the model's width, finite as float32 (the engine computes in it); errors name ``where``."""
    vec = np.asarray(vec)
    if not np.issubdtype(vec.dtype, np.number):
        raise ConfigError.at(where, f"vector has non-numeric dtype {vec.dtype}")
    if not np.issubdtype(vec.dtype, np.floating):  # ints, bools and complex numbers would be converted
        raise ConfigError.at(where, f"vector has dtype {vec.dtype}, not a float dtype")
    vec = vec.astype(np.float64).squeeze()
    if vec.shape != (hidden_size,):
        raise ConfigError.at(where, f"vector has shape {list(vec.shape)}, model hidden size is {hidden_size}")
    if not np.isfinite(vec).all():
        raise ConfigError.at(where, "vector contains NaN or inf")
    with np.errstate(over="ignore"):
        out = vec.astype(np.float32)
    if not np.isfinite(out).all():
        raise ConfigError.at(where, f"vector holds {np.abs(vec).max():.3g}, beyond float32's range (about "
                                    "±3.4e38): the engine computes in float32")
    return out
