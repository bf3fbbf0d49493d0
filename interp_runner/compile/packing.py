"""Cells packed into shared engine requests.

A causal-trace cell is a one-token request that repeats a corrupted prompt with one restore; cells of a grid
differ from their restored position on and share the KV of the prompt before it. Run one engine request each,
their cost is vLLM's per-request work (scheduler, block hashes, batch state, output), not the GPU's. Packed, a
run of such cells becomes one engine request whose prompt is their shared prefix followed by each cell's own
tokens, one block-aligned segment per cell::

    [ prefix (positions 0 .. p-1) | cell 0: positions p .. n-1, padding | cell 1: p .. n-1, padding | ... ]

A cell whose payload has a ``start`` layer enters the model there: its segment's residual stream at that layer is
the one its corrupted run kept, and the layers below are not computed for it. A cell whose payload has ``reuse``
computes none of its positions before the restored one: their KV is the one its corrupted run kept.

The plugin runs every segment as its own attention sequence (the prefix's blocks, then the segment's), at the
positions of the prompt it stands for, and scores each cell at its segment's last prompt token. Each cell computes
exactly the tokens it would alone: a cell alone hits the prefix cache up to the block of its first private
position, as ``p`` here is that block's start.

Cells qualify when they are one-token greedy requests that patch and score and nothing else, and have private KV
(``kv_private``); they share a packed request when their prompt, settings, ``p`` and interventions before ``p``
are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from interp_runner.contracts import PAYLOAD_KEY, Cells, PatchColumns, RequestPayload, encode_payload
from interp_runner.compile.requests import EngineRequest


@dataclass(frozen=True)
class PackedRequest:
    rid: str
    token_ids: list[int]
    sampling: dict  # the members' settings with the packed payload, encoded (``contracts.encode_payload``)
    members: tuple[EngineRequest, ...]
    prefix: int


def _packable(request: EngineRequest, payload: RequestPayload) -> bool:
    """A cell: it patches and scores, has private KV, and nothing else (``start`` and ``reuse`` aside)."""
    sampling = request.sampling
    return (
        payload.kv_private is not None and payload.patch is not None and payload.score is not None
        and payload.keep is None and not payload.steer and not payload.capture and payload.force is None
        and payload.cells is None
        and sampling.get("max_tokens") == 1 and sampling.get("temperature") == 0 and not sampling.get("logprobs")
    )


@dataclass(frozen=True)
class CellGroup:
    """Cells that go into one packed request (made by ``request()``, when it is submitted)."""

    members: tuple[tuple[EngineRequest, RequestPayload], ...]  # (cell, its payload)
    token_ids: tuple[int, ...]
    prefix: int
    stride: int
    shared: tuple

    def request(self) -> PackedRequest:
        """One request of the cells: the entries before ``prefix`` once (the same in every cell), each cell's own
        entries moved into its segment."""
        prefix, stride, members = self.prefix, self.stride, self.members
        patches = [payload.patch for _, payload in members]
        pos_bytes = [x.positions for x in patches]
        cell = np.repeat(np.arange(len(pos_bytes)), [len(x) // 4 for x in pos_bytes])
        pos = np.frombuffer(b"".join(pos_bytes), dtype=np.int32)
        own = pos >= prefix
        chosen = own | (cell == 0)  # the first cell's entries before the prefix stand for every cell's
        where = np.flatnonzero(chosen)
        moved = (pos + np.where(own, cell * stride, 0))[where]
        site, keep, take = (np.frombuffer(b"".join([getattr(x, f) for x in patches]), dtype=dtype)[where]
                            for f, dtype in (("sites", np.int32), ("value_weights", np.float32),
                                             ("source_weights", np.float32)))
        keys = [key for x in patches for key in x.sources]
        keys = keys if len(where) == len(keys) else [keys[i] for i in where.tolist()]
        first = members[0][0]
        n = len(self.token_ids)
        starts = tuple(x.start for _, x in members)
        reuses = tuple(x.reuse for _, x in members)
        cells = Cells(tuple(r.rid for r, _ in members), prefix, stride, n - prefix,
                      tuple(x.score for _, x in members), starts if any(starts) else None,
                      reuses if any(reuses) else None)
        payload = RequestPayload(
            f"packed:{first.rid}",
            patch=PatchColumns(site.tobytes(), moved.astype(np.int32).tobytes(), tuple(keys), keep.tobytes(),
                               take.tobytes()),
            kv=self.shared, kv_private=prefix, cells=cells,
        )
        segment = list(self.token_ids[prefix:]) + [self.token_ids[-1]] * (stride - (n - prefix))
        sampling = {**first.sampling, "extra_args": {PAYLOAD_KEY: encode_payload(payload)}}
        return PackedRequest(payload.rid, list(self.token_ids[:prefix]) + segment * len(members), sampling,
                             tuple(r for r, _ in members), prefix)


def group_cells(requests: Sequence[EngineRequest], block_size: int, max_tokens: int
                ) -> tuple[list[CellGroup], list[EngineRequest]]:
    """(groups of cells, one packed request each, in the order of their first cell; requests left as they are).
    A group holds at most ``max_tokens`` tokens and at least two cells."""
    groups: dict[tuple, list[tuple[EngineRequest, RequestPayload]]] = {}
    prompts: dict[int, tuple[int, ...]] = {}  # cells of a fact share their prompt's token tuple: keyed by its id
    single: list[EngineRequest] = []
    for r in requests:
        payload = r.payload
        if payload is None or not _packable(r, payload):
            single.append(r)
            continue
        prefix = payload.kv_private // block_size * block_size
        shared = tuple(x for x in payload.kv if x.start < prefix)
        settings = tuple((k, v) for k, v in r.sampling.items() if k != "extra_args")  # made in one order
        token_ids = r.prompt.token_ids
        prompts.setdefault(id(token_ids), token_ids)
        groups.setdefault((id(token_ids), prefix, shared, settings), []).append((r, payload))
    out = []
    for (prompt, prefix, shared, _), members in groups.items():
        token_ids = prompts[prompt]
        stride = -(-(len(token_ids) - prefix) // block_size) * block_size
        per_request = (max_tokens - prefix) // stride
        if per_request < 2 or len(members) < 2:
            single += [r for r, _ in members]
            continue
        for start in range(0, len(members), per_request):
            chunk = members[start : start + per_request]
            if len(chunk) < 2:
                single += [r for r, _ in chunk]
                continue
            out.append(CellGroup(tuple(chunk), token_ids, prefix, stride, shared))
    return out, single


def pack_requests(requests: Sequence[EngineRequest], block_size: int, max_tokens: int
                  ) -> tuple[list[PackedRequest], list[EngineRequest]]:
    """(packed requests, requests left as they are): ``group_cells``, each group made a request."""
    groups, single = group_cells(requests, block_size, max_tokens)
    return [g.request() for g in groups], single
