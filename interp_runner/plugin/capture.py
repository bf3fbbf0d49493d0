"""The capture buffer: the rows each capture site copies out in a step, for the host or into the patch bank.

``cap_src / cap_dest [capture site, row]``, ``cap_count [capture site]``: per capture site, which batch rows the
op copies (``cap_src[:count]``) to which rows of ``cap_out``, one buffer shared by all sites: first the rows for the
host, then the rows kept in the patch bank that the host's do not hold already (copied there after the step). The
kernel reads the count on the device, so capture runs inside CUDA graphs; a step that captures nothing costs one
near-empty launch per capture site. A step whose rows exceed ``cap_out`` runs outside the graphs and copies its
rows out directly.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import numpy as np
import torch

import interp_runner_kernels as kernels
from interp_runner.contracts import Capture
from interp_runner.payload import unpack_positions
from interp_runner_kernels.reference import gather_rows

from interp_runner.plugin.batch_plans import BatchPlans
from interp_runner.plugin.readback import CaptureMeta
from interp_runner.plugin.records import CaptureGroup


class RowCopy(NamedTuple):
    """Rows copied on the device: ``src`` rows (of the step, or of ``cap_out``) to ``dest`` rows of the bank."""

    src: torch.Tensor
    dest: torch.Tensor


class Gathered(NamedTuple):
    """A site's captured rows, copied out directly (a step that overflows ``cap_out``)."""

    site: int
    values: torch.Tensor


def capture_groups(specs: tuple[Capture, ...]) -> list[CaptureGroup]:
    """A request's captures as groups in which every site appears once: a site named by several captures gets the
    union of their positions (a step then copies each of its rows once, so a site never captures more rows than
    the step has)."""
    by_site: dict[int, list[tuple[bytes, bool]]] = defaultdict(list)
    for spec in specs:
        for site in spec.sites:
            by_site[site].append((spec.positions, spec.generated))
    grouped: dict[tuple[bytes, bool], list[int]] = defaultdict(list)
    for site, keys in by_site.items():
        if len(set(keys)) == 1:
            grouped[keys[0]].append(site)
        else:
            union = np.concatenate([unpack_positions(p) for p, _ in keys])  # made unique below
            grouped[(union.tobytes(), any(g for _, g in keys))].append(site)
    groups = []
    for (positions, generated), sites in grouped.items():
        positions = np.unique(unpack_positions(positions)).astype(np.int64)  # sorted, once
        lo, hi = (int(positions[0]), int(positions[-1])) if len(positions) else (0, -1)
        groups.append(CaptureGroup(tuple(sorted(sites)), positions, generated, lo, hi))
    return groups


class CaptureBuffer:
    """``width``: the widest capture site's rows (the hidden size, or a router's experts if more); a narrower site
    copies its rows padded with zeros, and they are read back at its own width (``Readback.widths``)."""

    def __init__(self, sites: tuple[int, ...], width: int, dtype, device, max_rows: int, bank, results,
                 staging, fold):
        self.sites = sites
        self.index = {site: i for i, site in enumerate(sites)}
        self.max_rows = max_rows
        num = max(len(sites), 1)
        self.cap_src = torch.zeros((num, max_rows), dtype=torch.int64, device=device)
        self.cap_dest = torch.zeros((num, max_rows), dtype=torch.int64, device=device)
        self.cap_count = torch.zeros(num, dtype=torch.int32, device=device)
        self.cap_out = torch.zeros((max_rows if sites else 1, width), dtype=dtype, device=device)
        self._count_dirty = False
        self.step_sites: set[int] = set()  # the sites this step captures or keeps rows at
        self.direct = False  # a step run layer by layer: the op is called only where its step has work
        # an overflowing step: site -> rows copied directly, for the host and into the bank; the gathered rows
        self.direct_rows: dict[int, torch.Tensor] = {}
        self.keep_rows: dict[int, RowCopy] = {}
        self.gathered: list[Gathered] = []
        self._keep_dest: RowCopy | None = None  # this step's kept values: cap_out rows -> bank rows
        self._keep_keys: list[np.ndarray] = []  # keys this step writes
        self._meta: CaptureMeta | None = None  # this step's rows for the host
        self._total = 0  # rows of cap_out written for the host this step
        self._bank = bank
        self._results = results
        self._staging = staging
        self._fold = fold

    # -- the op -------------------------------------------------------------------------------------
    def capture(self, site: int, out: torch.Tensor, extra: torch.Tensor | None) -> None:
        if self.direct and site not in self.step_sites:
            return  # run layer by layer: no launch where the step captures nothing
        if self.direct_rows or self.keep_rows:  # an overflowing step, outside the graphs
            rows = self.direct_rows.get(site)
            if rows is not None:
                self.gathered.append(Gathered(site, gather_rows(out, rows, extra)))
            kept = self.keep_rows.get(site)
            if kept is not None:
                self._bank.values[kept.dest] = gather_rows(out, kept.src, extra)
            return
        k = self.index.get(site)
        if k is not None:
            n, cap_out = out.shape[0], self.cap_out
            if out.shape[1] != cap_out.shape[1]:  # hidden-size rows beside wider ones
                cap_out = cap_out[:, : out.shape[1]]
            kernels.capture_rows(out, extra, self.cap_src[k, :n], self.cap_dest[k, :n], self.cap_count[k : k + 1],
                                 cap_out)

    @property
    def pending(self) -> bool:
        """Whether this step captures rows for the host."""
        return self._meta is not None

    # -- per step -----------------------------------------------------------------------------------
    def plan(self, plans: BatchPlans | None, starts, computed, row_of: np.ndarray | None) -> bool:
        """Point each capture site at this step's rows (those captured for the host, then those kept in the bank;
        ``plans`` None: none); returns whether the step must run outside the graphs (its rows do not fit
        ``cap_out``: they are then copied out directly)."""
        rows_by_site: dict[int, list[np.ndarray]] = defaultdict(list)
        keep_by_site: dict[int, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)  # (rows, bank rows)
        kept_keys: list[np.ndarray] = []
        meta_sites: list[int] = []  # per (site, request) captured for the host: its site, request and positions
        meta_rids: list[str] = []
        meta_positions: list[np.ndarray] = []
        total = 0
        for i in plans.capturing(starts, computed) if plans is not None else ():
            plan = plans.plans[i]
            first, count = int(computed[i]), int(starts[i + 1] - starts[i])
            end = first + count
            for group in plan.capture_groups:
                generated = group.generated
                if not generated and (first > group.hi or end <= group.lo):
                    continue  # nothing of this group in the step's rows
                prompt_positions = group.positions
                a, b = np.searchsorted(prompt_positions, (first, end))
                chosen = prompt_positions[a:b]
                if generated and end > plan.prompt_len:
                    chosen = np.union1d(chosen, np.arange(max(first, plan.prompt_len), end))
                if not len(chosen):
                    continue
                rows = chosen - first + starts[i]
                if row_of is not None:
                    rows = row_of[rows]
                for site in group.sites:
                    rows_by_site[site].append(rows)
                    meta_sites.append(site)
                    meta_rids.append(plan.rid)
                    meta_positions.append(chosen)
                    total += len(rows)
            for group in plan.keep:
                if first > group.hi or end <= group.lo:
                    continue
                positions, bank, keys = group.positions, group.rows, group.keys
                a, b = np.searchsorted(positions, (first, end))
                rows = positions[a:b] - first + starts[i]
                if row_of is not None:
                    rows = row_of[rows]
                for j, site in enumerate(group.sites):
                    dest, named = bank[j, a:b], keys[j, a:b]
                    wanted = dest >= 0
                    if not wanted.all():
                        dest, named, site_rows = dest[wanted], named[wanted], rows[wanted]
                    else:
                        site_rows = rows
                    if len(dest):
                        keep_by_site[site].append((site_rows, dest))
                        kept_keys.append(named)
                        total += len(dest)
        self.direct_rows, self.keep_rows, self._keep_dest, self._keep_keys = {}, {}, None, kept_keys
        self.step_sites = rows_by_site.keys() | keep_by_site.keys()
        if self._count_dirty:
            self.cap_count.zero_()
            self._count_dirty = False
        self._meta = None
        if not rows_by_site and not keep_by_site:
            return False
        staging = self._staging
        if total > self.cap_out.shape[0]:
            device_rows: dict[bytes, torch.Tensor] = {}
            for site, parts in rows_by_site.items():
                rows = np.concatenate(parts)
                key = rows.tobytes()
                if key not in device_rows:
                    device_rows[key] = staging.upload(rows)
                self.direct_rows[site] = device_rows[key]
            for site, parts in keep_by_site.items():
                rows, dest = np.concatenate([r for r, _ in parts]), np.concatenate([d for _, d in parts])
                self.keep_rows[site] = RowCopy(staging.upload(rows), staging.upload(dest))
                self._fold(b"keep-direct", rows, dest)
            if meta_sites:  # laid out in the order the sites' gathers append (see after_forward)
                self._meta = CaptureMeta(meta_sites, meta_rids, meta_positions, [-1] * len(meta_sites))
            self._fold(b"capture-direct", *(r for parts in rows_by_site.values() for r in parts))
            return True
        # cap_out: the rows for the host first, in site order, each site's rows in the order of its requests; then
        # the kept rows the host's do not hold already, in site order (a site copies a row once: at most the
        # step's rows)
        host_total = sum(len(r) for parts in rows_by_site.values() for r in parts)
        flat_index, src, dest, keep_from, keep_to = [], [], [], [], []
        counts = np.zeros(self.cap_count.shape[0], dtype=np.int32)
        first_row, offset, kept_offset = {}, 0, host_total
        for site in sorted(rows_by_site.keys() | keep_by_site.keys()):
            k = self.index[site]
            host = rows_by_site.get(site)
            host = np.concatenate(host) if host else np.zeros(0, dtype=np.int64)
            new = np.zeros(0, dtype=np.int64)
            kept = keep_by_site.get(site)
            if kept:
                rows, bank = np.concatenate([r for r, _ in kept]), np.concatenate([d for _, d in kept])
                at = np.full(len(rows), -1, dtype=np.int64)  # the cap_out row holding it already
                if len(host):
                    order = np.argsort(host)
                    i = np.minimum(np.searchsorted(host, rows, sorter=order), len(host) - 1)
                    found = host[order[i]] == rows
                    at[found] = offset + order[i[found]]
                fresh = at < 0
                new = rows[fresh]
                at[fresh] = np.arange(kept_offset, kept_offset + len(new))
                keep_from.append(at)
                keep_to.append(bank)
            counts[k] = len(host) + len(new)
            flat_index.append(k * self.max_rows + np.arange(counts[k]))
            src += [host, new]
            dest += [np.arange(offset, offset + len(host)), np.arange(kept_offset, kept_offset + len(new))]
            first_row[site] = offset
            offset += len(host)
            kept_offset += len(new)
        if meta_sites:
            meta_first = []
            for site, chosen in zip(meta_sites, meta_positions):
                meta_first.append(first_row[site])
                first_row[site] += len(chosen)
            self._meta = CaptureMeta(meta_sites, meta_rids, meta_positions, meta_first)
        flat = staging.upload(np.concatenate(flat_index))
        self.cap_src.view(-1)[flat] = staging.upload(np.concatenate(src))
        self.cap_dest.view(-1)[flat] = staging.upload(np.concatenate(dest))
        staging.upload(counts, into=self.cap_count)
        self._count_dirty = True
        self._total = host_total
        if keep_to:
            keep_from, keep_to = np.concatenate(keep_from), np.concatenate(keep_to)
            self._keep_dest = RowCopy(staging.upload(keep_from), staging.upload(keep_to))
            self._fold(b"keep", keep_from, keep_to)
        self._fold(b"capture", counts, *src)
        return False

    def after_forward(self, keep_results: bool) -> None:
        """Hand this step's captured rows to the results (copies on the device, read back in bulk); copy its kept
        rows into the bank, whose keys then count as registered."""
        if self._keep_dest is not None:
            bank = self._bank.values
            bank[self._keep_dest.dest] = self.cap_out[self._keep_dest.src, : bank.shape[1]]
            self._keep_dest = None
        self.keep_rows = {}
        for keys in self._keep_keys:
            self._bank.written(keys)
        self._keep_keys = []
        if self.direct_rows:  # an overflowing step: its gathers were appended in site order
            gathered, self.gathered, self.direct_rows = self.gathered, [], {}
            if keep_results and gathered:
                width = self.cap_out.shape[1]  # a hidden-size site's rows beside wider ones (router logits)
                values = torch.cat([torch.nn.functional.pad(g.values, (0, width - g.values.shape[1]))
                                    for g in gathered])
                meta, offset = CaptureMeta([], [], [], []), 0
                by_site = defaultdict(list)
                for site, rid, chosen in zip(self._meta.sites, self._meta.rids, self._meta.positions):
                    by_site[site].append((rid, chosen))
                for site, _ in gathered:
                    for rid, chosen in by_site[site]:
                        meta.sites.append(site)
                        meta.rids.append(rid)
                        meta.positions.append(chosen)
                        meta.first.append(offset)
                        offset += len(chosen)
                self._results.hold_captures(values, meta)
        elif self._meta is not None and keep_results:
            self._results.hold_captures(self.cap_out[: self._total], self._meta)
        self._meta = None
