"""Scores and captured rows, held on the device and read back in bulk; per-request results.

Scores are read from the logits of the step that computes a request's last prompt token (a packed cell's: from its
row of the step's hidden states). Computed on the device and kept there with the captured rows, they are read back
once ``PENDING_BYTES`` have gathered, or when results are collected: no step waits for the GPU. With tensor
parallelism only the result rank keeps any.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import numpy as np
import torch

from interp_runner.plugin.batch_plans import SCORE, BatchPlans

PENDING_BYTES = 256 << 20  # device-side results read back once this much has gathered


class Scored(NamedTuple):
    """Requests scored from one row of logits each: their ids and scored token ids."""

    rids: list[str]
    token_ids: list[np.ndarray]


class CaptureMeta(NamedTuple):
    """A step's captured rows, one entry per (site, request): the positions captured at the site, from row
    ``first`` of the step's gathered values on (-1 until the step's layout is known)."""

    sites: list[int]
    rids: list[str]
    positions: list[np.ndarray]
    first: list[int]


class CellScores(NamedTuple):
    """The packed cells a step scores: their rows of the step's hidden states (device), and who they are."""

    rows: torch.Tensor
    scored: Scored


class HeldScores(NamedTuple):
    chosen: torch.Tensor  # [request, token] log-probabilities of the scored token ids
    top_logprob: torch.Tensor
    top_id: torch.Tensor
    finite: torch.Tensor  # [request] whether its row of logits is all finite
    scored: Scored


class HeldCaptures(NamedTuple):
    values: torch.Tensor  # the captured rows, in the order of ``meta``
    meta: CaptureMeta


class Readback:
    def __init__(self, is_result_rank: bool, staging, widths: dict[int, int] | None = None):
        self.is_result_rank = is_result_rank
        self.widths = widths or {}  # capture site -> its rows' width, where narrower than the captured rows
        self.score_rows: list[int] = []  # batch rows whose logits this step scores (requests of ``_plans``)
        self.cells: CellScores | None = None  # packed cells this step scores
        self.only_packed = False  # the step holds packed requests only: vLLM's own logits of them are never read
        self.cell_hidden: torch.Tensor | None = None  # their rows of the step's hidden states, once computed
        self.results: dict[str, dict[int, list[tuple[np.ndarray, np.ndarray]]]] = defaultdict(
            lambda: defaultdict(list)
        )  # request -> site -> chunks of (positions, values)
        self.scores: dict[str, dict] = {}
        self.voided: dict[str, str] = {}  # request -> why its patches could not be applied
        self._plans: list = []
        self._held: list[HeldScores | HeldCaptures] = []  # on the device, not yet read back
        self._held_bytes = 0
        self._staging = staging

    # -- per step -----------------------------------------------------------------------------------
    def plan(self, plans: BatchPlans, starts: np.ndarray, computed: np.ndarray) -> None:
        """The requests whose last prompt token this step computes, and that score it."""
        rows = []
        listed = plans.plans
        for i in plans.where(SCORE):
            if computed[i] + starts[i + 1] - starts[i] == listed[i].prompt_len:
                rows.append(i)
        self.score_rows, self._plans = rows, listed

    def record_scores(self, logits: torch.Tensor) -> None:
        """Log-probabilities of each scored request's token ids (any rank), and its top token. Computed on the
        device and kept there: the step does not wait for them (they are read back in bulk)."""
        rows, self.score_rows = self.score_rows, []
        if not self.is_result_rank:
            return
        plans = self._plans
        index = self._staging.upload(np.array(rows, dtype=np.int64))
        self._hold_scores(logits.index_select(0, index),
                          Scored([plans[i].rid for i in rows], [plans[i].score_ids for i in rows]))

    def record_cell_scores(self, logits: torch.Tensor) -> None:
        """Scores of the packed cells whose last prompt token this step computed (``logits``: one row each)."""
        scored = self.cells.scored
        self.cells = None
        if self.is_result_rank:
            self._hold_scores(logits, scored)

    def _hold_scores(self, logits: torch.Tensor, scored: Scored) -> None:
        """Keep, per scored request, its row of ``logits``' scores."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top_lp, top_id = logprobs.max(dim=-1)
        width = max(len(ids) for ids in scored.token_ids)
        ids = np.zeros((len(scored.rids), width), dtype=np.int64)
        for j, tokens in enumerate(scored.token_ids):
            ids[j, : len(tokens)] = tokens
        chosen = logprobs.gather(1, self._staging.upload(ids))
        finite = torch.isfinite(logits).all(dim=-1)
        self._hold(HeldScores(chosen.clone(), top_lp.clone(), top_id.clone(), finite, scored))

    def hold_captures(self, values: torch.Tensor, meta: CaptureMeta) -> None:
        """Keep a step's captured rows (a copy: the buffer they come from is rewritten next step)."""
        self._hold(HeldCaptures(values.clone(), meta))

    def _hold(self, held: HeldScores | HeldCaptures) -> None:
        """Hold a step's results on the device; read them back once enough have gathered."""
        self._held.append(held)
        tensors = held[:4] if type(held) is HeldScores else held[:1]
        self._held_bytes += sum(t.numel() * t.element_size() for t in tensors)
        if self._held_bytes > PENDING_BYTES:
            self.read_back()

    def read_back(self, reserve=None) -> None:
        """Bring the held results to the host. ``reserve(nbytes)``, where given, returns room (bytes) for the
        captured rows in float32, or None: the device's rows are then copied straight into it."""
        held, self._held, self._held_bytes = self._held, [], 0
        room, at = None, 0
        if reserve is not None:
            wanted = sum(4 * item.values.numel() for item in held if type(item) is HeldCaptures)
            room = reserve(wanted) if wanted else None
        for item in held:
            if type(item) is HeldScores:
                chosen, top_lp, top_id, finite = (t.cpu().numpy() for t in item[:4])
                chosen = chosen.astype(np.float32, copy=False)
                rids, token_ids = item.scored
                as_int32: dict[int, np.ndarray] = {}  # cells of one fact share their token ids
                for j, (rid, tokens, lp, top, ok) in enumerate(zip(rids, token_ids, top_lp.tolist(), top_id.tolist(),
                                                                    finite.tolist())):
                    ids = as_int32.get(id(tokens))
                    if ids is None:
                        ids = as_int32[id(tokens)] = tokens.astype(np.int32)
                    self.scores[rid] = {"token_ids": ids, "logprobs": chosen[j, : len(ids)], "top_id": top,
                                        "top_logprob": lp, "nonfinite": not ok}
                continue
            if room is not None:  # the device's rows straight into the host's block
                values = room[at : at + 4 * item.values.numel()].view(np.float32).reshape(item.values.shape)
                torch.from_numpy(values).copy_(item.values.float())
                at += values.nbytes
            else:
                values = item.values.float().cpu().numpy()
            widths = self.widths
            for site, rid, chosen, offset in zip(*item.meta):
                rows = values[offset : offset + len(chosen)]
                if site in widths:
                    rows = rows[:, : widths[site]]
                self.results[rid][site].append((chosen, rows))

    # -- per request --------------------------------------------------------------------------------
    def collect(self, rids: list[str], reserve=None) -> dict[str, dict]:
        """Per finished request: ``captures`` (site -> (positions, values); later rows win), ``score`` and
        ``void`` (why its patches could not be applied). ``reserve``: see ``read_back``."""
        self.read_back(reserve)
        out = {}
        as_int32: dict[int, tuple] = {}  # the sites of a capture share their positions: (positions, as int32)
        for rid in rids:
            per_site = self.results.pop(rid, {})
            merged = {}
            for site, chunks in per_site.items():
                if len(chunks) == 1:  # the usual case: one step's rows, unique positions
                    positions, values = chunks[0]
                    shared = as_int32.get(id(positions))
                    if shared is None:
                        shared = as_int32[id(positions)] = (positions, positions.astype(np.int32))
                        shared[1].flags.writeable = False  # one array for several sites: read-only
                    merged[site] = (shared[1], values)
                    continue
                positions = np.concatenate([p for p, _ in chunks])
                values = np.concatenate([v for _, v in chunks])
                # a recomputed (preempted) request captures a position again: keep the last copy
                last = len(positions) - 1 - np.unique(positions[::-1], return_index=True)[1]
                merged[site] = (positions[last].astype(np.int32), values[last])
            out[rid] = {"captures": merged, "score": self.scores.pop(rid, None), "void": self.voided.pop(rid, None)}
        return out
