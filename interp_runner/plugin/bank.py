"""The patch bank: source values on the workers, by key, in rows of one persistent buffer.

``bank[row]`` holds patch source values (row 0 is zeros). Sources are registered by key before a stage and kept
while requests use them; a request's ``keep`` values reach the bank through the capture op: their rows are copied
there on the device after the step that computes them, and their keys count as registered from the next step on.
A run's kept values at a site also form a stream that packed cells start from (``stream``); they are not freed
while a cell uses them.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from interp_runner.contracts import Keep
from interp_runner.payload import ref_key, unpack_positions

from interp_runner.plugin.records import KeptGroup, StreamKey


class KeptStream(NamedTuple):
    """The values a run keeps at a site: their positions (sorted) and keys."""

    positions: np.ndarray
    keys: np.ndarray


class Stream(NamedTuple):
    """A kept stream whose values are all written: their positions (sorted) and bank rows."""

    positions: np.ndarray
    rows: np.ndarray


class PatchBank:
    def __init__(self, num_rows: int, hidden_size: int, dtype, device, staging, fold):
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.values = torch.zeros((num_rows + 1, hidden_size), dtype=dtype, device=device)
        self.rows: dict[str, int] = {}  # key -> its row
        self.released: set[str] = set()  # released keys still in use: freed when their last user finishes
        self.unwritten: set[str] = set()  # kept keys whose values no step has computed yet
        self._users: dict[str, int] = {}
        self._free = list(range(num_rows, 0, -1))
        # kept values by stream: (positions, keys), and, once all are written, (positions, bank rows); the number
        # of requests whose cells start from them, and the keys of the streams with users (never freed under them)
        self._kept_by_site: dict[StreamKey, KeptStream] = {}
        self._streams: dict[StreamKey, Stream] = {}
        self._stream_users: dict[StreamKey, int] = {}
        self._stream_keys: set[str] = set()
        self._staging = staging
        self._fold = fold

    # -- registered sources -------------------------------------------------------------------------
    def register(self, sources: dict[str, bytes]) -> int:
        """Patch source values into the bank (a key already there is kept); returns the rows in use."""
        new = [k for k in sources if k not in self.rows]
        if len(new) > len(self._free):
            raise RuntimeError(
                f"interp patch bank is full: {len(new)} new sources, {len(self._free)} free rows "
                f"of {self.values.shape[0] - 1}"
            )
        for key in new:
            if len(sources[key]) != 4 * self.hidden_size:
                raise ValueError(f"source {key}: length {len(sources[key]) // 4}, model hidden size {self.hidden_size}")
        if new:
            rows = np.array([self._free.pop() for _ in new], dtype=np.int64)
            values = np.frombuffer(b"".join(sources[k] for k in new), dtype=np.float32).reshape(len(new), -1)
            self._fold(b"source", rows, values)
            self.values[self._staging.upload(rows)] = self._staging.upload(values).to(self.dtype)  # one copy, no wait
            self.rows.update(zip(new, rows.tolist()))
        self.released.difference_update(sources)
        return len(self.rows)

    def release(self, keys: list[str]) -> int:
        """Drop sources now, or when the last admitted request using them finishes."""
        for key in keys:
            if key in self.rows:
                self.released.add(key)
                self._free_if_unused(key)
        rows = self.rows
        for stream in [s for s, kept in self._kept_by_site.items() if any(k not in rows for k in kept.keys.tolist())]:
            del self._kept_by_site[stream]  # no cell can start from it any more
        return len(self.rows)

    def _free_if_unused(self, key: str) -> None:
        if key in self.released and not self._users.get(key) and key not in self._stream_keys:
            self._streams.clear()  # a cache of validated streams: this row may be in one
            self.released.discard(key)
            self.unwritten.discard(key)
            self._users.pop(key, None)
            self._free.append(self.rows.pop(key))

    # -- a request's use of the bank ----------------------------------------------------------------
    def missing(self, keys: list[str]) -> list[str]:
        """The keys (sorted) whose values are not in the bank, or not computed yet."""
        rows, unwritten = self.rows, self.unwritten
        return sorted({k for k in keys if k not in rows or k in unwritten})

    def use(self, keys) -> None:
        """A request uses these rows: none is freed before it finishes (``finish``)."""
        users = self._users
        for key in keys:
            users[key] = users.get(key, 0) + 1

    def reserve_kept(self, keep: Keep) -> tuple[list[KeptGroup], list[str]]:
        """Bank rows for the values a request keeps (its ``keep`` payload), written by the steps that compute them;
        returns the groups and the keys the request writes (which it uses). A key already in the bank stays (kept
        again if it was released) and keeps its row, written only if no step has yet (the same computation); with
        the bank full, a key gets none, and requests that need it are voided."""
        run, reserved, writes, groups = keep.run, [], [], []
        rows_in_bank, free = self.rows, self._free
        for group in keep.groups:
            positions = np.unique(unpack_positions(group.positions)).astype(np.int64)
            if not len(positions):
                continue
            sites = group.sites
            keys = [ref_key(run, site, p) for site in sites for p in positions.tolist()]
            rows = []
            if len(free) >= len(keys) and all(k not in rows_in_bank for k in keys):  # the usual case: all new
                rows = free[len(free) - len(keys):][::-1]
                del free[len(free) - len(keys):]
                rows_in_bank.update(zip(keys, rows))
                reserved += keys
                writes += keys
                keys_to_check = ()
            else:
                keys_to_check = keys
            for key in keys_to_check:
                row = rows_in_bank.get(key)
                if row is not None:
                    self.released.discard(key)
                    if key in self.unwritten:
                        rows.append(row)
                        writes.append(key)
                    else:
                        rows.append(-1)
                    continue
                if not free:
                    rows.append(-1)
                    continue
                rows_in_bank[key] = row = free.pop()
                rows.append(row)
                reserved.append(key)
                writes.append(key)
            shape = (len(sites), len(positions))
            rows = np.array(rows, dtype=np.int64).reshape(shape)
            keys = np.array(keys, dtype=object).reshape(shape)
            groups.append(KeptGroup(sites, positions, int(positions[0]), int(positions[-1]), rows, keys))
            for site, site_keys in zip(sites, keys):
                self._kept_by_site[StreamKey(run, site)] = KeptStream(positions, site_keys)
                self._streams.pop(StreamKey(run, site), None)
            self._fold(b"keep", np.array(sites), positions, rows)
        self.unwritten.update(reserved)
        self.use(writes)  # a writer uses its rows: none is freed under it
        return groups, writes

    def written(self, keys: np.ndarray) -> None:
        """Kept values a step computed (their rows are copied in after it): registered from the next step on."""
        self.unwritten.difference_update(keys.tolist())

    def stream(self, key: StreamKey) -> Stream | None:
        """The values a run keeps at a site, or None unless every one is written."""
        stream = self._streams.get(key)
        if stream is None:
            kept = self._kept_by_site.get(key)
            if kept is None:
                return None
            positions, keys = kept
            rows = [self.rows.get(k, -1) for k in keys.tolist()]
            if -1 in rows or not self.unwritten.isdisjoint(keys.tolist()):
                return None
            stream = self._streams[key] = Stream(positions, np.array(rows, dtype=np.int64))
        return stream

    def use_streams(self, keys: tuple[StreamKey, ...]) -> None:
        """A request's cells start from these streams: their rows are not freed before it finishes."""
        for key in keys:
            users = self._stream_users.get(key, 0)
            if not users:
                self._stream_keys.update(self._kept_by_site[key].keys.tolist())
            self._stream_users[key] = users + 1

    def finish(self, keys: tuple[str, ...], streams: tuple[StreamKey, ...]) -> None:
        """A request that used ``keys`` and started from ``streams`` finished: free what it alone held."""
        for key in keys:
            self._users[key] -= 1
            self._free_if_unused(key)
        for stream in streams:
            self._stream_users[stream] -= 1
            if not self._stream_users[stream]:
                del self._stream_users[stream]
                kept = self._kept_by_site.get(stream)
                keys = kept.keys.tolist() if kept is not None else ()
                self._stream_keys.difference_update(keys)
                for key in keys:
                    self._free_if_unused(key)
