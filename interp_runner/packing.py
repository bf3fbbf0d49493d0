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


def packable(request: EngineRequest) -> bool:
    payload = request.payload
    return (
        payload is not None and set(payload) <= PACKABLE_KEYS and "kv_private" in payload
        and "patch" in payload and "score" in payload
        and request.sampling.get("max_tokens") == 1 and request.sampling.get("temperature") == 0
        and not request.sampling.get("logprobs")
    )


def _entries(payload: dict) -> list[tuple]:
    patch = payload["patch"]
    sites = np.frombuffer(patch["site"], dtype=np.int32).tolist()
    positions = np.frombuffer(patch["pos"], dtype=np.int32).tolist()
    a = np.frombuffer(patch["a"], dtype=np.float32).tolist()
    b = np.frombuffer(patch["b"], dtype=np.float32).tolist()
    return list(zip(sites, positions, patch["src"], a, b))


def pack_requests(requests: Sequence[EngineRequest], block_size: int, max_tokens: int
                  ) -> tuple[list[PackedRequest], list[EngineRequest]]:
    """(packed requests, requests left as they are). A packed request holds at most ``max_tokens`` tokens and at
    least two cells."""
    groups: dict[tuple, list[EngineRequest]] = {}
    single: list[EngineRequest] = []
    for r in requests:
        if not packable(r):
            single.append(r)
            continue
        payload = r.payload
        prefix = payload["kv_private"] // block_size * block_size
        shared = tuple(tuple(x) for x in payload["kv"] if x[0] < prefix)
        settings = repr(sorted((k, v) for k, v in r.sampling.items() if k != "extra_args"))
        groups.setdefault((r.prompt.token_ids, prefix, shared, settings), []).append(r)
    packed = []
    for (token_ids, prefix, shared, _), members in groups.items():
        n = len(token_ids)
        stride = -(-(n - prefix) // block_size) * block_size
        per_request = (max_tokens - prefix) // stride
        if per_request < 2 or len(members) < 2:
            single += members
            continue
        segment = list(token_ids[prefix:]) + [token_ids[-1]] * (stride - (n - prefix))
        for start in range(0, len(members), per_request):
            chunk = tuple(members[start : start + per_request])
            if len(chunk) < 2:
                single += chunk
                continue
            entries = [e for e in _entries(chunk[0].payload) if e[1] < prefix]
            for k, member in enumerate(chunk):
                entries += [(s, pos + k * stride, key, a, b) for s, pos, key, a, b in _entries(member.payload)
                            if pos >= prefix]
            sites, positions, keys, a, b = zip(*entries)
            payload = {
                "rid": f"packed:{chunk[0].rid}",
                "patch": {"site": pack_positions(sites), "pos": pack_positions(positions), "src": list(keys),
                          "a": np.asarray(a, dtype=np.float32).tobytes(),
                          "b": np.asarray(b, dtype=np.float32).tobytes()},
                "kv": [list(x) for x in shared],
                "kv_private": prefix,
                "cells": {"rids": [m.rid for m in chunk], "prefix": prefix, "stride": stride, "length": n - prefix,
                          "score": [m.payload["score"] for m in chunk]},
            }
            sampling = {**chunk[0].sampling, "extra_args": {PAYLOAD_KEY: payload}}
            packed.append(PackedRequest(payload["rid"], list(token_ids[:prefix]) + segment * len(chunk), sampling,
                                        chunk, prefix))
    return packed, single
