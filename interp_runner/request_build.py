"""Engine requests: the record, its payload (``interp_runner.payload``) and prefix-cache ranges, and the passes over
a plan's requests (private KV, engine sites, the request hash). Below every experiment kind; no engine needed.

A plan of a large causal trace holds hundreds of thousands of requests made of a few recurring groups of patch
entries (a noise sample, one restore), so a group is encoded once, as a ``Patch``, and requests join groups.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

import msgspec
import numpy as np

from .payload import DECODE, PAYLOAD_KEY, PREFILL, EngineSpec, digest, pack_positions, unpack_positions


@dataclass(frozen=True)
class Prompt:
    index: int
    id: str
    text: str
    token_ids: tuple[int, ...]
    answer_ids: tuple[int, ...] = ()  # scored token ids: (answer[, foil])


@dataclass(frozen=True, slots=True)
class EngineRequest:
    rid: str
    prompt: Prompt
    sampling: dict  # SamplingParams keyword arguments, payload included
    stage: int = 0
    role: str = "prompt"  # prompt | patched | baseline (an unpatched destination beside patched ones)
    meta: dict = field(default_factory=dict)  # what the request stands for in its experiment
    condition: str | None = None  # run only if this request's top token is its answer (ROME's filter)

    @property
    def payload(self) -> dict | None:
        extra = self.sampling.get("extra_args")
        return extra.get(PAYLOAD_KEY) if extra else None

    @property
    def kv_ranges(self) -> list:
        return (self.payload or {}).get("kv", [])

    def sampling_params(self):
        from vllm import SamplingParams

        return SamplingParams(**self.sampling)

    def engine_prompt(self) -> dict:
        return {"prompt_token_ids": list(self.prompt.token_ids)}


@lru_cache(maxsize=1 << 16)
def _entry_json(entry: tuple) -> str:
    """One patch entry (site, key, a, b) as ``payload.digest`` writes it (the restores of overlapping layer windows
    share entries)."""
    return json.dumps(entry, separators=(",", ":"))


def _position_digest(pairs: tuple) -> str:
    """``payload.digest`` of one position's sorted entries, from the entries' own JSON."""
    text = "[" + ",".join(encoded for _, encoded in pairs) + "]"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class Patch(NamedTuple):
    """Patch entries (site, position, source key, a, b) as the payload's columns, with each touched position's
    prefix-cache range: a group of entries is encoded once however many requests carry it. ``joined`` and
    ``overlaid`` make a request's entries from groups, re-hashing only the positions both groups touch."""

    entries: tuple  # (site, position, key, a, b), in column order
    site: bytes  # int32
    pos: bytes  # int32
    src: tuple  # source keys
    a: bytes  # float32
    b: bytes  # float32
    at: dict  # position -> its ((site, key, a, b), JSON) pairs, sorted
    ranges: dict  # position -> [position, position + 1, digest of its entries]

    @classmethod
    def of(cls, entries: Iterable = ()) -> Patch:
        entries = tuple((int(site), int(pos), key, float(a), float(b)) for site, pos, key, a, b in entries)
        grouped: dict[int, list] = {}
        for site, pos, key, a, b in entries:
            entry = (site, key, a, b)
            grouped.setdefault(pos, []).append((entry, _entry_json(entry)))
        at = {pos: tuple(sorted(pairs)) for pos, pairs in grouped.items()}
        sites, positions, keys, a, b = zip(*entries) if entries else ((),) * 5
        return cls(entries, pack_positions(sites), pack_positions(positions), keys,
                   np.asarray(a, dtype=np.float32).tobytes(), np.asarray(b, dtype=np.float32).tobytes(),
                   at, {pos: [pos, pos + 1, _position_digest(pairs)] for pos, pairs in at.items()})

    def joined(self, other: Patch) -> Patch:
        """These entries, then ``other``'s."""
        at, ranges = {**self.at, **other.at}, {**self.ranges, **other.ranges}
        if len(at) < len(self.at) + len(other.at):  # positions both patch
            for pos in self.at.keys() & other.at.keys():
                at[pos] = tuple(sorted(self.at[pos] + other.at[pos]))
                ranges[pos] = [pos, pos + 1, _position_digest(at[pos])]
        return Patch(self.entries + other.entries, self.site + other.site, self.pos + other.pos,
                     self.src + other.src, self.a + other.a, self.b + other.b, at, ranges)

    def overlaid(self, top: Patch) -> Patch:
        """These entries less those at a (site, position) that ``top`` patches, then ``top``'s: ``top`` wins."""
        covered = {(entry[0], pos) for pos, pairs in top.at.items() if pos in self.at for entry, _ in pairs}
        under = self
        if covered and any((site, pos) in covered for site, pos, *_ in self.entries):
            under = Patch.of(e for e in self.entries if (e[0], e[1]) not in covered)
        return under.joined(top)

    def payload(self) -> dict:
        return {"site": self.site, "pos": self.pos, "src": list(self.src), "a": self.a, "b": self.b}

    def kv_ranges(self) -> list:
        return [self.ranges[pos] for pos in sorted(self.ranges)]


NO_PATCH = Patch.of()


def kv_ranges(steer: list, patch: Patch, prompt_len: int) -> list:
    """What changes the KV of which positions (see ``interp_runner.plugin.prefix_cache``)."""
    if not steer:
        return patch.kv_ranges()
    ranges = []
    for phase, start, end in ((PREFILL, 0, prompt_len), (DECODE, prompt_len, -1)):
        terms = sorted([site, key, scale] for site, phases, key, scale in steer if phases & phase)
        if terms:
            ranges.append([start, end, digest(terms)])
    return ranges + patch.kv_ranges()


@lru_cache(maxsize=1 << 12)
def _packed_ids(ids: tuple[int, ...]) -> bytes:
    return pack_positions(ids)


def make_request(
    rid: str,
    prompt: Prompt,
    s,
    steer: list = (),
    capture: list = (),
    patch: Patch = NO_PATCH,
    stage: int = 0,
    role: str = "prompt",
    meta: dict | None = None,
    condition: str | None = None,
    max_tokens: int | None = None,
    keep: dict | None = None,
    start: list | None = None,
    reuse: list | None = None,
) -> EngineRequest:
    """One engine request; ``keep``: values the workers keep as patch sources; ``start``: [layer, run] below which
    it computes what ``run`` does; ``reuse``: [run, position] before which it does (``interp_runner.payload``)."""
    payload: dict = {"rid": rid}
    if start is not None:
        payload["start"] = list(start)
    if reuse is not None:
        payload["reuse"] = list(reuse)
    if steer:
        payload["steer"] = list(steer)
    if capture:
        payload["capture"] = list(capture)
    if keep:
        payload["keep"] = keep
    if patch.entries:
        payload["patch"] = patch.payload()
    if prompt.answer_ids:
        payload["score"] = _packed_ids(prompt.answer_ids)
    n = len(prompt.token_ids)
    ranges = kv_ranges(steer, patch, n)
    if ranges:
        payload["kv"] = ranges
    # a captured (or kept) prompt position other than the last would be skipped by a prefix-cache hit
    read = [positions for _, positions, _ in capture] + [positions for _, positions in (keep or {}).get("groups", ())]
    reads_prompt = any(unpack_positions(positions).min(initial=n) < n - 1 for positions in read) \
        or bool((keep or {}).get("kv"))
    sampling = {
        "max_tokens": s.max_tokens if max_tokens is None else max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "seed": s.seed + prompt.index,
        "logprobs": s.logprobs if s.logprobs is not None else 0,
        "extra_args": {PAYLOAD_KEY: payload} if len(payload) > 1 else None,
        "skip_reading_prefix_cache": True if reads_prompt else None,
    }
    return EngineRequest(rid, prompt, sampling, stage, role, meta or {}, condition)


def mark_private_kv(requests: Sequence[EngineRequest]) -> None:
    """Set each request's ``kv_private``: the first position from which its KV hashes chain in interventions no
    other request of the plan has (a causal-trace cell's restore under its own noise sample, say). Blocks from
    there on cannot be shared within the plan; the plugin neither hashes nor caches them."""
    # a chain (the interventions a block hash has chained in by a range's start) is numbered by (the chain
    # before that range, the range): one small key per range, however long the chain
    chain_of: dict[tuple, int] = {}
    counts: list[int] = []
    chains: list[tuple] = []  # per request with ranges: (its payload, [(chain, start) per range, starts ascending])
    for r in requests:
        payload = r.payload
        ranges = payload.get("kv") if payload else None
        if not ranges:
            continue
        chain, walked = -1, []
        for start, end, d in sorted(ranges):
            chain = chain_of.setdefault((chain, start, end, d), len(chain_of))
            if chain == len(counts):
                counts.append(0)
            counts[chain] += 1
            walked.append((chain, start))
        chains.append((payload, walked))
    for payload, walked in chains:
        for chain, start in walked:  # a chain longer than a private one is private
            if counts[chain] == 1:
                payload["kv_private"] = start
                break


def engine_spec_of(requests: Sequence[EngineRequest], bank_rows: int) -> EngineSpec:
    steer, capture, site_columns = set(), set(), set()
    forces = False
    kv_rows = kv_runs = 0
    for r in requests:
        p = r.payload
        if p is None:
            continue
        if "steer" in p:
            steer.update(e[0] for e in p["steer"])
        if "capture" in p:
            capture.update(s for e in p["capture"] for s in e[0])
        if p.get("keep"):
            capture.update(s for e in p["keep"].get("groups", ()) for s in e[0])  # kept through captures
            if p["keep"].get("kv"):
                kv_rows += len(r.prompt.token_ids)
                kv_runs += 1
        if "patch" in p:
            site_columns.add(p["patch"]["site"])  # few distinct ones: decoded once each
        forces = forces or "force" in p
    patch = {site for column in site_columns for site in unpack_positions(column).tolist()}
    return EngineSpec(tuple(sorted(steer)), tuple(sorted(capture)), tuple(sorted(patch)), bank_rows, kv_rows, kv_runs,
                      forces)


HASH_CHUNK = 4096  # requests per encoded chunk: bounded memory, one C call each


def requests_hash(requests: Sequence[EngineRequest]) -> str:
    """The sha256 of the MessagePack encoding (map keys sorted) of each request's [condition, rid, sampling, stage,
    tokens], fed in chunks of ``HASH_CHUNK`` requests, each chunk one MessagePack array."""
    encode = msgspec.msgpack.Encoder(order="sorted").encode
    h = hashlib.sha256()
    for i in range(0, len(requests), HASH_CHUNK):
        h.update(encode([(r.condition, r.rid, r.sampling, r.stage, r.prompt.token_ids)
                         for r in requests[i : i + HASH_CHUNK]]))
    return h.hexdigest()
