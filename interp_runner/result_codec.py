"""Request results as plain data that cannot run code when read: a JSON document for the structure and the
scalars, and numeric arrays kept beside it (the journal writes them to an ``.npz`` read with
``allow_pickle=False``).

Every value comes back with its exact type, so a result read back writes the same store as the one the engine
returned: JSON's own types (None, bool, int, float with NaN/inf, str, list), and tagged ``{"tuple": [...]}``,
``{"dict": [[key, value], ...]}`` (keys of any supported type), ``{"array": name}`` (an ndarray) and
``{"scalar": name}`` (a numpy scalar, kept as a 0-d array). Only numeric and boolean arrays are accepted.
Anything else is refused when written, and any other shape of document is refused when read.
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
    """Results by request id -> (JSON-able document, arrays by name)."""
    arrays: dict[str, np.ndarray] = {}

    def value(x):
        if x is None or isinstance(x, (bool, int, float, str)) and not isinstance(x, np.generic):
            return x
        if isinstance(x, list):
            return [value(v) for v in x]
        if isinstance(x, tuple):
            return {"tuple": [value(v) for v in x]}
        if isinstance(x, dict):
            return {"dict": [[value(k), value(v)] for k, v in x.items()]}
        if isinstance(x, (np.ndarray, np.generic)):
            array = np.asarray(x)
            if array.dtype.kind not in ARRAY_KINDS:
                raise TypeError(f"cannot journal an array of dtype {array.dtype}")
            name = f"a{len(arrays)}"
            arrays[name] = array
            return {"array" if isinstance(x, np.ndarray) else "scalar": name}
        raise TypeError(f"cannot journal a value of type {type(x).__name__}")

    doc = {rid: {f: value(getattr(r, f)) for f in RESULT_FIELDS} for rid, r in results.items()}
    return doc, arrays


def decode(doc, arrays: Mapping[str, np.ndarray]) -> dict[str, RequestResult]:
    """The inverse of ``encode``; ``arrays`` is read without pickles (an ``np.load(..., allow_pickle=False)``)."""

    def array(name) -> np.ndarray:
        if not isinstance(name, str) or name not in arrays:
            raise CodecError(f"no array {name!r}")
        try:
            got = arrays[name]
        except ValueError as err:  # numpy refuses object arrays without allow_pickle
            raise CodecError(f"array {name!r}: {err}") from None
        if not isinstance(got, np.ndarray) or got.dtype.kind not in ARRAY_KINDS:
            raise CodecError(f"array {name!r} is not numeric")
        return got

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
            return array(body)
        if tag == "scalar":
            return array(body)[()]
        raise CodecError(f"unknown tag {tag!r} in a journal document")

    if not isinstance(doc, dict):
        raise CodecError("a journal document must map request ids to results")
    out = {}
    for rid, fields in doc.items():
        if not isinstance(fields, dict) or set(fields) != set(RESULT_FIELDS):
            raise CodecError(f"result {rid!r} does not have the fields of a RequestResult")
        out[rid] = RequestResult(**{f: value(fields[f]) for f in RESULT_FIELDS})
    return out
