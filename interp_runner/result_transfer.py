"""How the result rank's per-request results reach a host in another process (tensor parallelism, a served engine).

The host makes an empty block for the call (``result_block``: a file under /dev/shm) and names it in its
``interp_collect`` call; the result rank writes every array of the results into it and answers with a
``Collected`` record (MessagePack bytes): per request, each array's dtype, shape and offset in the block. So the
message that vLLM serializes and queues is small, and the arrays are copied once into the block and once out of it
(``received``). A worker that cannot open the block (on another node) carries the block's bytes in the record
instead. The host removes the block when the call ends, whatever happens; a host killed before that leaves it to
the multiprocessing resource tracker, which removes it once the host is gone.

Pure data: numpy and msgspec, nothing of torch or vLLM (the plugin imports it on every worker).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import msgspec
import numpy as np

SHM = Path("/dev/shm")
BLOCK_PREFIX = "interp-results-"
ALIGN = 64  # every array starts at a multiple of this many bytes
NUMERIC_KINDS = "biuf"


class ArrayRef(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """An array in the block: ``dtype`` (numpy's name), ``shape``, first byte ``offset``."""

    dtype: str
    shape: tuple[int, ...]
    offset: int


class ScoreRefs(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """A request's score: log-probabilities of its scored ``token_ids``, and its top token."""

    token_ids: ArrayRef
    logprobs: ArrayRef
    top_id: int
    top_logprob: float


class ResultRefs(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One request's results (``InterpState.collect``), arrays as references into the block."""

    captures: dict[int, tuple[ArrayRef, ArrayRef]]  # site -> (positions, values)
    score: ScoreRefs | None
    void: str | None
    nonfinite: bool


class Collected(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The result rank's answer: ``size`` bytes of arrays, in the host's block or, where it could not open that,
    in ``data``."""

    size: int
    data: bytes | None
    results: dict[str, ResultRefs]


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(Collected).decode
SCORE_KEYS = set(ScoreRefs.__struct_fields__)


# -- the worker's side ------------------------------------------------------------------------------------


def send_results(results: dict, block: str) -> bytes:
    """The ``Collected`` record of ``results`` (request -> ``captures``, ``score``, ``void``, ``nonfinite``), its
    arrays written into the host's ``block`` where this process can open it, else carried in the record."""
    arrays: list[tuple[int, np.ndarray]] = []
    size = 0

    def ref(array: np.ndarray) -> ArrayRef:
        nonlocal size
        array = np.ascontiguousarray(array)
        offset = -(-size // ALIGN) * ALIGN
        arrays.append((offset, array))
        size = offset + array.nbytes
        return ArrayRef(array.dtype.str, tuple(array.shape), offset)

    refs = {}
    for rid, result in results.items():
        score = result.get("score")
        if score is not None and set(score) != SCORE_KEYS:
            raise ValueError(f"request {rid}: score fields {sorted(score)}, expected {sorted(SCORE_KEYS)}")
        refs[rid] = ResultRefs(
            captures={int(site): (ref(p), ref(v)) for site, (p, v) in result["captures"].items()},
            score=None if score is None else ScoreRefs(ref(score["token_ids"]), ref(score["logprobs"]),
                                                       int(score["top_id"]), float(score["top_logprob"])),
            void=result.get("void"),
            nonfinite=bool(result.get("nonfinite", False)),
        )
    data = None
    if not _write_block(block, arrays, size):
        data = bytearray(size)
        _fill(np.frombuffer(data, dtype=np.uint8), arrays)
    return _encode(Collected(size, data, refs))


def _fill(buffer: np.ndarray, arrays: list[tuple[int, np.ndarray]]) -> None:
    for offset, array in arrays:
        buffer[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)


def _write_block(block: str, arrays: list[tuple[int, np.ndarray]], size: int) -> bool:
    """Write the arrays into the host's block; False where there is none, this process cannot open it, or it has
    no room (a full /dev/shm: the block is emptied again)."""
    path = Path(block) if block else None
    if path is None or path.parent != SHM or not path.name.startswith(BLOCK_PREFIX):
        return False
    try:
        fd = os.open(path, os.O_WRONLY)  # the host's file, never one made here
    except OSError:
        return False
    try:
        os.ftruncate(fd, size)  # the gaps between arrays read as zeros
        for offset, array in arrays:  # written, not mapped: a full /dev/shm fails a write instead of a store
            data = memoryview(array.reshape(-1)).cast("B")
            while len(data):
                data = data[os.pwrite(fd, data, offset + array.nbytes - len(data)):]
    except OSError:
        os.ftruncate(fd, 0)
        return False
    finally:
        os.close(fd)
    return True


# -- the host's side --------------------------------------------------------------------------------------


@contextlib.contextmanager
def result_block(shared: bool = True) -> Iterator[str]:
    """The path of a fresh, empty block for one collect call (``""`` where there is no /dev/shm, or not
    ``shared``); removed when the block ends, and by the resource tracker should this process die before."""
    if not shared or not SHM.is_dir():
        yield ""
        return
    name = f"{BLOCK_PREFIX}{os.getpid()}-{secrets.token_hex(12)}"
    path = SHM / name
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
    tracked = f"/{name}"  # the tracker removes a shared-memory name with shm_unlink: /dev/shm/<name>
    resource_tracker.register(tracked, "shared_memory")
    try:
        yield str(path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        resource_tracker.unregister(tracked, "shared_memory")


def received(message: bytes, block: str) -> dict:
    """Per request (``captures``: site -> (positions, values); ``score``; ``void``; ``nonfinite``), the arrays read
    from ``block`` or from the message (read-only, as ``np.frombuffer`` gives them)."""
    collected = _decode(message)
    if collected.data is not None:
        if len(collected.data) != collected.size:
            raise ValueError(f"results carry {len(collected.data)} bytes of arrays, not {collected.size}")
        buffer = np.frombuffer(collected.data, dtype=np.uint8)
    else:
        buffer = _read_block(block, collected.size)

    def array(ref: ArrayRef) -> np.ndarray:
        dtype = np.dtype(ref.dtype)
        if dtype.kind not in NUMERIC_KINDS:
            raise ValueError(f"results hold an array of dtype {ref.dtype}")
        count = int(np.prod(ref.shape, dtype=np.int64))
        if ref.offset < 0 or ref.offset + count * dtype.itemsize > len(buffer):
            raise ValueError(f"an array of results lies outside their {len(buffer)} bytes")
        return buffer[ref.offset : ref.offset + count * dtype.itemsize].view(dtype).reshape(ref.shape)

    out = {}
    for rid, result in collected.results.items():
        score = result.score
        out[rid] = {
            "captures": {site: (array(p), array(v)) for site, (p, v) in result.captures.items()},
            "score": None if score is None else {"token_ids": array(score.token_ids), "logprobs": array(score.logprobs),
                                                 "top_id": score.top_id, "top_logprob": score.top_logprob},
            "void": result.void,
            "nonfinite": result.nonfinite,
        }
    return out


def _read_block(block: str, size: int) -> np.ndarray:
    if not block:
        raise ValueError("results were written to a block, but this call made none")
    buffer = np.empty(size, dtype=np.uint8)
    view = memoryview(buffer)
    done = 0
    with open(block, "rb", buffering=0) as f:
        while done < size:
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"the results block {block} holds {done} bytes, not {size}")
            done += n
    buffer.flags.writeable = False
    return buffer
