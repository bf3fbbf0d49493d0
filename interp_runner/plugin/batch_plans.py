"""The admitted requests' plans as columns, and a batch's view of them.

A step reads the same few fields of every request's plan (its prompt length, steering and flag slots, what kinds of
work it has). ``RequestColumns`` holds them as one row per admitted request (row 0: a request without a plan), set at
admission; ``BatchPlans`` gathers a batch's rows with one index and is made once per batch: the steps of the same
requests in the same order reuse it. The components then loop over the few requests with work of their kind
(``where``), and compute every row's slots in numpy.
"""

from __future__ import annotations

import numpy as np

# kinds of work, a bit mask per request
PLANNED, STEER, PATCH, CAPTURE, SCORE, CELLS, KV_KEEP = 1, 2, 4, 8, 16, 32, 64
NEVER = 1 << 62  # a position no request reaches

_FIELDS = ("kinds", "prompt_len", "prefill", "decode", "flag_slot", "quiet", "cap_lo", "cap_hi")
_NO_PLAN = (0, 0, 0, 0, 0, -1, NEVER, -1)


def _row_of(plan) -> tuple[int, ...]:
    """A plan's values of ``_FIELDS``. ``quiet``: its last position with work beyond steering (a step after it
    needs nothing else; ``NEVER``: captures generated tokens). ``cap_lo`` .. ``cap_hi``: the positions its capture
    and keep groups may copy (a step outside them copies none of its rows)."""
    kinds = PLANNED
    quiet = plan.prompt_len - 1
    lo, hi = NEVER, -1
    if plan.steer_key is not None:
        kinds |= STEER
    if plan.patch is not None:
        kinds |= PATCH
        quiet = max(quiet, plan.patch.hi)
    for group in plan.capture_groups:
        kinds |= CAPTURE
        if group.generated:
            quiet = NEVER
            lo, hi = min(lo, group.lo, plan.prompt_len), NEVER
        else:
            quiet = max(quiet, group.hi)
            lo, hi = min(lo, group.lo), max(hi, group.hi)
    for group in plan.keep:
        kinds |= CAPTURE
        quiet = max(quiet, group.hi)
        lo, hi = min(lo, group.lo), max(hi, group.hi)
    if plan.score_ids is not None:
        kinds |= SCORE
    if plan.cells is not None:
        kinds |= CELLS
    if plan.kv_keep is not None:
        kinds |= KV_KEEP
    return kinds, plan.prompt_len, plan.prefill_slot, plan.decode_slot, plan.flag_slot, quiet, lo, hi


class RequestColumns:
    """``data[field, row]``: the admitted requests' values of ``_FIELDS``, a row each (row 0: no plan)."""

    def __init__(self, size: int = 256):
        self.data = np.empty((len(_FIELDS), size), dtype=np.int64)
        self.data[:] = np.array(_NO_PLAN, dtype=np.int64)[:, None]
        self._free = list(range(size - 1, 0, -1))

    def add(self, plan) -> int:
        """The row of an admitted plan (its slots taken already)."""
        if not self._free:
            size = self.data.shape[1]
            grown = np.empty((len(_FIELDS), 2 * size), dtype=np.int64)
            grown[:, :size] = self.data
            grown[:, size:] = np.array(_NO_PLAN, dtype=np.int64)[:, None]
            self.data = grown
            self._free = list(range(2 * size - 1, size - 1, -1))
        row = self._free.pop()
        self.data[:, row] = _row_of(plan)
        return row

    def remove(self, row: int) -> None:
        if row:
            self.data[:, row] = _NO_PLAN
            self._free.append(row)


class BatchPlans:
    """A batch's plans (``plans[i]``: request ``req_ids[i]``'s, or None) and their columns' values, in batch order."""

    __slots__ = ("req_ids", "epoch", "plans", "kinds", "any_kind", "prompt_len", "prefill", "decode", "flag_slot",
                 "quiet", "cap_lo", "cap_hi")

    def __init__(self, req_ids: tuple, plans: list, rows: np.ndarray, columns: RequestColumns, epoch: int = -1):
        self.req_ids, self.plans, self.epoch = req_ids, plans, epoch
        (self.kinds, self.prompt_len, self.prefill, self.decode, self.flag_slot, self.quiet, self.cap_lo,
         self.cap_hi) = columns.data.take(rows, axis=1)
        self.any_kind = int(np.bitwise_or.reduce(self.kinds)) if len(rows) else 0

    @classmethod
    def of(cls, plans: list) -> BatchPlans:
        """A batch of these plans, outside an engine's state."""
        columns = RequestColumns(len(plans) + 1)
        rows = np.array([columns.add(p) if p is not None else 0 for p in plans], dtype=np.intp)
        return cls(tuple(p.rid if p is not None else None for p in plans), list(plans), rows, columns)

    def where(self, kind: int) -> list[int]:
        """The batch indices of the requests with work of ``kind``, in batch order."""
        if not self.any_kind & kind:
            return []
        return np.flatnonzero(self.kinds & kind).tolist()

    def capturing(self, starts: np.ndarray, computed: np.ndarray) -> list[int]:
        """The batch indices of the requests whose capture or keep groups may copy rows of this step."""
        if not self.any_kind & CAPTURE:
            return []
        end = computed + (starts[1:] - starts[:-1])
        return np.flatnonzero((self.kinds & CAPTURE != 0) & (computed <= self.cap_hi) & (end > self.cap_lo)).tolist()
