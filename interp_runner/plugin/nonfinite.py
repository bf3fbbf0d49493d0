"""Requests computed through a non-finite value: flagged on the device, read back with their results.

A huge but finite residual stream (a steering scale of 1e30, say) makes the model's norms' mean of squares overflow:
the normalized rows become zeros and every logit the same, with no inf or NaN in any activation or logit. So the
stream the model's final norm reads (``hidden + residual`` after the last decoder layer, ``layers``) is checked each
step, row by row: a row whose float32 sum of squares is not finite (an overflowing mean of squares, or an inf or
NaN in the stream) is bad. The check is plain torch code in the layer (one fused reduction under torch.compile);
the bad rows go to ``interp::flag_rows`` (``ops``), whose work here writes, on the device, 1 into each bad row's
flag slot: fixed buffers and shapes, no host sync, inside compiled graphs and CUDA graphs alike.

- ``row_slot[t]``: the flag slot of batch row ``t`` (model-row order in a step that skips layers); slot 0 takes
  rows of no tracked request (CUDA-graph padding, requests without a payload) and is never read;
- ``flags[slot]``: 1 once a row of the slot's request was bad.

A request holds one slot from admission to release; a packed request one for its shared prefix and one per cell (a
cell is flagged by either). At release its slots' flags are copied out and zeroed for their next owner, before any
further step; the copy goes on to pinned host memory at once, behind an event, so reading it with the request's
results (``collect``) waits for that copy alone, not for the steps queued after it. A request released by the
read-back itself (its results asked for before the runner's next step dropped it) has its copy made on a side
stream, which the steps queued meanwhile do not hold up.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from interp_runner.plugin.staging import RowSlots


Entries = tuple[list[str], np.ndarray, np.ndarray]  # released requests: rids, own slot and cell slot indices


class ResultFlags:
    def __init__(self, max_rows: int, device, staging, is_result_rank: bool):
        self._slots = RowSlots(max_rows, device, staging)
        self.row_slot = self._slots.values
        num_slots = 2 * max_rows  # far more than the requests and cells an engine holds at once
        self.flags = torch.zeros(num_slots, dtype=torch.int32, device=device)
        self._free = list(range(num_slots - 1, 0, -1))
        self._released: list[int] = []  # slots released since the last flush
        # their requests (and cells): rid, then the indices into ``_released`` of its own slot and of its cell's
        # (a request that is not packed: its own again); flagged where either slot is
        self._rids: list[str] = []
        self._own: list[int] = []
        self._cell: list[int] = []
        # copied out (host values, the event of their copy or None, their requests as above), not yet read
        self._held: list[tuple[torch.Tensor, torch.cuda.Event | None, Entries]] = []
        self.flagged: dict[str, bool] = {}  # read back, not yet collected
        self._staging = staging
        self._is_result_rank = is_result_rank
        self._side: torch.cuda.Stream | None = None  # a read-back's copies (``flush``), made on first use

    # -- the op -------------------------------------------------------------------------------------
    def flag_rows(self, bad: torch.Tensor) -> None:
        """Mark the slots of the rows where ``bad`` (one bool per row of the step) holds: two small kernels. Every row
        writes 1, good rows into slot 0, so rows sharing a slot never race to different values."""
        self.flags.index_fill_(0, torch.where(bad, self.row_slot[: bad.shape[0]], 0), 1)

    # -- requests -----------------------------------------------------------------------------------
    def _take(self) -> int:
        if not self._free:
            raise RuntimeError("interp: every result flag slot is in use")
        return self._free.pop()

    def acquire(self, plan) -> None:
        plan.flag_slot = self._take()
        if plan.cells is not None:
            n = len(plan.cells.rids)
            if len(self._free) < n:
                raise RuntimeError("interp: every result flag slot is in use")
            cut = len(self._free) - n
            plan.cell_flag_slots = np.array(self._free[cut:][::-1], dtype=np.int64)  # as n pops would take them
            del self._free[cut:]

    def release(self, plan) -> None:
        """The plan's slots are free again; their flags are copied out at the next ``flush``."""
        if plan.flag_slot == 0:
            return
        at = len(self._released)
        self._released.append(plan.flag_slot)
        if plan.cells is None:
            self._rids.append(plan.rid)
            self._own.append(at)
            self._cell.append(at)
        else:
            n = len(plan.cells.rids)
            self._rids += plan.cells.rids
            self._own += [at] * n
            self._cell += range(at + 1, at + 1 + n)
            self._released += plan.cell_flag_slots.tolist()
            self._free += plan.cell_flag_slots.tolist()
        self._free.append(plan.flag_slot)
        plan.flag_slot, plan.cell_flag_slots = 0, None

    def flush(self, between_steps: bool = False) -> None:
        """Copy the released slots' flags out and zero them (queued on the device before the next step).

        ``between_steps``: called by a read-back, not by a step. The released requests' steps have then all ended on
        the device (their outputs reached the host), so on a GPU the copy goes on a stream of its own and waits for
        none of the steps queued since (an engine scheduling ahead has the next one in flight); only the zeroing
        waits for them, on the device, so that the engine's host never stops for it."""
        if not self._released:
            return
        released = np.array(self._released, dtype=np.int64)
        on_device = self.flags.is_cuda
        main = torch.cuda.current_stream(self.flags.device) if on_device else None
        aside = self._side_stream() if between_steps and on_device else None
        with torch.cuda.stream(aside) if aside is not None else contextlib.nullcontext():
            if aside is None:
                index = self._staging.upload(released)
            else:
                index = torch.from_numpy(released).pin_memory().to(self.flags.device, non_blocking=True)
            if self._is_result_rank:
                picked = self.flags.index_select(0, index)
                host = torch.empty(picked.shape, dtype=picked.dtype, device="cpu", pin_memory=on_device)
                host.copy_(picked, non_blocking=on_device)
                copied = None
                if on_device:
                    copied = torch.cuda.Event()
                    copied.record()
                entries: Entries = (self._rids, np.array(self._own, dtype=np.int64),
                                    np.array(self._cell, dtype=np.int64))
                self._held.append((host, copied, entries))
        if aside is not None:
            main.wait_stream(aside)  # the zeroing after the copy, on the device
            index.record_stream(main)
        self.flags.index_fill_(0, index, 0)
        self._released = []
        self._rids, self._own, self._cell = [], [], []

    def _side_stream(self) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(self.flags.device)
        return self._side

    def collect(self, rids) -> dict[str, bool]:
        """Whether each of ``rids`` (released) was computed through a non-finite value."""
        self.flush(between_steps=True)
        held, self._held = self._held, []
        for host, copied, (released, own, cell) in held:
            if copied is not None:
                copied.synchronize()  # this copy only: the steps queued after it may still run
            values = host.numpy() != 0
            self.flagged.update(zip(released, (values[own] | values[cell]).tolist()))
        return {rid: self.flagged.pop(rid, False) for rid in rids}

    # -- per step -----------------------------------------------------------------------------------
    def plan(self, flag_slots: np.ndarray, packed, starts: np.ndarray, computed: np.ndarray, num_rows: int,
             num_tokens: int, row_of: np.ndarray | None) -> None:
        """Write each row's slot: its request's (``flag_slots``, one per request), or for a packed request's segment
        rows its cell's (``packed``: (batch index, plan) of each packed request)."""
        slots = RowSlots.per_row(flag_slots, starts[1:] - starts[:-1], num_rows)
        for i, plan in packed:
            cells = plan.cells
            if plan.flag_slot == 0:
                continue
            rows = np.arange(starts[i], starts[i + 1])
            positions = computed[i] + rows - starts[i]
            inside = positions >= cells.prefix
            k = np.minimum((positions[inside] - cells.prefix) // cells.stride, len(cells.rids) - 1)
            slots[rows[inside]] = plan.cell_flag_slots[k]
        if row_of is not None:
            slots[row_of] = slots[:num_tokens].copy()
        self._slots.write(slots)

    def clear(self) -> None:
        """No row of the step belongs to a tracked request."""
        self._slots.clear()
