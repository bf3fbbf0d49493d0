"""A request's plan on the workers, as admitted from its payload (``interp_runner.contracts``), and its parts.

The components of the engine-side state (``runtime.InterpState``) each read their part of a plan: the steering
table its slots, the capture buffer its capture and keep groups, the patch rows its entries, the packed-sequence
planner its cells. The fields a step reads of every request are gathered as columns once per batch
(``batch_plans``); the parts read in the components' per-request loops are slotted dataclasses, whose fields are
the fastest read by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True, slots=True)
class CaptureGroup:
    """Sites that capture the same positions of a request (a site is in one group of a request only)."""

    sites: tuple[int, ...]
    positions: np.ndarray  # captured prompt positions, sorted and unique (int64)
    generated: bool  # generated tokens are captured too
    lo: int  # lowest and highest captured prompt position (0, -1: none)
    hi: int


@dataclass(frozen=True, slots=True)
class KeptGroup:
    """Values a request keeps in the patch bank: the computed values at ``sites`` x ``positions``."""

    sites: tuple[int, ...]
    positions: np.ndarray  # sorted and unique (int64)
    lo: int  # lowest and highest position
    hi: int
    rows: np.ndarray  # bank rows [site, position] this request writes; -1: not written by it
    keys: np.ndarray  # their keys [site, position] (``payload.ref_key``; object array)


@dataclass(frozen=True, slots=True)
class PatchEntries:
    """A request's patch entries, one per (site, position), sorted by position, then site. Plain lists: a step
    gathers a few of them into one array each."""

    positions: list[int]
    base: list[int]  # flat [patch site, row] index of each, as if row = position (a step adds its row shift)
    bank_rows: list[int]
    value_weights: list[float]  # value <- value weight * value + source weight * source
    source_weights: list[float]
    lo: int  # lowest and highest patched position
    hi: int


class StreamKey(NamedTuple):
    """The values a run keeps at a site (the residual stream its packed cells start from)."""

    run: str
    site: int


@dataclass(slots=True)
class CellLayout:
    """A packed request's cells (``interp_runner.compile.packing``): segment ``k`` holds prompt positions ``prefix ..
    prefix + length - 1`` at ``prefix + k * stride``, padded to ``stride``."""

    prefix: int
    stride: int
    length: int
    rids: list[str]
    score_ids: list[np.ndarray]
    # cells that skip layers: each one's first layer, and the bank rows of its segment's stream there (row 0, zeros,
    # for padding)
    start: np.ndarray | None = None
    inject: np.ndarray | None = None
    # cells that reuse their run's KV: each one's first computed position, and the kept KV blocks of its segment's
    # blocks before it, by block of the segment
    reuse_from: np.ndarray | None = None
    reuse_rows: np.ndarray | None = None


@dataclass(slots=True)
class LayerSkip:
    """A step whose packed cells enter the model above layer 0 (``skipping.run_layers``): it runs layer by layer,
    each layer over a prefix of the step's rows, in model-row order."""

    perm: object  # device int64: the batch row of each computed model row
    rows: list[int]  # per layer: how many model rows it computes (those of the sequences that start at or below it)
    seqs: list[int]  # per layer: how many sequences it computes
    inject: object  # device int64: the bank rows of the streams the rows entering above layer 0 start from
    reuse: tuple | None = None  # (batch rows, kept KV blocks) copied in before the layers run
    slots: object | None = None  # the step's slot mapping in model-row order (made once, by the first builder)


@dataclass(slots=True)
class RequestPlan:
    rid: str
    prompt_len: int
    steer_key: tuple | None = None  # the steering table's key of its slots (None: no steering)
    prefill_slot: int = 0
    decode_slot: int = 0
    capture_groups: list[CaptureGroup] = field(default_factory=list)
    patch: PatchEntries | None = None
    bank_keys: tuple[str, ...] = ()  # bank rows it uses: none is freed before it finishes
    score_ids: np.ndarray | None = None
    void: str | None = None  # why its patches cannot be applied
    cells: CellLayout | None = None
    streams: tuple[StreamKey, ...] = ()  # the kept streams its cells start from
    kv_keep: str | None = None  # the run whose prompt KV it writes (``kept_kv``)
    kv_runs: tuple[str, ...] = ()  # the runs whose kept KV its cells reuse
    keep: list[KeptGroup] = field(default_factory=list)
    flag_slot: int = 0  # its slot of the non-finite flags (``nonfinite``; 0: none held)
    cell_flag_slots: np.ndarray | None = None  # a packed request's: one per cell
