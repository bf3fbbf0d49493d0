"""Packed cells: a packed request split into attention sequences, and the cells that skip layers.

A packed request (``interp_runner.compile.packing``) holds a shared prefix and then one block-aligned segment per cell. In a
step with packed cells each segment runs as its own attention sequence (seeing the prefix's blocks and its own) at
the positions of the prompt it stands for, and each cell is scored at its last prompt token. Cells whose first
layer is above 0 enter the model there with the residual stream their run kept in the patch bank: the step then
runs layer by layer over the sequences in order of first layer (``skipping.run_layers``), and ``row_of`` maps
batch rows to rows in the model's order. Cells that reuse their run's KV (``kept_kv``) compute from their restored
token on: their segment's rows before it are computed in no layer, the kept blocks are copied in instead. Other
requests stay one sequence each; nothing changes in a step without packed cells.
"""

from __future__ import annotations

import numpy as np
import torch

from interp_runner.contracts import Cells, ReuseKv, StartLayer
from interp_runner.payload import unpack_positions
from interp_runner.sites import site_id

from interp_runner.plugin.readback import CellScores, Scored
from interp_runner.plugin.records import CellLayout, LayerSkip, RequestPlan, StreamKey


class PackedSequences:
    def __init__(self, bank, kept_kv, staging, fold):
        # a step with packed cells: its attention sequences (the metadata builders read them), and, where it skips
        # layers, the model row of each batch row and each builder's metadata per number of leading sequences
        self.sequences: dict | None = None
        self.row_of: np.ndarray | None = None
        self.layer_metadata: dict[int, dict[int, object]] = {}
        self._bank = bank
        self._kept_kv = kept_kv
        self.reused_rows = 0  # rows packed cells did not compute, their runs' kept KV standing for them
        self._staging = staging
        self._fold = fold

    def end_step(self) -> None:
        self.sequences, self.row_of = None, None
        self.layer_metadata = {}

    # -- a request's cells --------------------------------------------------------------------------
    def admit(self, plan: RequestPlan, cells: Cells) -> None:
        """A packed request's cell layout (its ``cells`` payload) and, for cells that skip layers, the streams
        they start from (the plan is voided where one is missing)."""
        scored: dict[bytes, np.ndarray] = {}  # cells of one fact score the same token ids
        for ids in cells.scores:
            if ids not in scored:
                scored[ids] = unpack_positions(ids).astype(np.int64)
        plan.cells = CellLayout(cells.prefix, cells.stride, cells.length, list(cells.rids),
                                [scored[ids] for ids in cells.scores])
        if cells.starts and plan.void is None:
            self._admit_starts(plan, cells.starts)
        if cells.reuses and plan.void is None:
            self._admit_reuse(plan, cells.reuses)

    def _admit_starts(self, plan: RequestPlan, starts: tuple[StartLayer | None, ...]) -> None:
        """Each cell's first layer and the bank rows of the stream its segment starts from there."""
        cells = plan.cells
        distinct: dict[tuple, int] = {}  # (layer, run) -> its index (cells of a request share a few)
        which = np.array([distinct.setdefault((s.layer, s.run), len(distinct)) if s else -1 for s in starts],
                         dtype=np.int64)
        layers = np.zeros(len(distinct) + 1, dtype=np.int64)  # the last: cells that start at the bottom
        table = np.zeros((len(distinct) + 1, cells.stride), dtype=np.int64)
        segment = []  # the streams read
        for (layer, run), i in distinct.items():
            key = StreamKey(run, site_id(layer, "pre_attn"))
            stream, rows = self._bank.stream(key), None
            if stream is not None:
                positions, bank = stream
                a = int(np.searchsorted(positions, cells.prefix))
                if a + cells.length <= len(positions) and positions[a + cells.length - 1] == \
                        cells.prefix + cells.length - 1 and positions[a] == cells.prefix:
                    rows = bank[a : a + cells.length]
            if rows is None:
                plan.void = f"the residual stream its cells start from is not on the worker ({run}, layer {layer})"
                return
            layers[i] = layer
            table[i, : cells.length] = rows
            segment.append(key)
        first, inject = layers[which], table[which]
        cells.start, cells.inject = first, inject
        plan.streams = tuple(segment)
        self._bank.use_streams(plan.streams)
        self._fold(b"start", first, inject)

    def _admit_reuse(self, plan: RequestPlan, reuse: tuple[ReuseKv | None, ...]) -> None:
        """Each cell's first computed position: the one its ``reuse`` names, where its run's KV of the positions
        before is kept (else its segment's first), and the kept blocks of its segment's blocks before it."""
        cells, kept = plan.cells, self._kept_kv
        first = np.full(len(reuse), cells.prefix, dtype=np.int64)
        table = np.zeros((len(reuse), cells.stride // kept.block_size), dtype=np.int64)
        by_run: dict[str, list[int]] = {}
        for k, entry in enumerate(reuse):
            if entry is not None:
                by_run.setdefault(entry.run, []).append(k)
        runs: dict[str, int] = {}  # run -> its first cell that reuses it
        cols = np.arange(table.shape[1])
        for run, ks in by_run.items():
            ks = np.array(ks)
            position = np.minimum([reuse[k].position for k in ks], cells.prefix + cells.length - 1)
            kept_to, rows = kept.kept_from(run, cells.prefix)
            ok = (position > cells.prefix) & (position <= kept_to)
            if not ok.any():
                continue
            ks, position = ks[ok], position[ok]
            first[ks] = position
            blocks = -(-position // kept.block_size) - cells.prefix // kept.block_size
            table[ks] = np.where(cols < blocks[:, None], rows[np.minimum(cols, len(rows) - 1)], 0)
            runs[run] = int(ks[0])
        if not runs:
            return
        cells.reuse_from, cells.reuse_rows = first, table
        plan.kv_runs = tuple(sorted(runs, key=runs.get))
        for run in runs:
            kept.use(run)
        self._fold(b"reuse", first, table)

    # -- per step -----------------------------------------------------------------------------------
    def plan(self, plans: list, batch, view) -> CellScores | None:
        """Split each packed request of the step (``batch``, from the runner ``view``) into attention sequences, put
        the segments' tokens at the positions of the prompt they stand for (written into the runner's positions),
        and return the cells whose last prompt token the step computes."""
        n = batch.num_reqs
        starts = batch.query_start[: n + 1].astype(np.int64)
        computed = batch.computed[:n].astype(np.int64)
        block = view.block_size
        staging = self._staging
        # per request, its sequences: (query starts, query lengths, sequence lengths, token shifts, first shifted
        # block, first layer, tokens before a segment's padding, tokens at its front whose kept KV it reuses); a
        # request that is not packed is one sequence
        parts, part_owner = [], []
        score_rows, score_rids, score_ids = [], [], []
        inject_rows, inject_at = [], []  # cells that skip layers: bank rows of their tokens' stream, first row
        reuse_at, reuse_rows = [], []  # a batch row in each block whose kept KV is copied in, and the kept block
        for i, plan in enumerate(plans):
            first, count = int(computed[i]), int(starts[i + 1] - starts[i])
            end = first + count
            cells = plan.cells if plan is not None else None
            if cells is None or end <= cells.prefix:
                parts.append(([starts[i]], [count], [end], [0], [0], [0], [count], [0]))
                part_owner.append(i)
                continue
            p, stride = cells.prefix, cells.stride
            if first < p:
                parts.append(([starts[i]], [p - first], [p], [0], [0], [0], [p - first], [0]))
                part_owner.append(i)
            lo = max(first, p)
            k = np.arange((lo - p) // stride, (end - 1 - p) // stride + 1)
            seg_lo = np.maximum(lo, p + k * stride)
            seg_hi = np.minimum(end, p + (k + 1) * stride)
            shift = k * stride
            live = np.clip(p + shift + cells.length - seg_lo, 0, seg_hi - seg_lo)
            front = np.zeros_like(k)
            if cells.reuse_from is not None:
                front = np.clip(shift + cells.reuse_from[k] - seg_lo, 0, live)
                if front.any():
                    offset = np.arange(int(front.sum())) - np.repeat(np.cumsum(front) - front, front)
                    position = np.repeat(seg_lo - shift, front) + offset  # the reused rows' prompt positions
                    opens = (position % block == 0) | (offset == 0)  # the first of each block's in this step
                    reuse_at.append((np.repeat(starts[i] + seg_lo - first, front) + offset)[opens])
                    reuse_rows.append(cells.reuse_rows[np.repeat(k, front)[opens], (position[opens] - p) // block])
            parts.append((starts[i] + seg_lo - first, seg_hi - seg_lo, seg_hi - shift, shift,
                          np.full(len(k), p // block), cells.start[k] if cells.start is not None else np.zeros_like(k),
                          live, front))
            part_owner.append(i)
            if cells.start is not None:
                own = seg_lo - p - shift  # the first of each segment's tokens in this step, as a segment offset
                lens = seg_hi - seg_lo
                at = np.repeat(own - np.cumsum(lens) + lens, lens) + np.arange(int(lens.sum()))
                inject_rows.append(cells.inject[np.repeat(k, lens), at])
                inject_at.append(starts[i] + lo - first)
            last = p + shift + cells.length - 1
            hit = (last >= seg_lo) & (last < seg_hi)
            score_rows.append(starts[i] + last[hit] - first)
            hit_cells = k[hit].tolist()
            score_rids += [cells.rids[j] for j in hit_cells]
            score_ids += [cells.score_ids[j] for j in hit_cells]
        q_start, q_len, seq_len, shift, from_block, first_layer, live, front = (
            np.concatenate([np.asarray(part[f], dtype=np.int64) for part in parts]) for f in range(8))
        owner = np.repeat(np.array(part_owner), [len(part[1]) for part in parts])
        self._fold(b"sequences", q_start, q_len, seq_len, shift, first_layer)
        num_tokens = int(starts[n])
        positions = np.repeat(seq_len - q_len - q_start, q_len) + np.arange(num_tokens)
        skip = None
        if not (live > front).any():  # a step of nothing but padding or reused positions: computed as it is
            live, front, reuse_at = q_len, np.zeros_like(q_len), []
        if first_layer.any() or (live < q_len).any() or front.any():
            # the model runs the sequences in order of their first layer, so a layer's rows are a prefix of them;
            # segments' padding is never computed (no token of theirs reads it), nor their positions whose kept KV
            # is copied in: their rows come last, in no layer
            inject = np.zeros(num_tokens, dtype=np.int64)
            for rows, at in zip(inject_rows, inject_at):
                inject[at : at + len(rows)] = rows
            order = np.argsort(first_layer, kind="stable")
            order = order[live[order] > front[order]]
            offset = np.arange(num_tokens) - np.repeat(q_start, q_len)
            dead = np.flatnonzero((offset >= np.repeat(live, q_len)) | (offset < np.repeat(front, q_len)))
            seq_len = seq_len - (q_len - live)
            q_len, seq_len, shift, from_block, first_layer, owner = (
                x[order] for x in (live - front, seq_len, shift, from_block, first_layer, owner))
            old_start, q_start = (q_start + front)[order], np.zeros(len(order), dtype=np.int64)
            np.cumsum(q_len[:-1], out=q_start[1:])
            computed_rows = int(q_len.sum())
            perm = np.concatenate([np.repeat(old_start - q_start, q_len) + np.arange(computed_rows), dead])
            self.row_of = np.empty(num_tokens, dtype=np.int64)  # model row of each batch row
            self.row_of[perm] = np.arange(num_tokens)
            token_layer = np.repeat(first_layer, q_len)
            layers = np.arange(int(first_layer[-1]) + 1)
            num_first = int(np.searchsorted(token_layer, 0, side="right"))
            skip = LayerSkip(
                perm=staging.upload(perm[:computed_rows]),
                rows=np.searchsorted(token_layer, layers, side="right").tolist(),
                seqs=np.searchsorted(first_layer, layers, side="right").tolist(),
                inject=staging.upload(inject[perm[num_first:computed_rows]]),
            )
            if reuse_at:
                at, rows = np.concatenate(reuse_at), np.concatenate(reuse_rows)
                skip.reuse = (staging.upload(at), staging.upload(rows))
                self.reused_rows += int(front.sum())
                self._fold(b"reused", at, rows)
            positions = positions[perm]
            self._fold(b"skip", perm, inject)
        num_seqs = len(q_len)
        width = int((-(-seq_len // block)).max())
        cols = np.arange(width)[None, :]
        cols = cols + np.where(cols >= from_block[:, None], (shift // block)[:, None], 0)
        table = view.block_table(n)
        cols = np.minimum(cols, table.shape[1] - 1)
        query_start = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(q_len, out=query_start[1:])
        prompt_len = view.prompt_lens(n).astype(np.int64)
        # what the attention metadata builders read instead of the runner's (``runner_patches``)
        self.sequences = {
            "num_tokens": num_tokens,
            "query_start_loc": staging.upload(query_start),
            "query_start_loc_cpu": torch.from_numpy(query_start),
            "seq_lens": staging.upload(seq_len.astype(np.int32)),
            "seq_lens_cpu": torch.from_numpy(seq_len.astype(np.int32)),
            "computed_cpu": torch.from_numpy((seq_len - q_len).astype(np.int32)),
            "num_reqs": num_seqs,
            "max_query_len": int(q_len.max()),
            "max_seq_len": int(seq_len.max()),
            "block_table": table[staging.upload(owner)[:, None], staging.upload(cols)],
            "is_prefilling": torch.from_numpy(seq_len - q_len < prompt_len[owner]),
            "skip": skip,  # None, or a LayerSkip
        }
        view.write_positions(num_tokens, staging.upload(positions))
        if score_rows:
            return CellScores(staging.upload(np.concatenate(score_rows)), Scored(score_rids, score_ids))
        return None
