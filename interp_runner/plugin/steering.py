"""The steering table: registered vectors, the summed vectors of each steering set in table slots, and the slot of
every batch row.

- ``row_slot[t]``: the steering slot of batch row ``t`` (slot 0 holds zeros: rows without steering keep their
  value bit for bit);
- ``table[site, slot]``: the summed steering vector of a slot at a steered site. A request gets two slots, one
  for its prompt tokens (base + prefill tiers) and one for generated tokens (base + decode tiers); requests with
  the same steering share them. A steering set's slots stay valid after its last request until they are needed, so
  the next wave of requests with the same steering builds none.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import interp_runner_kernels as kernels
from interp_runner.contracts import DECODE, PREFILL, Steer

from interp_runner.plugin.batch_plans import STEER, BatchPlans
from interp_runner.plugin.staging import RowSlots

GATHER_BYTES = 64 << 20  # the largest step gather (every steered site's rows at once) made outside CUDA graphs


@dataclass(slots=True)
class SlotPair:
    """The table slots of one steering set, and how many admitted requests use them."""

    prefill: int
    decode: int
    requests: int = 0


class SteeringTable:
    def __init__(self, sites: tuple[int, ...], hidden_size: int, dtype, device, max_rows: int, num_slots: int,
                 staging, fold):
        self.sites = sites
        self.index = {site: i for i, site in enumerate(sites)}
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._slots = RowSlots(max_rows, device, staging)
        self.row_slot = self._slots.values
        self.table = torch.zeros((max(len(sites), 1), num_slots, hidden_size), dtype=dtype, device=device)
        self._site_tables = list(self.table)  # one view per site, made once
        self._step_gather: tuple[torch.Tensor, ...] | None = None  # this step's rows of each site's table (``steer``)
        self.vectors: dict[str, np.ndarray] = {}
        self._free_slots = list(range(num_slots - 1, 0, -1))
        self._in_use: dict[tuple, SlotPair] = {}  # steering key -> its slots
        # keys no request uses any more, oldest first: their table rows stay valid until the slots are needed
        self._idle: dict[tuple, SlotPair] = {}
        self._staging = staging
        self._fold = fold

    # -- the op -------------------------------------------------------------------------------------
    def steer(self, x: torch.Tensor, site: int, eager: bool) -> None:
        """Add the rows' steering at this site to x, in place (nothing where the site does not steer).

        ``eager``: the call runs outside CUDA graphs, where each call's host time counts. The step's first steered
        site then gathers its rows' vectors at every site at once (one ``index_select``), and each site adds its own
        (one ``add_``): the same values, bit for bit, as the kernel's (``kernels.steer_add``, run in the graphs).
        Where that gather would exceed ``GATHER_BYTES``, or a site sees another number of rows, the site steers on
        its own through ``kernels.steer_add``'s ATen path."""
        index = self.index.get(site)
        if index is None:
            return
        if eager:
            gathered = self._gathered(x.shape[0])
            if gathered is not None:
                x.add_(gathered[index])  # a view made with the gather: no indexing call a site
                return
        kernels.steer_add(x, self._site_tables[index], self.row_slot, eager, out=x)

    def _gathered(self, rows: int) -> tuple[torch.Tensor, ...] | None:
        """Per site, [rows, hidden]: the step's first ``rows`` rows of its table, gathered for every site at once
        and made once a step (None where too large, or where this step's sites see another number of rows: those
        steer site by site)."""
        gathered = self._step_gather
        if gathered is None:
            if self.table.numel() // self.table.shape[1] * rows * self.table.element_size() > GATHER_BYTES:
                return None
            gathered = self._step_gather = self.table.index_select(1, self.row_slot[:rows]).unbind(0)
        return gathered if gathered[0].shape[0] == rows else None

    @property
    def active(self) -> bool:
        """Whether the rows of the step hold any slot (else the buffer is all zeros)."""
        return self._slots.held is not False

    # -- vectors and slots --------------------------------------------------------------------------
    def register_vectors(self, vectors: dict[str, bytes]) -> int:
        for key, data in vectors.items():
            vec = np.frombuffer(data, dtype=np.float32)
            if vec.shape != (self.hidden_size,):
                raise ValueError(f"vector {key}: length {vec.size}, model hidden size {self.hidden_size}")
            old = self.vectors.get(key)
            if old is not None and np.array_equal(old, vec):
                continue
            if old is not None:  # new values under a known name: no idle slot may keep the old ones
                if any(key == vkey for steering in self._in_use for _, _, vkey, _ in steering):
                    raise RuntimeError(f"steering vector {key} changed while requests steer with it")
                for stale in [k for k in self._idle if any(key == vkey for _, _, vkey, _ in k)]:
                    pair = self._idle.pop(stale)
                    self._free_slots.extend((pair.prefill, pair.decode))
            self._fold(b"vector", np.frombuffer(key.encode(), dtype=np.uint8), vec)
            self.vectors[key] = vec
        return len(self.vectors)

    def acquire(self, steer: tuple[Steer, ...]) -> tuple[tuple, SlotPair]:
        """The slots of a request's steering terms (filled if new), and their key: the terms as sorted
        (site, phases, vector key, scale) tuples."""
        key = tuple(sorted((t.site, t.phases, t.vector, t.scale) for t in steer))
        pair = self._in_use.get(key)
        if pair is None and key in self._idle:  # steered again (a sweep's next wave): reuse
            pair = self._in_use[key] = self._idle.pop(key)
        if pair is None:
            while len(self._free_slots) < 2 and self._idle:
                oldest = self._idle.pop(next(iter(self._idle)))
                self._free_slots.extend((oldest.prefill, oldest.decode))
            if len(self._free_slots) < 2:
                raise RuntimeError("interp steering table is full")
            missing = [vkey for _, _, vkey, _ in key if vkey not in self.vectors]
            if missing:
                raise KeyError(f"steering vector {missing[0]} was not registered on the worker")
            pair = SlotPair(self._free_slots.pop(), self._free_slots.pop())
            index = np.array([self.index[site] for site, _, _, _ in key], dtype=np.int64)
            phases = np.array([p for _, p, _, _ in key], dtype=np.int64)
            terms = np.stack([self.vectors[vkey] for _, _, vkey, _ in key]) \
                * np.array([c for _, _, _, c in key], dtype=np.float32)[:, None]
            sums = np.zeros((2, len(self.sites), self.hidden_size), dtype=np.float32)
            for phase_index, phase in enumerate((PREFILL, DECODE)):
                chosen = (phases & phase) != 0
                rows = index[chosen]
                if len(np.unique(rows)) == len(rows):
                    sums[phase_index, rows] = terms[chosen]
                else:  # several terms at one site: summed in key order
                    np.add.at(sums[phase_index], rows, terms[chosen])
            # the values follow from the key and the registered (folded) vectors
            self._fold(b"slots", np.array([pair.prefill, pair.decode]),
                       np.frombuffer(repr(key).encode(), dtype=np.uint8))
            values = self._staging.upload(sums).to(self.dtype)  # through the ring: no wait for the GPU
            self.table[:, pair.prefill].copy_(values[0])
            self.table[:, pair.decode].copy_(values[1])
            self._in_use[key] = pair
        pair.requests += 1
        return key, pair

    def release(self, key: tuple) -> None:
        """A request using the slots of ``key`` finished; unused slots stay valid until they are needed."""
        pair = self._in_use[key]
        pair.requests -= 1
        if pair.requests == 0:
            self._idle[key] = self._in_use.pop(key)

    # -- per step -----------------------------------------------------------------------------------
    def plan(self, plans: BatchPlans, starts: np.ndarray, computed: np.ndarray, num_rows: int, num_tokens: int,
             row_of: np.ndarray | None) -> None:
        """Write each row's slot: its request's prefill slot for prompt positions, decode slot after."""
        self._step_gather = None  # made from this step's slots, should the step steer outside the graphs
        if plans.any_kind & STEER:
            counts = starts[1:] - starts[:-1]
            slots = RowSlots.per_row(plans.decode, counts, num_rows)
            prompt_rows = plans.prompt_len - computed  # a request's rows before its first generated token
            if prompt_rows.max() > 0:
                for i in np.flatnonzero(prompt_rows > 0).tolist():  # the few requests still in their prompt
                    first = int(starts[i])
                    slots[first : first + min(int(prompt_rows[i]), int(counts[i]))] = plans.prefill[i]
            if row_of is not None:
                slots[row_of] = slots[:num_tokens].copy()
            self._slots.write(slots)  # nothing uploaded in a steady decode of the same batch
            self._fold(b"steer", slots[:num_tokens])
        else:
            self.clear()

    def clear(self) -> None:
        """No row steered this step."""
        self._step_gather = None
        self._slots.clear()

    def held_slots(self, n: int) -> bytes | None:
        """The slots of the first ``n`` rows as the buffer holds them (None: all zero)."""
        held = self._slots.held
        return held[:n].tobytes() if isinstance(held, np.ndarray) else None
