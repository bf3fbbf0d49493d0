"""Patch rows: per patch site and batch row, the bank row and coefficients of the patch applied there.

``patch_idx / patch_coef / patch_mask [patch site, row]``: the bank row and (a, b) of the patch at a batch row
(``kernels.reference.patch_rows``: value <- a * value + b * source); rows without a patch are masked out and keep
their bits. Each step unmasks the rows the previous one patched and writes its own.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np
import torch

import interp_runner_kernels as kernels
from interp_runner.contracts import PatchColumns

from interp_runner.plugin.batch_plans import PATCH, BatchPlans
from interp_runner.plugin.records import PatchEntries

MANY_ENTRIES = 32  # from here on a request's entries are sorted in numpy


class PatchRows:
    def __init__(self, sites: tuple[int, ...], bank: torch.Tensor, device, max_rows: int, staging, fold):
        self.sites = sites
        self.index = {site: i for i, site in enumerate(sites)}
        self._site_index = np.full(max(sites, default=0) + 1, -1, dtype=np.int64)  # site -> its index; -1: none
        self._site_index[list(sites)] = np.arange(len(sites))
        self.max_rows = max_rows
        self.bank = bank
        num = max(len(sites), 1)
        self.idx = torch.zeros((num, max_rows), dtype=torch.int64, device=device)
        self.coef = torch.zeros((num, max_rows, 2), dtype=torch.float32, device=device)
        self.mask = torch.zeros((num, max_rows), dtype=torch.bool, device=device)
        self._flat: torch.Tensor | None = None  # entries written last step, cleared before the next
        self._flat_host: np.ndarray | None = None  # this step's entries ([patch site, row] flat indices)
        self._staging = staging
        self._fold = fold

    # -- the op -------------------------------------------------------------------------------------
    def patch(self, x: torch.Tensor, p: int) -> None:
        """Patch x's rows at patch site ``p``, in place."""
        kernels.patch_rows(x, self.bank, self.idx[p], self.coef[p], self.mask[p], out=x)

    def patch_pair(self, x: torch.Tensor, extra: torch.Tensor, p: int) -> None:
        """Patch the rows' sum into x and zero them in extra, in place."""
        kernels.patch_pair(x, extra, self.bank, self.idx[p], self.coef[p], self.mask[p], in_place=True)

    @property
    def active(self) -> bool:
        """Whether rows are patched this step."""
        return self._flat is not None

    def step_sites(self) -> set[int]:
        """The sites this step patches."""
        if self._flat_host is None:
            return set()
        return {self.sites[i] for i in np.unique(self._flat_host // self.max_rows).tolist()}

    # -- a request's entries ------------------------------------------------------------------------
    def entries(self, patch: PatchColumns, banks: list[int]) -> PatchEntries:
        """A request's ``patch`` payload, with the bank row of each entry's source."""
        if len(banks) > MANY_ENTRIES:
            return self._many_entries(patch, banks)
        # a few entries per request: plain lists (a step gathers them into one array each)
        sites = memoryview(patch.sites).cast("i").tolist()
        positions = memoryview(patch.positions).cast("i").tolist()
        a = memoryview(patch.value_weights).cast("f").tolist()
        b = memoryview(patch.source_weights).cast("f").tolist()
        ordered = list(zip(positions, sites))
        if any(x >= y for x, y in zip(ordered, ordered[1:])):
            # one entry per (site, position), a later entry winning; sorted by position, then site
            last = {key: i for i, key in enumerate(ordered)}
            keep = sorted(last.values(), key=ordered.__getitem__)
            sites, positions = [sites[i] for i in keep], [positions[i] for i in keep]
            a, b, banks = [a[i] for i in keep], [b[i] for i in keep], [banks[i] for i in keep]
        lookup = self.index  # a site the engine lacks raises KeyError
        # the flat index into [patch site, row] is base + (the request's first row in a step - its first position)
        base = [lookup[site] * self.max_rows + position for site, position in zip(sites, positions)]
        return PatchEntries(positions, base, banks, a, b, positions[0], positions[-1])

    def _many_entries(self, patch: PatchColumns, banks: list[int]) -> PatchEntries:
        """``entries`` for a request of many (packed cells): the same, sorted and looked up in numpy."""
        sites = np.frombuffer(patch.sites, dtype=np.int32)
        positions = np.frombuffer(patch.positions, dtype=np.int32)
        order = np.lexsort((sites, positions))  # stable: equal (position, site) keep their order, the last wins
        sites, positions = sites[order], positions[order]
        last = np.ones(len(order), dtype=bool)
        last[:-1] = (positions[1:] != positions[:-1]) | (sites[1:] != sites[:-1])
        keep = order[last]
        sites, positions = sites[last], positions[last]
        known = (sites >= 0) & (sites < len(self._site_index))
        index = np.where(known, self._site_index[np.where(known, sites, 0)], -1)
        if (index < 0).any():  # a site the engine lacks, as ``entries`` raises it
            raise KeyError(int(sites[index < 0][0]))
        base = index * self.max_rows + positions
        a = np.frombuffer(patch.value_weights, dtype=np.float32)[keep]
        b = np.frombuffer(patch.source_weights, dtype=np.float32)[keep]
        positions = positions.tolist()
        return PatchEntries(positions, base.tolist(), np.asarray(banks, dtype=np.int64)[keep].tolist(), a.tolist(),
                            b.tolist(), positions[0], positions[-1])

    # -- per step -----------------------------------------------------------------------------------
    def plan(self, plans: BatchPlans | None, starts, computed, row_of: np.ndarray | None) -> None:
        """Point this step's patched rows at their bank rows (``plans`` None: none); rows patched last step are
        unmasked first."""
        flat, banks, a, b = [], [], [], []
        patched = plans.where(PATCH) if plans is not None else ()
        if patched:
            starts, computed = starts.tolist(), computed.tolist()
            for i in patched:
                entries = plans.plans[i].patch
                first, lo, hi = computed[i], entries.lo, entries.hi
                end = first + starts[i + 1] - starts[i]
                if hi < first or lo >= end:
                    continue
                positions = entries.positions
                j, k = 0, len(positions)
                if first > lo or end <= hi:  # part of the prompt in this step
                    j, k = bisect_left(positions, first), bisect_left(positions, end)
                shift = starts[i] - first
                flat += [x + shift for x in entries.base[j:k]]
                banks += entries.bank_rows[j:k]
                a += entries.value_weights[j:k]
                b += entries.source_weights[j:k]
        if self._flat is not None:
            self.mask.view(-1)[self._flat] = False
            self._flat = None
        self._flat_host = None
        if not flat:
            return
        mask = self.mask.view(-1)
        flat, banks = np.array(flat, dtype=np.int64), np.array(banks, dtype=np.int64)
        self._flat_host = flat
        if row_of is not None:
            site, row = np.divmod(flat, self.max_rows)
            flat = site * self.max_rows + row_of[row]
        coef = np.array([a, b], dtype=np.float32).T.copy()
        device_flat = self._staging.upload(flat)
        self.idx.view(-1)[device_flat] = self._staging.upload(banks)
        self.coef.view(-1, 2)[device_flat] = self._staging.upload(coef)
        mask[device_flat] = True
        self._flat = device_flat
        self._fold(b"patch", flat, banks, coef)
