"""Prompt KV kept on the workers, for packed cells that reuse it.

A causal-trace cell computes what its corrupted run does at every position before the one it restores, at every
layer. The run keeps its prompt's KV (``keep`` with ``kv``): the steps that compute it copy its KV-cache blocks out
into rows here. A packed cell with ``reuse`` computes its positions from the restored one on only: before its step,
the kept blocks that hold its positions before that one are copied into its segment's blocks (a segment starts at a
block boundary, at its prompt's positions), and the step then writes the cell's own positions over the rest.

Whole blocks are copied, never positions: how a backend lays positions out inside a block is its own (vLLM's CPU
attention tiles them). A quantized cache keeps nothing; cells then compute every position of their segment.
"""

from __future__ import annotations

import numpy as np
import torch

from interp_runner.contracts import PluginSpec
from interp_runner.payload import KV_PREFIX


class KeptKV:
    def __init__(self, num_rows: int, num_layers: int, block_numel: int, block_size: int, dtype, device, staging,
                 fold):
        self.block_size = block_size
        # [layer, row, one block of that layer's KV cache, flat]
        self.values = torch.zeros((num_layers, num_rows, block_numel), dtype=dtype, device=device) \
            if num_rows else None
        self._free = list(range(num_rows - 1, -1, -1))
        self._rows: dict[str, np.ndarray] = {}  # run -> its rows, by prompt block
        self._written: dict[str, np.ndarray] = {}  # run -> whether a step has computed each prompt position
        self._users: dict[str, int] = {}
        self._released: set[str] = set()
        self._staging = staging
        self._fold = fold
        self.keeping = 0  # admitted requests that keep KV
        self._out: list[tuple[np.ndarray, np.ndarray]] = []  # this step: (batch rows, rows here) copied out
        self._out_written: list[tuple[str, np.ndarray]] = []
        self._view = None
        self._checked = False

    @classmethod
    def for_engine(cls, vllm_config, spec: PluginSpec, staging, fold) -> KeptKV:
        """Rows for the prompts the engine's spec keeps (``kv_rows`` positions in ``kv_runs`` prompts); none for a
        quantized cache."""
        positions, prompts = spec.kv_rows, spec.kv_runs
        cache = vllm_config.cache_config if positions else None
        if cache is None or cache.cache_dtype != "auto":
            return cls(0, 0, 0, 1, None, None, staging, fold)
        model, parallel, block = vllm_config.model_config, vllm_config.parallel_config, cache.block_size
        block_numel = block * model.get_num_kv_heads(parallel) * 2 * model.get_head_size()
        return cls(-(-positions // block) + prompts, model.get_num_layers(parallel), block_numel, block,
                   model.dtype, torch.get_default_device(), staging, fold)

    def _caches(self, view) -> list[torch.Tensor] | None:
        """The KV caches, per layer, if their blocks are the rows here (else nothing is ever kept)."""
        caches = view.kv_caches()
        if not self._checked:
            self._checked = True
            numel = self.values.shape[2]
            if len(caches) != self.values.shape[0] or any(
                    c.dtype != self.values.dtype or c[0].numel() != numel or c.shape[0] * numel != c.numel()
                    for c in caches):
                self.values = None
        return caches if self.values is not None else None

    # -- a run's rows -------------------------------------------------------------------------------
    def reserve(self, run: str, prompt_len: int) -> bool:
        """Rows for a run's prompt KV; whether the request writes them (not when the run's KV is already kept or
        there is no room: cells then compute its positions)."""
        if self.values is None:
            return False
        self._released.discard(run)
        blocks = -(-prompt_len // self.block_size)
        if run in self._rows or blocks > len(self._free):
            return False
        self._rows[run] = np.array([self._free.pop() for _ in range(blocks)], dtype=np.int64)
        self._written[run] = np.zeros(prompt_len, dtype=bool)
        self.use(run)
        self.keeping += 1
        return True

    def kept_from(self, run: str, lo: int) -> tuple[int, np.ndarray]:
        """From position ``lo`` (at a block boundary) on: the end of the run's positions whose KV is written without
        a gap (``lo`` where none is), and the rows of the run's blocks from ``lo``'s on (positions ``lo .. hi - 1``
        take the first ``ceil(hi / block_size) - lo // block_size`` of them)."""
        written = self._written.get(run)
        if written is None or lo >= len(written):
            return lo, np.zeros(0, dtype=np.int64)
        gaps = np.flatnonzero(~written[lo:])
        return lo + (int(gaps[0]) if len(gaps) else len(written) - lo), self._rows[run][lo // self.block_size :]

    def use(self, run: str) -> None:
        self._users[run] = self._users.get(run, 0) + 1

    def finish(self, runs: tuple[str, ...], writer: bool = False) -> None:
        """Requests that used (or wrote) ``runs`` finished: free what only they held."""
        if writer:
            self.keeping -= len(runs)
        for run in runs:
            self._users[run] -= 1
            self._free_if_unused(run)

    def release(self, keys: list[str]) -> None:
        """Free runs' KV (keys ``kv_key(run)``) now, or when their last user finishes."""
        for key in keys:
            if key.startswith(KV_PREFIX):
                run = key[len(KV_PREFIX):]
                if run in self._rows:
                    self._released.add(run)
                    self._free_if_unused(run)

    def _free_if_unused(self, run: str) -> None:
        if run in self._released and not self._users.get(run):
            self._released.discard(run)
            self._users.pop(run, None)
            del self._written[run]
            self._free.extend(self._rows.pop(run).tolist())

    # -- per step -----------------------------------------------------------------------------------
    def plan_out(self, view, plans, starts: np.ndarray, computed: np.ndarray) -> None:
        """The blocks of this step's rows of the requests that keep KV: copied out after the forward."""
        self._out, self._out_written, self._view = [], [], view
        block = self.block_size
        for i, plan in enumerate(plans):
            if plan is None or plan.kv_keep is None:
                continue
            first = int(computed[i])
            end = min(first + int(starts[i + 1] - starts[i]), plan.prompt_len)
            if end <= first:
                continue
            blocks = np.arange(first // block, -(-end // block))
            at = np.maximum(blocks * block, first)  # a row of the step in each block
            self._out.append((starts[i] + at - first, self._rows[plan.kv_keep][blocks]))
            self._out_written.append((plan.kv_keep, np.arange(first, end)))

    def after_forward(self) -> None:
        if not self._out:
            return
        view = self._view
        batch_rows = np.concatenate([x[0] for x in self._out])
        rows = np.concatenate([x[1] for x in self._out])
        self._fold(b"kv-out", batch_rows, rows)
        caches = self._caches(view)
        if caches is not None:
            blocks = view.slot_mapping().index_select(0, self._staging.upload(batch_rows)) // self.block_size
            rows_device = self._staging.upload(rows)
            for values, cache in zip(self.values, caches):
                values.index_copy_(0, rows_device, cache.index_select(0, blocks).flatten(1))
            for run, positions in self._out_written:
                self._written[run][positions] = True
        self._out, self._out_written, self._view = [], [], None

    def copy_in(self, view, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write kept blocks ``rows`` into the KV-cache blocks of ``slots`` (every layer)."""
        blocks = slots // self.block_size
        for values, cache in zip(self.values, view.kv_caches()):
            cache.index_copy_(0, blocks, values.index_select(0, rows).view(-1, *cache.shape[1:]))
