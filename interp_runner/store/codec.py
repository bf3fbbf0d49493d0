"""Request results as plain data that cannot run code when read: MessagePack (msgspec), decoded against
``RequestResult``'s field types.

Every value comes back with its exact type, so a result read back writes the same store as the one the engine
returned. MessagePack holds None, bool, int, float (NaN and infinities bit for bit), str, lists and maps; the
typed fields bring back tuples (``top_logprobs``' pairs, ``captures``' values). Numeric and boolean numpy arrays and
scalars travel as extension values: dtype, shape and the raw elements. Anything else is refused when written, and
a document of any other shape, an unknown extension or a dtype other than bool, integer or float is refused when
read (``CodecError``). Encoding and decoding are msgspec's C code: a unit of 12,000 cell results takes tens of
milliseconds either way.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import lru_cache

import msgspec
import numpy as np

from interp_runner.engine.results import RequestResult

ARRAY_KINDS = "biuf"  # bool, signed and unsigned integers, floats
ARRAY, SCALAR = 1, 2  # extension codes
_HEADER = msgspec.msgpack.Decoder(tuple[str, tuple[int, ...]])


class CodecError(ValueError):
    """A document or value that is not what ``encode`` writes."""


class Unit(msgspec.Struct, forbid_unknown_fields=True):
    format: str
    results: dict[str, RequestResult]


def _encode_value(x):
    if not isinstance(x, (np.ndarray, np.generic)):
        raise TypeError(f"cannot journal a value of type {type(x).__name__}")
    if x.dtype.kind not in ARRAY_KINDS:
        raise TypeError(f"cannot journal an array of dtype {x.dtype}")
    code, shape = (ARRAY, x.shape) if isinstance(x, np.ndarray) else (SCALAR, ())
    header = msgspec.msgpack.encode((x.dtype.str, shape))
    return msgspec.msgpack.Ext(code, bytes([len(header)]) + header + np.ascontiguousarray(x).tobytes())


@lru_cache(maxsize=1024)
def _array_type(code: int, header: bytes) -> tuple[np.dtype, tuple[int, ...], int]:
    """(dtype, shape, bytes) that an extension value's header names (few distinct ones: parsed once each)."""
    try:
        dtype_str, shape = _HEADER.decode(header)
        dtype = np.dtype(dtype_str)
    except (msgspec.DecodeError, TypeError, ValueError) as err:
        raise CodecError(f"an array of unknown type ({err})") from None
    if dtype.kind not in ARRAY_KINDS or dtype.str != dtype_str or any(n < 0 for n in shape) \
            or (code == SCALAR and shape):
        raise CodecError(f"an array of dtype {dtype_str!r} and shape {shape} is not one the journal writes")
    return dtype, shape, dtype.itemsize * math.prod(shape)


def _decode_ext(code: int, data: memoryview):
    if code not in (ARRAY, SCALAR) or not len(data) or len(data) < 1 + data[0]:
        raise CodecError(f"unknown extension value (code {code})")
    end = 1 + data[0]
    dtype, shape, size = _array_type(code, bytes(data[1:end]))
    body = bytearray(data[end:])  # writable, as the engine's arrays are
    if len(body) != size:
        raise CodecError(f"an array of dtype {dtype.str} and shape {shape} holds {len(body)} bytes")
    array = np.frombuffer(body, dtype=dtype).reshape(shape)
    return array[()] if code == SCALAR else array


def _decode_type(kind, value):
    if kind is np.ndarray and isinstance(value, np.ndarray):
        return value
    raise CodecError(f"expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_value)
_DECODER = msgspec.msgpack.Decoder(Unit, ext_hook=_decode_ext, dec_hook=_decode_type)


def encode(results: Mapping[str, RequestResult], format: str) -> bytes:
    """Results by request id -> one document (``format`` names its version)."""
    return _ENCODER.encode(Unit(format, dict(results)))


def decode(data: bytes, format: str) -> dict[str, RequestResult]:
    """The inverse of ``encode``; a document of another ``format`` or shape raises ``CodecError``."""
    try:
        unit = _DECODER.decode(data)
    except msgspec.DecodeError as err:  # ValidationError included
        raise CodecError(str(err)) from None
    if unit.format != format:
        raise CodecError(f"format {unit.format!r}, not {format!r}")
    for rid, result in unit.results.items():
        if result.rid != rid:
            raise CodecError(f"result {result.rid!r} is listed as {rid!r}")
    return unit.results
