"""The result rank's results on their way to a host in another process (``interp_runner.result_transfer``): every
array comes back bit for bit, through the host's shared-memory block or, where the worker cannot open that, inside
the message; the block is gone after the call however it ends, also when the host process is killed."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from interp_runner import result_transfer
from interp_runner.result_transfer import (BLOCK_PREFIX, SHM, Collected, out_block, received, result_block,
                                          send_results)

pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")


def odd_floats(rows: int, cols: int, seed: int) -> np.ndarray:
    """float32 rows with the values a lossy path would change: NaNs with payloads, -0, infinities, subnormals."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    bits = values.view(np.uint32)
    bits.flat[0] = 0x7FC01234  # a quiet NaN with a payload
    bits.flat[1] = 0xFF800001  # a signalling NaN, negative
    values.flat[2], values.flat[3], values.flat[4] = -0.0, np.inf, -np.inf
    bits.flat[5] = 0x00000001  # the smallest subnormal
    return values


def worker_results() -> dict:
    """Results as ``InterpState.collect`` gives them: captures, a score, a void request, an empty capture."""
    positions = np.array([3, 7, 9], np.int32)
    return {
        "a": {"captures": {4: (positions, odd_floats(3, 96, 0)), 11: (positions[:1], odd_floats(1, 96, 1))},
              "score": {"token_ids": np.array([17, 23], np.int32), "logprobs": np.float32([-0.25, -7.5]),
                        "top_id": 17, "top_logprob": -0.2500000037252903},
              "void": None, "nonfinite": True},
        "b": {"captures": {0: (np.zeros(0, np.int32), np.zeros((0, 96), np.float32))}, "score": None,
              "void": "the source was released", "nonfinite": False},
        # a value sliced out of a larger read-back (not contiguous on its own) and a float16 store
        "c": {"captures": {2: (positions[::2], odd_floats(4, 200, 2)[::2, 8:104]),
                           5: (positions, odd_floats(3, 8, 3).astype(np.float16))},
              "score": None, "void": None, "nonfinite": False},
    }


def assert_same(got: dict, want: dict) -> None:
    """Same requests, sites, dtypes, shapes and bytes; scores' plain numbers equal exactly."""
    assert got.keys() == want.keys()
    for rid, w in want.items():
        g = got[rid]
        assert g["void"] == w["void"] and g["nonfinite"] == w["nonfinite"], rid
        assert g["captures"].keys() == w["captures"].keys(), rid
        pairs = [(g["captures"][s][i], w["captures"][s][i]) for s in w["captures"] for i in (0, 1)]
        if w["score"] is None:
            assert g["score"] is None
        else:
            assert g["score"]["top_id"] == w["score"]["top_id"]
            assert g["score"]["top_logprob"] == w["score"]["top_logprob"]
            pairs += [(g["score"][k], w["score"][k]) for k in ("token_ids", "logprobs")]
        for a, b in pairs:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), rid


def our_blocks() -> set[str]:
    return {p.name for p in SHM.glob(f"{BLOCK_PREFIX}{os.getpid()}-*")}


def test_block_round_trip_is_exact_and_the_block_is_removed():
    want = worker_results()
    with result_block() as block:
        assert Path(block).parent == SHM and Path(block).name in our_blocks()
        message = send_results(want, block)
        decoded = msgspec.msgpack.decode(message, type=Collected)
        assert decoded.data is None and os.path.getsize(block) == decoded.size  # the arrays went to the block
        assert len(message) < 1000 < decoded.size  # the message only says where they lie
        got = received(pickle.loads(pickle.dumps(message)), block)  # as vLLM's worker queue carries it
    assert not our_blocks()
    assert_same(got, want)
    assert not got["a"]["captures"][4][1].flags.writeable  # read-only, like arrays from bytes


def rows_in_place(out, rows: int, cols: int, seed: int) -> np.ndarray:
    """Rows written into a room reserved in the block, as the result rank copies a device's rows there."""
    room = out.reserve(4 * rows * cols)
    assert room is not None
    values = room.view(np.float32).reshape(rows, cols)
    values[:] = odd_floats(rows, cols, seed)
    return values


def test_rows_written_in_place_travel_where_they_lie_and_outlive_the_block():
    """Rows in a reserved room are referred to, not copied again; one positions array given for several sites is
    sent once and comes back as one read-only array; the host's arrays stay readable after the block's file is
    gone (they map it)."""
    with result_block() as block:
        with out_block(block) as out:
            values = rows_in_place(out, 6, 64, 0)
            positions = np.array([2, 5, 8], np.int32)
            want = {"a": {"captures": {0: (positions, values[:3]), 1: (positions, values[3:])}, "score": None,
                          "void": None, "nonfinite": False}}
            message = send_results(want, out)
        decoded = msgspec.msgpack.decode(message, type=Collected)
        refs = decoded.results["a"].captures
        assert decoded.data is None
        assert [refs[s][1].offset for s in (0, 1)] == [0, 3 * 64 * 4]  # where the rows were written
        assert refs[0][0] == refs[1][0]  # the positions, once
        assert decoded.size == out.used + positions.nbytes  # the room, then the positions after it
        got = received(message, block)
        want["a"]["captures"] = {site: (p.copy(), v.copy()) for site, (p, v) in want["a"]["captures"].items()}
    assert not our_blocks()
    assert_same(got, want)  # read after the file was removed
    assert got["a"]["captures"][0][0] is got["a"]["captures"][1][0]
    assert not got["a"]["captures"][0][1].flags.writeable


def test_no_room_to_reserve_falls_back_to_copies(monkeypatch):
    """A /dev/shm too full to allocate a room: nothing is reserved, and the rows travel as before."""
    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(result_transfer.os, "posix_fallocate", full)
    with result_block() as block:
        with out_block(block) as out:
            assert out.reserve(4096) is None and out.used == 0
        assert_same(received(send_results(worker_results(), block), block), worker_results())
    assert not our_blocks()


def test_full_shm_after_a_room_carries_everything_in_the_message(monkeypatch):
    """The room was allocated, then writing the other arrays fails: every array, those in the room too, travels in
    the message, and the room's rows stay readable on the worker (its mapping is kept valid)."""
    def full(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(result_transfer.os, "pwrite", full)
    with result_block() as block:
        with out_block(block) as out:
            values = rows_in_place(out, 4, 32, 1)
            want = {"a": {"captures": {3: (np.arange(4, dtype=np.int32), values)}, "score": None, "void": None,
                          "nonfinite": False}}
            message = send_results(want, out)
        assert msgspec.msgpack.decode(message, type=Collected).data is not None
        assert values.tobytes() == odd_floats(4, 32, 1).tobytes()  # no fault reading the room afterwards
        assert_same(received(message, block), want)
    assert not our_blocks()


@pytest.mark.parametrize("where", ["none", "elsewhere", "not_ours"])
def test_fallback_carries_the_arrays_in_the_message(where, tmp_path):
    """No block (no /dev/shm on the host), a block this process cannot see (another node: here, removed before the
    worker writes), or a path that is no block of the host's: the worker writes no file and sends the bytes."""
    want = worker_results()
    block = {"none": "", "elsewhere": str(SHM / f"{BLOCK_PREFIX}0-gone"), "not_ours": str(tmp_path / "x")}[where]
    message = send_results(want, block)
    decoded = msgspec.msgpack.decode(message, type=Collected)
    assert decoded.data is not None and len(decoded.data) == decoded.size
    assert not Path(block).exists() if block else True
    assert_same(received(message, block), want)


def test_full_shm_falls_back_to_the_message(monkeypatch):
    """A /dev/shm with no room left (a write fails): the block is emptied again and the bytes travel inline."""
    def full(fd, data, offset):
        if offset > 1000:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    real = os.pwrite
    monkeypatch.setattr(result_transfer.os, "pwrite", full)
    want = worker_results()
    with result_block() as block:
        message = send_results(want, block)
        assert os.path.getsize(block) == 0
        assert msgspec.msgpack.decode(message, type=Collected).data is not None
        assert_same(received(message, block), want)
    assert not our_blocks()


def test_no_block_for_a_worker_in_this_process():
    with result_block(shared=False) as block:
        assert block == ""
    assert_same(received(send_results(worker_results(), block), block), worker_results())


def test_block_removed_when_the_host_fails_while_reading():
    with pytest.raises(RuntimeError, match="engine died"):
        with result_block() as block:
            send_results(worker_results(), block)
            assert os.path.getsize(block) > 0
            raise RuntimeError("engine died")
    assert not our_blocks()


def test_block_removed_when_the_host_is_killed():
    """A host killed while its block holds results: the resource tracker removes the block once the host is gone."""
    code = ("import os, signal, sys\n"
            "from interp_runner.result_transfer import result_block, send_results\n"
            "import numpy as np\n"
            "with result_block() as block:\n"
            "    send_results({'a': {'captures': {0: (np.arange(4, dtype=np.int32), np.ones((4, 8), np.float32))},"
            " 'score': None}}, block)\n"
            "    print(block, flush=True)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    block = Path(proc.stdout.strip())
    assert block.parent == SHM and block.name.startswith(BLOCK_PREFIX)
    deadline = time.monotonic() + 20
    while block.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not block.exists()


def test_bad_records_are_refused():
    with result_block() as block:
        message = send_results(worker_results(), block)
        decoded = msgspec.msgpack.decode(message, type=Collected)
        ref = decoded.results["a"].captures[4][1]
        for bad, match in ((msgspec.structs.replace(ref, dtype="|O"), "dtype"),
                           (msgspec.structs.replace(ref, offset=decoded.size), "outside")):
            results = {**decoded.results, "a": msgspec.structs.replace(decoded.results["a"], captures={4: (
                decoded.results["a"].captures[4][0], bad)})}
            forged = result_transfer._encode(msgspec.structs.replace(decoded, results=results))
            with pytest.raises(ValueError, match=match):
                received(forged, block)
    with pytest.raises(ValueError, match="score fields"):
        send_results({"a": {"captures": {}, "score": {"token_ids": np.zeros(1, np.int32)}}}, "")
