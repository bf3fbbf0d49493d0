"""Named steering vectors of a running server: registered at start (the config's ``vectors:``) or at run time
(``POST /v1/interp/vectors``), from inline values or an uploaded .npy, .safetensors or GGUF control vector (or such
a file under ``serve.vector_dirs``). Nothing is unpickled; a request resolves names when it arrives, so requests in
flight keep the values they started with (workers hold vectors by the hash of their bytes)."""

from __future__ import annotations

import base64
import binascii
import io
import tempfile
from pathlib import Path
from typing import Annotated

import numpy as np
from pydantic import Field, StrictBool, ValidationError, model_validator

from interp_runner.config.errors import ConfigError, problems_of
from interp_runner.config.schema import Float32, Strict
from interp_runner.payload import vector_key
from interp_runner.vectors.load import checked_vector

NAME = r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$"
FILE_SUFFIXES = (".npy", ".safetensors", ".gguf")


class VectorUpload(Strict):
    """One vector under ``name``: exactly one of ``values``, ``npy`` / ``safetensors`` / ``gguf`` (base64 of the
    file's bytes) or ``file`` (relative to a ``serve.vector_dirs`` folder). ``key`` picks a .safetensors tensor,
    ``layer`` a GGUF control vector's ``direction.<layer>``."""

    name: Annotated[str, Field(pattern=NAME)]
    replace: StrictBool = False
    values: list[Float32] | None = None
    npy: str | None = None
    safetensors: str | None = None
    gguf: str | None = None
    file: str | None = Field(None, min_length=1)
    key: str | None = None
    layer: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _one_source(self) -> VectorUpload:
        given = [f for f in ("values", "npy", "safetensors", "gguf", "file") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of values, npy, safetensors, gguf, file (got {given or 'none'})")
        kind = given[0] if given[0] != "file" else Path(self.file).suffix.lstrip(".")
        if self.key is not None and kind != "safetensors":
            raise ValueError("'key' only applies to a .safetensors vector")
        if (self.layer is not None) != (kind == "gguf"):
            raise ValueError("a GGUF control vector needs 'layer' (its direction.N), and only it")
        return self


def _decode(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError.at(where, "not valid base64") from None


def _from_npy(data: bytes, where: str):
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, EOFError, OSError) as err:
        raise ConfigError.at(where, f"not a plain numeric .npy ({err})") from None


def _from_safetensors(data: bytes, key: str | None, where: str):
    from safetensors.numpy import load

    try:
        tensors = load(data)
    except Exception as err:  # safetensors raises its own error types for damaged data
        raise ConfigError.at(where, f"not a readable .safetensors ({err})") from None
    if key is None:
        if len(tensors) != 1:
            raise ConfigError.at(where, f"holds {sorted(tensors)}: say which with 'key'")
        return next(iter(tensors.values()))
    if key not in tensors:
        raise ConfigError.at("key", f"no tensor {key!r} (has {sorted(tensors)})")
    return tensors[key]


def _from_gguf(data: bytes, layer: int, where: str):
    from interp_runner.vectors.control import ControlVectorError, read_gguf

    with tempfile.NamedTemporaryFile(suffix=".gguf") as f:  # the reader maps a file
        f.write(data)
        f.flush()
        try:
            directions = read_gguf(Path(f.name)).directions
        except ControlVectorError as err:
            raise ConfigError.at(where, str(err).replace(f.name, "the upload")) from None
    if layer not in directions:
        raise ConfigError.at("layer", f"no direction for layer {layer} (has layers {sorted(directions)})")
    return directions[layer]


def file_under(rel: str, dirs: list[str]) -> Path:
    """``rel`` inside one of ``dirs`` (links resolved: none may lead out), an existing file."""
    if Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise ConfigError.at("file", "a path relative to a serve.vector_dirs folder, without '..'")
    if Path(rel).suffix not in FILE_SUFFIXES:
        raise ConfigError.at("file", f"a vector file is one of {', '.join(FILE_SUFFIXES)}")
    for folder in dirs:
        root = Path(folder).resolve()
        path = (root / rel).resolve()
        if path.is_relative_to(root) and path.is_file():
            return path
    raise ConfigError.at("file", f"no file {rel!r} under the server's vector folders")


def read_upload(data: object, hidden_size: int, dirs: list[str], max_values: int) -> tuple[VectorUpload, np.ndarray]:
    try:
        upload = VectorUpload.model_validate(data)
    except ValidationError as err:
        raise ConfigError(problems_of(err)) from None
    if upload.values is not None:
        if len(upload.values) > max_values:
            raise ConfigError.at("values", f"{len(upload.values)} values, at most {max_values}")
        return upload, checked_vector(upload.values, "values", hidden_size)
    if upload.file is not None:
        path = file_under(upload.file, dirs)
        kind, raw = path.suffix.lstrip("."), path.read_bytes()
        where = "file"
    else:
        kind = next(k for k in ("npy", "safetensors", "gguf") if getattr(upload, k) is not None)
        raw, where = _decode(getattr(upload, kind), kind), kind
    if kind == "npy":
        vec = _from_npy(raw, where)
    elif kind == "safetensors":
        vec = _from_safetensors(raw, upload.key, where)
    else:
        vec = _from_gguf(raw, upload.layer, where)
    return upload, checked_vector(vec, where, hidden_size)


class NamedVectors:
    """Name -> float32 vector, at most ``limit`` of them."""

    def __init__(self, limit: int):
        self.limit = limit
        self.vectors: dict[str, np.ndarray] = {}

    def add(self, name: str, vec: np.ndarray, replace: bool) -> bool:
        """Register ``vec`` under ``name``; True if it replaced another. A ``ConfigError`` at ``name`` or
        ``replace`` if refused."""
        old = self.vectors.get(name)
        if old is not None and not replace:
            raise ConfigError.at("replace", f"a vector named {name!r} exists: replacing it needs replace: true")
        if old is None and len(self.vectors) >= self.limit:
            raise ConfigError.at("name", f"the server holds {self.limit} named vectors (serve.max_vectors)")
        self.vectors[name] = vec
        return old is not None

    def remove(self, name: str) -> bool:
        return self.vectors.pop(name, None) is not None

    def listing(self) -> list[dict]:
        return [{"name": name, "size": int(vec.size), "key": vector_key(vec), "norm": float(np.linalg.norm(vec))}
                for name, vec in sorted(self.vectors.items())]
