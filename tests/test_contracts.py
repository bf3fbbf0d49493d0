"""The records that cross from the host to the plugin (``interp_runner.contracts``): they survive vLLM's transport
field for field, anything else is refused with an error naming what is wrong, and both sides use one definition."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from interp_runner import contracts, payload
from interp_runner.contracts import (
    DECODE, PAYLOAD_KEY, PREFILL, Capture, Cells, InvalidPayload, Keep, KeepGroup, KvRange, PatchColumns,
    PluginSpec, RequestPayload, ReuseKv, StartLayer, Steer, decode_payload, encode_payload, payload_of,
    plugin_spec_of, spec_config,
)

PACKAGE = Path(contracts.__file__).resolve().parent


def every_field() -> RequestPayload:
    """A payload with every field set to a value other than its default."""
    i32 = lambda *x: np.array(x, np.int32).tobytes()  # noqa: E731
    return RequestPayload(
        "r00003",
        patch=PatchColumns(i32(4, 9), i32(2, 5), ("vec:ab", "ref:run:9:5"), np.float32([0.5, 0.0]).tobytes(),
                           np.float32([0.5, 1.0]).tobytes()),
        score=i32(17, 23),
        kv=(KvRange(0, 7, "d1"), KvRange(7, -1, "d2")),
        kv_private=5,
        start=StartLayer(4, "run"),
        reuse=ReuseKv("run", 5),
        keep=Keep("clean", (KeepGroup((4, 9), i32(1, 2)), KeepGroup((12,), i32(3))), kv=True),
        steer=(Steer(4, PREFILL | DECODE, "v0", 2.5), Steer(9, DECODE, "v1", -1.0)),
        capture=(Capture((4,), i32(6), True),),
        force=i32(5, 6, 7),
        cells=Cells(("c0", "c1"), 32, 64, 40, (i32(17), i32(17, 23)), (StartLayer(4, "run"), None),
                    (None, ReuseKv("run", 35))),
    )


def test_a_payload_survives_msgpack_and_vllms_transport_field_for_field():
    from vllm import SamplingParams
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from interp_runner.compile.requests import transported

    payload = every_field()
    assert decode_payload(encode_payload(payload)) == payload
    assert decode_payload(encode_payload(RequestPayload("bare"))) == RequestPayload("bare")
    # as the engine gets it: SamplingParams with the encoded payload, through vLLM's own codec (engine-core requests)
    host = {"max_tokens": 1, "extra_args": {PAYLOAD_KEY: payload}}
    sampling = transported(host)
    assert isinstance(sampling["extra_args"][PAYLOAD_KEY], bytes)
    received = MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(SamplingParams(**sampling)))
    assert payload_of(received) == payload
    assert payload_of(received) is payload_of(received)  # decoded once: the record replaced the bytes
    assert payload_of(SamplingParams(**transported(host))) == payload  # in process: the same bytes
    assert host["extra_args"][PAYLOAD_KEY] is payload  # the plan's own request is left as it was
    # a decoded record taking another MessagePack hop (an array), or pickled to a worker, reads the same
    hop = msgspec.msgpack.decode(msgspec.msgpack.encode(received.extra_args))
    assert payload_of(SamplingParams(extra_args=hop)) == payload
    import pickle

    assert payload_of(pickle.loads(pickle.dumps(received))) == payload
    assert payload_of(SamplingParams()) is None and payload_of(None) is None


def test_steering_terms_keep_their_types_through_the_wire():
    """The steering table keys slots by (site, phases, vector, scale): an int scale on the host must come back a
    float, so equal steering always finds the same slots."""
    decoded = decode_payload(encode_payload(RequestPayload("r", steer=(Steer(3, PREFILL, "v", 2),))))
    (term,) = decoded.steer
    assert (term.site, term.phases, term.vector, term.scale) == (3, PREFILL, "v", 2.0)
    assert type(term.scale) is float


@pytest.mark.parametrize("raw, message", [
    ({"rid": "r", "steer": [[4, 3, "v", 1.0]]}, "holds a dict, not an encoded RequestPayload"),
    ("r", "holds a str, not an encoded RequestPayload"),
    ([["r"]], "not a valid RequestPayload: Expected `str`, got `array` - at `$[0]`"),
    (msgspec.msgpack.encode({"rid": "r"}), "not a valid RequestPayload: Expected `array`, got `object`"),
    (msgspec.msgpack.encode(["r", None, None, [[0, 4]]]), "not a valid RequestPayload"),  # a KvRange short
    (msgspec.msgpack.encode([7]), "Expected `str`, got `int` - at `$[0]`"),
    (msgspec.msgpack.encode(["r", None, None, [], None, None, None, None, [[4, 3, "v", "big"]]]),
     "Expected `float`, got `str`"),
    (encode_payload(RequestPayload("r", kv_private=3))[:-2], "not a valid RequestPayload"),  # truncated
    (msgspec.msgpack.encode(msgspec.msgpack.decode(encode_payload(RequestPayload("r"))) + [None]),
     "Expected `array` of at most length 12, got 13"),  # a field this plugin does not know
])
def test_a_malformed_payload_is_refused_naming_what_is_wrong(raw, message):
    from vllm import SamplingParams

    with pytest.raises(InvalidPayload, match=rf"extra_args\['interp'\].*{_escaped(message)}"):
        payload_of(SamplingParams(extra_args={PAYLOAD_KEY: raw}))


def _escaped(text: str) -> str:
    import re

    return re.escape(text)


def test_the_host_encodes_only_payload_records():
    with pytest.raises(InvalidPayload, match="must be a RequestPayload, not dict"):
        encode_payload({"rid": "r"})


def test_the_plugin_spec_round_trips_through_additional_config_and_refuses_unknown_keys():
    spec = PluginSpec((3, 4), (9,), (4,), 10, 32, 2, plugin="abc")
    config = spec_config(spec)
    assert config == {"interp": {"plugin": "abc", "steer_sites": [3, 4], "capture_sites": [9], "patch_sites": [4],
                                 "bank_rows": 10, "kv_rows": 32, "kv_runs": 2, "results_with_outputs": False}}
    assert plugin_spec_of(config["interp"]) == spec
    assert plugin_spec_of(msgspec.json.decode(msgspec.json.encode(config))["interp"]) == spec
    with pytest.raises(InvalidPayload, match=r"not a valid PluginSpec: Object contains unknown field `bank`"):
        plugin_spec_of({**config["interp"], "bank": 3})
    with pytest.raises(InvalidPayload, match=r"Object missing required field `capture_sites`"):
        plugin_spec_of({"plugin": "abc", "steer_sites": []})


def test_host_and_plugin_use_the_one_definition_of_each_record():
    """Each record class is defined in ``contracts`` alone, and the modules of both sides that read or write it
    hold that very class; ``contracts`` imports neither torch nor vLLM (the plugin loads it on every worker)."""
    from interp_runner.compile import packing
    from interp_runner.compile import requests as request_build
    from interp_runner.plugin import bank, capture, kept_kv, patches, runner_view, runtime, sequences, steering

    records = {name for name, value in vars(contracts).items() if isinstance(value, type)
               and issubclass(value, msgspec.Struct) and value.__module__ == contracts.__name__}
    assert records == {"Steer", "Capture", "KeepGroup", "Keep", "PatchColumns", "KvRange", "StartLayer", "ReuseKv",
                       "Cells", "RequestPayload", "PluginSites", "PluginSpec"}
    for path in PACKAGE.rglob("*.py"):
        if path.name == "contracts.py":
            continue
        defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
        assert not defined & records, f"{path} defines {defined & records} again"
    # the host's side
    assert request_build.RequestPayload is contracts.RequestPayload and request_build.PatchColumns is PatchColumns
    assert packing.Cells is Cells and packing.RequestPayload is RequestPayload
    # the plugin's side
    assert runner_view.payload_of is payload_of and runtime.RequestPayload is RequestPayload
    assert runtime.plugin_spec_of is plugin_spec_of and kept_kv.PluginSpec is PluginSpec
    assert sequences.Cells is Cells and patches.PatchColumns is PatchColumns and bank.Keep is Keep
    assert capture.Capture is Capture and steering.Steer is Steer
    assert issubclass(payload.EngineSpec, contracts.PluginSites)  # the host's spec holds the plugin's sites
    code = ("import sys; sys.modules['torch'] = sys.modules['vllm'] = None; import interp_runner.contracts; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['torch', 'vllm']"  # only the blocked entries: nothing of them imported
