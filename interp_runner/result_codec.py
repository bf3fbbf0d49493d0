"""Request results as plain data that cannot run code when read: a JSON document for the structure and the
scalars, and numeric arrays kept beside it (the journal writes them to an ``.npz`` read with
``allow_pickle=False``).

Every value comes back with its exact type, so a result read back writes the same store as the one the engine
returned: JSON's own types (None, bool, int, float with NaN/inf, str, list), and tagged ``{"tuple": [...]}``,
``{"dict": [[key, value], ...]}`` (keys of any supported type), ``{"array": [pool, start, shape]}`` (an ndarray)
and ``{"scalar": [pool, start]}`` (a numpy scalar). The arrays' elements are kept in one flat pool array per dtype
(a unit holds a few pools, not one small array per result: an ``.npz`` of tens of thousands of members takes
seconds to write and read). Only numeric and boolean arrays are accepted. Anything else is refused when written,
and any other shape of document is refused when read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from .engine import RequestResult

ARRAY_KINDS = "biuf"  # bool, signed and unsigned integers, floats
RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(RequestResult))


class CodecError(ValueError):
    """A document or array that is not what ``encode`` writes."""


def encode(results: Mapping[str, RequestResult]) -> tuple[dict, dict[str, np.ndarray]]:
    """Results by request id -> (JSON-able document, pools by name)."""
    parts: dict[np.dtype, list[np.ndarray]] = {}
    names: dict[np.dtype, str] = {}
    sizes: dict[np.dtype, int] = {}

    def pooled(array: np.ndarray) -> tuple[str, int]:
        dtype = array.dtype
        if dtype.kind not in ARRAY_KINDS:
            raise TypeError(f"cannot journal an array of dtype {dtype}")
        if dtype not in names:
            names[dtype], parts[dtype], sizes[dtype] = f"p{len(names)}", [], 0
        start = sizes[dtype]
        parts[dtype].append(array.ravel())
        sizes[dtype] = start + array.size
        return names[dtype], start

    def value(x):
        if x is None or isinstance(x, (bool, int, float, str)) and not isinstance(x, np.generic):
            return x
        if isinstance(x, list):
            return [value(v) for v in x]
        if isinstance(x, tuple):
            return {"tuple": [value(v) for v in x]}
        if isinstance(x, dict):
            return {"dict": [[value(k), value(v)] for k, v in x.items()]}
        if isinstance(x, np.ndarray):
            return {"array": [*pooled(x), list(x.shape)]}
        if isinstance(x, np.generic):
            return {"scalar": list(pooled(np.asarray(x)))}
        raise TypeError(f"cannot journal a value of type {type(x).__name__}")

    doc = {rid: {f: value(getattr(r, f)) for f in RESULT_FIELDS} for rid, r in results.items()}
    return doc, {names[dtype]: np.concatenate(chunks) for dtype, chunks in parts.items()}


def decode(doc, arrays: Mapping[str, np.ndarray]) -> dict[str, RequestResult]:
    """The inverse of ``encode``; ``arrays`` is read without pickles (an ``np.load(..., allow_pickle=False)``)."""

    pools: dict[str, np.ndarray] = {}

    def pool(name) -> np.ndarray:
        got = pools.get(name) if isinstance(name, str) else None
        if got is None:
            if not isinstance(name, str) or name not in arrays:
                raise CodecError(f"no array {name!r}")
            try:
                got = arrays[name]  # an NpzFile reads a member at each access: once here
            except ValueError as err:  # numpy refuses object arrays without allow_pickle
                raise CodecError(f"array {name!r}: {err}") from None
            if not isinstance(got, np.ndarray) or got.dtype.kind not in ARRAY_KINDS or got.ndim != 1:
                raise CodecError(f"array {name!r} is not a flat numeric array")
            pools[name] = got
        return got

    def array(ref, scalar: bool):
        if not isinstance(ref, list) or len(ref) != (2 if scalar else 3):
            raise CodecError(f"unexpected array reference {ref!r}")
        elements, start = pool(ref[0]), ref[1]
        shape = [] if scalar else ref[2]
        if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in [start, *shape]):
            raise CodecError(f"unexpected array reference {ref!r}")
        size = int(np.prod(shape))
        if start + size > len(elements):
            raise CodecError(f"array reference {ref!r} reaches past its pool")
        return elements[start] if scalar else elements[start : start + size].reshape(shape)

    def value(x):
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, list):
            return [value(v) for v in x]
        if not isinstance(x, dict) or len(x) != 1:
            what = f"object with keys {sorted(x)}" if isinstance(x, dict) else type(x).__name__
            raise CodecError(f"unexpected {what} in a journal document")
        (tag, body), = x.items()
        if tag == "tuple" and isinstance(body, list):
            return tuple(value(v) for v in body)
        if tag == "dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
            return {value(k): value(v) for k, v in body}
        if tag == "array":
            return array(body, False)
        if tag == "scalar":
            return array(body, True)
        raise CodecError(f"unknown tag {tag!r} in a journal document")

    if not isinstance(doc, dict):
        raise CodecError("a journal document must map request ids to results")
    out = {}
    for rid, fields in doc.items():
        if not isinstance(fields, dict) or set(fields) != set(RESULT_FIELDS):
            raise CodecError(f"result {rid!r} does not have the fields of a RequestResult")
        out[rid] = RequestResult(**{f: value(fields[f]) for f in RESULT_FIELDS})
    return out
