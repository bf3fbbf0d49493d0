"""Engine requests: the record, its payload (``contracts.RequestPayload``) and prefix-cache ranges, and the passes over
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

from interp_runner.contracts import (
    DECODE, PAYLOAD_KEY, PREFILL, Capture, Keep, KvRange, PatchColumns, RequestPayload, ReuseKv, StartLayer, Steer,
    encode_payload,
)
from interp_runner.payload import EngineSpec, digest, pack_positions, unpack_positions


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
    sampling: dict  # SamplingParams keyword arguments, payload (a RequestPayload) included
    stage: int = 0
    role: str = "prompt"  # prompt | patched | baseline (an unpatched destination beside patched ones)
    meta: dict = field(default_factory=dict)  # what the request stands for in its experiment
    condition: str | None = None  # run only if this request's top token is its answer (ROME's filter)

    @property
    def payload(self) -> RequestPayload | None:
        extra = self.sampling.get("extra_args")
        return extra.get(PAYLOAD_KEY) if extra else None

    @property
    def kv_ranges(self) -> tuple[KvRange, ...]:
        payload = self.payload
        return payload.kv if payload is not None else ()

    def sampling_params(self):
        from vllm import SamplingParams

        return SamplingParams(**transported(self.sampling))

    def engine_prompt(self) -> dict:
        return {"prompt_token_ids": list(self.prompt.token_ids)}


def transported(sampling: dict) -> dict:
    """``SamplingParams`` keyword arguments as the engine gets them: the payload as its encoded bytes
    (``contracts.encode_payload``), in an ``extra_args`` of its own."""
    extra = sampling.get("extra_args")
    if not extra:
        return sampling
    return {**sampling, "extra_args": {**extra, PAYLOAD_KEY: encode_payload(extra[PAYLOAD_KEY])}}


@lru_cache(maxsize=1 << 16)
def _entry_json(entry: tuple) -> str:
    """One patch entry (site, key, value weight, source weight) as ``payload.digest`` writes it (the restores of
    overlapping layer windows share entries)."""
    return json.dumps(entry, separators=(",", ":"))


def _position_digest(pairs: tuple) -> str:
    """``payload.digest`` of one position's sorted entries, from the entries' own JSON."""
    text = "[" + ",".join(encoded for _, encoded in pairs) + "]"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class Patch(NamedTuple):
    """Patch entries (site, position, source key, value weight, source weight) as the payload's columns
    (``contracts.PatchColumns``), with each touched position's prefix-cache range: a group of entries is encoded
    once however many requests carry it. ``joined`` and ``overlaid`` make a request's entries from groups,
    re-hashing only the positions both groups touch."""

    entries: tuple  # (site, position, key, value weight, source weight), in column order
    columns: PatchColumns
    at: dict  # position -> its ((site, key, value weight, source weight), JSON) pairs, sorted
    ranges: dict  # position -> KvRange(position, position + 1, digest of its entries)

    @classmethod
    def of(cls, entries: Iterable = ()) -> Patch:
        entries = tuple((int(site), int(pos), key, float(keep), float(take)) for site, pos, key, keep, take in entries)
        grouped: dict[int, list] = {}
        for site, pos, key, keep, take in entries:
            entry = (site, key, keep, take)
            grouped.setdefault(pos, []).append((entry, _entry_json(entry)))
        at = {pos: tuple(sorted(pairs)) for pos, pairs in grouped.items()}
        sites, positions, keys, keep, take = zip(*entries) if entries else ((),) * 5
        columns = PatchColumns(pack_positions(sites), pack_positions(positions), tuple(keys),
                               np.asarray(keep, dtype=np.float32).tobytes(),
                               np.asarray(take, dtype=np.float32).tobytes())
        ranges = {pos: KvRange(pos, pos + 1, _position_digest(pairs)) for pos, pairs in at.items()}
        return cls(entries, columns, at, ranges)

    def joined(self, other: Patch) -> Patch:
        """These entries, then ``other``'s."""
        at, ranges = {**self.at, **other.at}, {**self.ranges, **other.ranges}
        if len(at) < len(self.at) + len(other.at):  # positions both patch
            for pos in self.at.keys() & other.at.keys():
                at[pos] = tuple(sorted(self.at[pos] + other.at[pos]))
                ranges[pos] = KvRange(pos, pos + 1, _position_digest(at[pos]))
        mine, theirs = self.columns, other.columns
        columns = PatchColumns(mine.sites + theirs.sites, mine.positions + theirs.positions,
                               mine.sources + theirs.sources, mine.value_weights + theirs.value_weights,
                               mine.source_weights + theirs.source_weights)
        return Patch(self.entries + other.entries, columns, at, ranges)

    def overlaid(self, top: Patch) -> Patch:
        """These entries less those at a (site, position) that ``top`` patches, then ``top``'s: ``top`` wins."""
        covered = {(entry[0], pos) for pos, pairs in top.at.items() if pos in self.at for entry, _ in pairs}
        under = self
        if covered and any((site, pos) in covered for site, pos, *_ in self.entries):
            under = Patch.of(e for e in self.entries if (e[0], e[1]) not in covered)
        return under.joined(top)

    def kv_ranges(self) -> list[KvRange]:
        return [self.ranges[pos] for pos in sorted(self.ranges)]


NO_PATCH = Patch.of()


def kv_ranges(steer: Sequence[Steer], patch: Patch, prompt_len: int) -> list[KvRange]:
    """What changes the KV of which positions (see ``interp_runner.plugin.prefix_cache``)."""
    if not steer:
        return patch.kv_ranges()
    ranges = []
    for phase, start, end in ((PREFILL, 0, prompt_len), (DECODE, prompt_len, -1)):
        terms = sorted([s.site, s.vector, s.scale] for s in steer if s.phases & phase)
        if terms:
            ranges.append(KvRange(start, end, digest(terms)))
    return ranges + patch.kv_ranges()


@lru_cache(maxsize=1 << 12)
def _packed_ids(ids: tuple[int, ...]) -> bytes:
    return pack_positions(ids)


def make_request(
    rid: str,
    prompt: Prompt,
    s,
    steer: Sequence[Steer] = (),
    capture: Sequence[Capture] = (),
    patch: Patch = NO_PATCH,
    stage: int = 0,
    role: str = "prompt",
    meta: dict | None = None,
    condition: str | None = None,
    max_tokens: int | None = None,
    keep: Keep | None = None,
    start: StartLayer | None = None,
    reuse: ReuseKv | None = None,
) -> EngineRequest:
    """One engine request; ``keep``: values the workers keep as patch sources; ``start``: the layer below which it
    computes what a run does; ``reuse``: the position before which it does (``interp_runner.contracts``)."""
    n = len(prompt.token_ids)
    steer, capture = tuple(steer), tuple(capture)
    payload = RequestPayload(
        rid, patch=patch.columns if patch.entries else None,
        score=_packed_ids(prompt.answer_ids) if prompt.answer_ids else None,
        kv=tuple(kv_ranges(steer, patch, n)), start=start, reuse=reuse, keep=keep or None, steer=steer,
        capture=capture,
    )
    has_payload = bool(patch.entries or prompt.answer_ids or payload.kv or start or reuse or keep or steer or capture)
    # a captured (or kept) prompt position other than the last would be skipped by a prefix-cache hit
    read = [c.positions for c in capture] + [g.positions for g in (keep.groups if keep else ())]
    reads_prompt = any(unpack_positions(positions).min(initial=n) < n - 1 for positions in read) \
        or bool(keep and keep.kv)
    sampling = {
        "max_tokens": s.max_tokens if max_tokens is None else max_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "seed": s.seed + prompt.index,
        "logprobs": s.logprobs if s.logprobs is not None else 0,
        "extra_args": {PAYLOAD_KEY: payload} if has_payload else None,
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
        ranges = payload.kv if payload is not None else None
        if not ranges:
            continue
        chain, walked = -1, []
        for kv in sorted(ranges):
            chain = chain_of.setdefault((chain, kv), len(chain_of))
            if chain == len(counts):
                counts.append(0)
            counts[chain] += 1
            walked.append((chain, kv.start))
        chains.append((payload, walked))
    for payload, walked in chains:
        for chain, start in walked:  # a chain longer than a private one is private
            if counts[chain] == 1:
                payload.kv_private = start
                break


def engine_spec_of(requests: Sequence[EngineRequest], bank_rows: int) -> EngineSpec:
    steer, capture, site_columns = set(), set(), set()
    forces = False
    kv_rows = kv_runs = 0
    for r in requests:
        p = r.payload
        if p is None:
            continue
        if p.steer:
            steer.update(e.site for e in p.steer)
        if p.capture:
            capture.update(s for e in p.capture for s in e.sites)
        if p.keep is not None:
            capture.update(s for g in p.keep.groups for s in g.sites)  # kept through captures
            if p.keep.kv:
                kv_rows += len(r.prompt.token_ids)
                kv_runs += 1
        if p.patch is not None:
            site_columns.add(p.patch.sites)  # few distinct ones: decoded once each
        forces = forces or p.force is not None
    patch = {site for column in site_columns for site in unpack_positions(column).tolist()}
    return EngineSpec(tuple(sorted(steer)), tuple(sorted(capture)), tuple(sorted(patch)), bank_rows, kv_rows, kv_runs,
                      force_tokens=forces)


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
