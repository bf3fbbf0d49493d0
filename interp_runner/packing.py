"""Cells packed into shared engine requests.

A causal-trace cell is a one-token request that repeats a corrupted prompt with one restore; cells of a grid
differ from their restored position on and share the KV of the prompt before it. Run one engine request each,
their cost is vLLM's per-request work (scheduler, block hashes, batch state, output), not the GPU's. Packed, a
run of such cells becomes one engine request whose prompt is their shared prefix followed by each cell's own
tokens, one block-aligned segment per cell::

    [ prefix (positions 0 .. p-1) | cell 0: positions p .. n-1, padding | cell 1: p .. n-1, padding | ... ]

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

from .compiler import EngineRequest
from .payload import PAYLOAD_KEY, pack_positions

PACKABLE_KEYS = {"rid", "patch", "score", "kv", "kv_private"}


@dataclass(frozen=True)
class PackedRequest:
    rid: str
    token_ids: list[int]
    sampling: dict  # the members' settings with the packed payload
    members: tuple[EngineRequest, ...]
    prefix: int


def _packable(request: EngineRequest, payload: dict) -> bool:
    sampling = request.sampling
    return (
        payload.keys() <= PACKABLE_KEYS and "kv_private" in payload and "patch" in payload and "score" in payload
        and sampling.get("max_tokens") == 1 and sampling.get("temperature") == 0 and not sampling.get("logprobs")
    )


def pack_requests(requests: Sequence[EngineRequest], block_size: int, max_tokens: int
                  ) -> tuple[list[PackedRequest], list[EngineRequest]]:
    """(packed requests, requests left as they are). A packed request holds at most ``max_tokens`` tokens and at
    least two cells."""
    groups: dict[tuple, list[tuple[EngineRequest, dict]]] = {}
    single: list[EngineRequest] = []
    for r in requests:
        payload = r.payload
        if payload is None or not _packable(r, payload):
            single.append(r)
            continue
        prefix = payload["kv_private"] // block_size * block_size
        shared = tuple(tuple(x) for x in payload["kv"] if x[0] < prefix)
        settings = tuple(sorted((k, v) for k, v in r.sampling.items() if k != "extra_args"))
        groups.setdefault((r.prompt.token_ids, prefix, shared, settings), []).append((r, payload))
    packed = []
    for (token_ids, prefix, shared, _), members in groups.items():
        n = len(token_ids)
        stride = -(-(n - prefix) // block_size) * block_size
        per_request = (max_tokens - prefix) // stride
        if per_request < 2 or len(members) < 2:
            single += [r for r, _ in members]
            continue
        segment = list(token_ids[prefix:]) + [token_ids[-1]] * (stride - (n - prefix))
        for start in range(0, len(members), per_request):
            chunk = members[start : start + per_request]
            if len(chunk) < 2:
                single += [r for r, _ in chunk]
                continue
            packed.append(_packed(chunk, token_ids, prefix, stride, shared, segment))
    return packed, single


def _packed(chunk, token_ids, prefix: int, stride: int, shared: tuple, segment: list) -> PackedRequest:
    """One request of ``chunk``'s cells: the entries before ``prefix`` once (the same in every cell), each cell's
    own entries moved into its segment."""
    sites, positions, keys, a, b = [], [], [], [], []
    for k, (_, payload) in enumerate(chunk):
        patch = payload["patch"]
        pos = memoryview(patch["pos"]).cast("i").tolist()
        site = memoryview(patch["site"]).cast("i").tolist()
        pa, pb, src = memoryview(patch["a"]).cast("f").tolist(), memoryview(patch["b"]).cast("f").tolist(), patch["src"]
        # the first cell's entries before the prefix stand for every cell's; then each cell's own, moved
        chosen = [(i, 0) for i, p in enumerate(pos) if p < prefix] if k == 0 else []
        chosen += [(i, k * stride) for i, p in enumerate(pos) if p >= prefix]
        sites += [site[i] for i, _ in chosen]
        positions += [pos[i] + shift for i, shift in chosen]
        keys += [src[i] for i, _ in chosen]
        a += [pa[i] for i, _ in chosen]
        b += [pb[i] for i, _ in chosen]
    first = chunk[0][0]
    payload = {
        "rid": f"packed:{first.rid}",
        "patch": {"site": pack_positions(sites), "pos": pack_positions(positions), "src": keys,
                  "a": np.asarray(a, dtype=np.float32).tobytes(), "b": np.asarray(b, dtype=np.float32).tobytes()},
        "kv": [list(x) for x in shared],
        "kv_private": prefix,
        "cells": {"rids": [r.rid for r, _ in chunk], "prefix": prefix, "stride": stride,
                  "length": len(token_ids) - prefix, "score": [p["score"] for _, p in chunk]},
    }
    sampling = {**first.sampling, "extra_args": {PAYLOAD_KEY: payload}}
    return PackedRequest(payload["rid"], list(token_ids[:prefix]) + segment * len(chunk), sampling,
                         tuple(r for r, _ in chunk), prefix)
