"""How the result rank's per-request results reach a host in another process (tensor parallelism, a served engine).

The host makes an empty block for the call (``result_block``: a file under /dev/shm) and names it in its
``interp_collect`` call. The result rank reserves room in the block and copies its captured rows from the device
straight in (``OutBlock.reserve``), writes every other array after them, and answers with a ``Collected`` record
(MessagePack bytes): per request, each array's dtype, shape and offset in the block. The host maps the block and
reads the arrays where they lie (``received``). So the message that vLLM serializes and queues is small, and a
captured row is copied once on its way. A worker that cannot open the block (on another node) carries the block's
bytes in the record instead. The host removes the block's file when the call ends, whatever happens (its arrays
keep the mapping, and so the memory, until they are gone); a host killed before that leaves the file to the
multiprocessing resource tracker, which removes it once the host is gone.

Pure data: numpy and msgspec, nothing of torch or vLLM (the plugin imports it on every worker).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import secrets
from collections.abc import Iterator
from multiprocessing import resource_tracker
from pathlib import Path

import msgspec
import numpy as np

SHM = Path("/dev/shm")
BLOCK_PREFIX = "interp-results-"
ALIGN = 64  # every array written after the reserved rooms starts at a multiple of this many bytes
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


class OutBlock:
    """The worker's side of the host's block for one collect call. ``reserve`` allocates room in it and maps that
    room, so that arrays can be written in place (a device's rows copied straight in, with no copy in between);
    ``send_results`` then refers to them where they lie and writes the other arrays after them. Without a block it
    can open (none, another node's, not the host's), it reserves nothing and ``send_results`` sends the bytes."""

    def __init__(self, block: str):
        self.fd: int | None = None
        self.used = 0  # bytes of the block reserved so far
        self._maps: list[tuple[int, int, int]] = []  # per mapped room: (address, offset in the block, bytes)
        path = Path(block) if block else None
        if path is None or path.parent != SHM or not path.name.startswith(BLOCK_PREFIX):
            return
        with contextlib.suppress(OSError):
            self.fd = os.open(path, os.O_RDWR)  # the host's file, never one made here

    def reserve(self, nbytes: int) -> np.ndarray | None:
        """``nbytes`` of the block, allocated now and mapped (writable bytes), or None where there is no block or
        no room. Allocated first, so a full /dev/shm fails here rather than in a store to the mapping."""
        if self.fd is None or nbytes <= 0:
            return None
        offset = -(-self.used // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            os.posix_fallocate(self.fd, offset, nbytes)
            room = mmap.mmap(self.fd, nbytes, offset=offset)  # shared, read and write
        except OSError:
            return None
        region = np.frombuffer(room, dtype=np.uint8)  # the mapping lives as long as views of it
        self._maps.append((region.ctypes.data, offset, nbytes))
        self.used = offset + nbytes
        return region

    def offset_of(self, array: np.ndarray) -> int | None:
        """Where in the block ``array`` lies, if it is a contiguous part of a reserved room."""
        if not self._maps or not array.nbytes or not array.flags.c_contiguous:
            return None
        address = array.ctypes.data
        for start, offset, nbytes in self._maps:
            if start <= address and address + array.nbytes <= start + nbytes:
                return offset + address - start
        return None

    def close(self) -> None:
        """Close the file; the rooms stay mapped until the arrays in them are gone."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


@contextlib.contextmanager
def out_block(block: str) -> Iterator[OutBlock]:
    out = OutBlock(block)
    try:
        yield out
    finally:
        out.close()


def send_results(results: dict, block: str | OutBlock) -> bytes:
    """The ``Collected`` record of ``results`` (request -> ``captures``, ``score``, ``void``, ``nonfinite``): arrays
    already in the block's reserved rooms are referred to where they lie, the others written into the host's
    ``block`` after them where this process can open it; else every array is carried in the record."""
    if not isinstance(block, OutBlock):
        with out_block(block) as out:
            return send_results(results, out)
    out = block
    arrays: list[tuple[int, np.ndarray]] = []  # (offset, array) to write after the rooms
    placed: list[tuple[int, np.ndarray]] = []  # (offset, array) already in a room
    size = out.used
    seen: dict[int, tuple] = {}  # an array given for several sites (a request's positions) is sent once

    def ref(array: np.ndarray) -> ArrayRef:
        known = seen.get(id(array))
        if known is None:
            known = seen[id(array)] = (array, new_ref(array))  # the array kept: its id stays its own
        return known[1]

    def new_ref(array: np.ndarray) -> ArrayRef:
        nonlocal size
        offset = out.offset_of(array)
        if offset is not None:
            placed.append((offset, array))
        else:
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
    if not _write_block(out, arrays, size):
        data = bytearray(size)
        _fill(np.frombuffer(data, dtype=np.uint8), [*placed, *arrays])
        if out.fd is not None:  # emptied again, but for the reserved rooms: their mappings must stay valid
            os.ftruncate(out.fd, out.used)
    return _encode(Collected(size, data, refs))


def _fill(buffer: np.ndarray, arrays: list[tuple[int, np.ndarray]]) -> None:
    for offset, array in arrays:
        buffer[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)


def _write_block(out: OutBlock, arrays: list[tuple[int, np.ndarray]], size: int) -> bool:
    """Write the arrays into the host's block after its reserved rooms; False where there is none, or it has no
    room (a full /dev/shm)."""
    if out.fd is None:
        return False
    try:
        if size > out.used:
            os.ftruncate(out.fd, size)  # the gaps between arrays read as zeros
        for offset, array in arrays:  # written, not mapped: a full /dev/shm fails a write instead of a store
            data = memoryview(array.reshape(-1)).cast("B")
            while len(data):
                data = data[os.pwrite(out.fd, data, offset + array.nbytes - len(data)):]
    except OSError:
        return False
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

    seen: dict[ArrayRef, np.ndarray] = {}  # one read-only array per reference (a request's positions)

    def array(ref: ArrayRef) -> np.ndarray:
        known = seen.get(ref)
        if known is not None:
            return known
        dtype = np.dtype(ref.dtype)
        if dtype.kind not in NUMERIC_KINDS:
            raise ValueError(f"results hold an array of dtype {ref.dtype}")
        if any(n < 0 for n in ref.shape):
            raise ValueError(f"results hold an array of shape {ref.shape}")
        nbytes = math.prod(ref.shape) * dtype.itemsize
        if ref.offset < 0 or ref.offset + nbytes > len(buffer):
            raise ValueError(f"an array of results lies outside their {len(buffer)} bytes")
        known = seen[ref] = buffer[ref.offset : ref.offset + nbytes].view(dtype).reshape(ref.shape)
        return known

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
    """The block's bytes, mapped (read-only), not copied: the mapping outlives the file's removal and lasts as long
    as arrays read from it."""
    if not block:
        raise ValueError("results were written to a block, but this call made none")
    with open(block, "rb", buffering=0) as f:
        held = os.fstat(f.fileno()).st_size
        if held < size:
            raise ValueError(f"the results block {block} holds {held} bytes, not {size}")
        if not size:
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ), dtype=np.uint8)
