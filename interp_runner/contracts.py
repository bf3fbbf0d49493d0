"""The records that cross from the host (the plan compiler) to the plugin (vLLM's engine), defined once for both.

Pure data: msgspec and nothing of vLLM or torch, so the plugin imports it on every worker. A request's payload is a
``RequestPayload``; it travels in ``SamplingParams.extra_args[PAYLOAD_KEY]`` as its MessagePack bytes
(``encode_payload``), which vLLM carries between processes as they are; the plugin decodes them once per process
(``payload_of``), rejecting anything that is not a payload with an ``InvalidPayload`` naming what is wrong. The
engine-wide spec is a ``PluginSpec``, carried as plain values in vLLM's ``additional_config[ENGINE_KEY]`` (vLLM
hashes that dict into its compile cache's key) and read back with ``plugin_spec_of``.

Records are arrays on the wire (``array_like``): their field names never travel (a field at its default is one
byte). Position and value columns are int32 / float32 bytes.
"""

from __future__ import annotations

import msgspec

PAYLOAD_KEY = "interp"  # SamplingParams.extra_args[PAYLOAD_KEY]: a request's encoded payload
ENGINE_KEY = "interp"  # additional_config[ENGINE_KEY]: the engine's plugin spec
RESULTS_KEY = "interp_results"  # a served request's results in its last output's ``kv_transfer_params``
COLLECT = "interp_collect"  # the worker extension's read-back of finished requests' results (``plugin.worker``)
PREFILL = 1  # steering phases, a bit mask: prompt tokens
DECODE = 2  # generated tokens


class Steer(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One steering term: ``scale`` times the registered vector ``vector`` added at ``site`` in ``phases``."""

    site: int
    phases: int  # PREFILL | DECODE bit mask
    vector: str  # the registered vector's key (``payload.vector_key``)
    scale: float


class Capture(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Values a request sends back to the host: ``sites`` at prompt ``positions`` (and at generated tokens)."""

    sites: tuple[int, ...]
    positions: bytes  # int32 prompt positions
    generated: bool


class KeepGroup(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Values kept on the workers as patch sources: ``sites`` x ``positions``, each under ``payload.ref_key``."""

    sites: tuple[int, ...]
    positions: bytes  # int32


class Keep(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """What the run ``run`` (a digest of its tokens and steering) keeps on the workers for later requests."""

    run: str
    groups: tuple[KeepGroup, ...]
    kv: bool = False  # its prompt's KV too, under ``payload.kv_key(run)``


class PatchColumns(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Patch entries as columns, one entry per index: the value at (``sites[i]``, ``positions[i]``) becomes
    ``value_weights[i] * value + source_weights[i] * source``, the source being the bank row of ``sources[i]``."""

    sites: bytes  # int32
    positions: bytes  # int32
    sources: tuple[str, ...]  # source keys: registered (``vec:...``) or kept (``payload.ref_key``)
    value_weights: bytes  # float32
    source_weights: bytes  # float32


class KvRange(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True, order=True):
    """Interventions ``digest`` change the KV of positions ``start <= p < end`` (end -1: open); ordered as
    (start, end, digest)."""

    start: int
    end: int
    digest: str


class StartLayer(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Below ``layer`` the request computes what the run ``run`` computes at the same positions."""

    layer: int
    run: str


class ReuseKv(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The request's positions before ``position`` compute what the run ``run`` computes there."""

    run: str
    position: int


class Cells(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """The cells of a packed request (``interp_runner.compile.packing``): after ``prefix`` shared positions, cell ``k``'s
    segment holds prompt positions ``prefix .. prefix + length - 1`` at ``prefix + k * stride``."""

    rids: tuple[str, ...]  # each cell's request id
    prefix: int
    stride: int
    length: int
    scores: tuple[bytes, ...]  # each cell's scored token ids, int32
    starts: tuple[StartLayer | None, ...] | None = None  # each cell's ``start`` (None: no cell has one)
    reuses: tuple[ReuseKv | None, ...] | None = None  # each cell's ``reuse``


class RequestPayload(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """A request's interventions and reads. Mutable on the host: the plan compiler sets ``kv_private`` and
    ``force`` after the request is made. The fields a causal-trace cell has come first."""

    rid: str  # stable id of the request in the plan
    patch: PatchColumns | None = None
    score: bytes | None = None  # int32 token ids scored after the last prompt token
    kv: tuple[KvRange, ...] = ()  # what changes the KV of which positions (prefix-cache block hashes)
    kv_private: int | None = None  # KV from here on is this request's alone: never shared
    start: StartLayer | None = None
    reuse: ReuseKv | None = None
    keep: Keep | None = None
    steer: tuple[Steer, ...] = ()
    capture: tuple[Capture, ...] = ()
    force: bytes | None = None  # int32 tokens it generates, in order (teacher forcing)
    cells: Cells | None = None  # a packed request's cells


class PluginSites(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The sites that carry ops and the rows the plugin's buffers hold: fixed for an engine's lifetime."""

    steer_sites: tuple[int, ...]
    capture_sites: tuple[int, ...]
    patch_sites: tuple[int, ...] = ()
    bank_rows: int = 0  # patch source rows the workers keep at once
    kv_rows: int = 0  # prompt positions whose KV the workers keep at once
    kv_runs: int = 0  # the prompts they are in


class PluginSpec(PluginSites, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What an engine's plugin is built with: its sites and rows, and the plugin's source they were made for."""

    plugin: str  # ``payload.plugin_fingerprint()``: part of vLLM's compile-cache key
    # a served engine: each request the engine core finishes carries its results in its last output
    # (``plugin.served_results``)
    results_with_outputs: bool = False


class InvalidPayload(ValueError):
    """A request's ``extra_args[PAYLOAD_KEY]`` (or an engine's plugin spec) is not what the plugin reads."""


_encode = msgspec.msgpack.Encoder().encode
_decode_payload = msgspec.msgpack.Decoder(RequestPayload).decode


def encode_payload(payload: RequestPayload) -> bytes:
    """A payload as it travels in ``extra_args``."""
    if type(payload) is not RequestPayload:
        raise InvalidPayload(f"a request payload must be a RequestPayload, not {type(payload).__name__}")
    return _encode(payload)


def decode_payload(data) -> RequestPayload:
    """The payload ``encode_payload`` made, or the array a ``RequestPayload`` becomes through a MessagePack hop of
    vLLM's (``InvalidPayload`` for anything else)."""
    try:
        if isinstance(data, (bytes, bytearray, memoryview)):
            return _decode_payload(data)
        if isinstance(data, list):
            return msgspec.convert(data, RequestPayload)
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise InvalidPayload(f"extra_args[{PAYLOAD_KEY!r}] is not a valid RequestPayload: {err}") from None
    raise InvalidPayload(f"extra_args[{PAYLOAD_KEY!r}] holds a {type(data).__name__}, not an encoded "
                         "RequestPayload (interp_runner.contracts.encode_payload)")


def payload_of(params) -> RequestPayload | None:
    """The payload of a request's ``SamplingParams`` (None: it has none), decoded once: the decoded record
    replaces the bytes in ``extra_args``, so the scheduler, model runner and sampler of a process share it."""
    extra = params.extra_args if params is not None else None
    raw = extra.get(PAYLOAD_KEY) if extra else None
    if raw is None or type(raw) is RequestPayload:
        return raw
    payload = extra[PAYLOAD_KEY] = decode_payload(raw)
    return payload


def plugin_spec_of(raw) -> PluginSpec:
    """The plugin spec in an engine's ``additional_config[ENGINE_KEY]`` (plain values: ``spec_config``)."""
    if type(raw) is PluginSpec:
        return raw
    try:
        return msgspec.convert(raw, PluginSpec)
    except msgspec.ValidationError as err:
        raise InvalidPayload(f"additional_config[{ENGINE_KEY!r}] is not a valid PluginSpec: {err}") from None


def spec_config(spec: PluginSpec) -> dict:
    """A plugin spec as vLLM's ``additional_config`` holds it (plain, hashable values)."""
    return {ENGINE_KEY: {k: list(v) if isinstance(v, tuple) else v for k, v in msgspec.to_builtins(spec).items()}}
