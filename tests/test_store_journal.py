"""An unfinished run and its journal: refused until resumed or overwritten, resumed to the same end as an
uninterrupted run, and never trusting what it reads back (pickles planted where the journal is are never loaded,
changed or malformed units fail their checks and run again). With a fake engine."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import msgspec
import numpy as np
import pytest
import xarray as xr
import zarr

from interp_runner.config import ConfigError
from interp_runner.engine.results import RequestResult
from interp_runner.pipeline import run
from interp_runner.store.claim import StoreTarget
from interp_runner.store.journal import INDEX, Journal
from test_cli import interp_run
from test_store import store_config
from test_store_safety import SMOKE, NoEngine, Planted, assert_refused, engine_serving, snapshot


@pytest.fixture
def unfinished(tmp_path):
    """A run of 3 one-request units, interrupted in its second: (its config, its StoreTarget)."""
    config = store_config(store={"path": str(tmp_path / "results.zarr"), "unit_requests": 1})
    with pytest.raises(KeyboardInterrupt):
        run(config, tmp_path, engine_factory=engine_serving(config, dies_at_unit=1), log=lambda _: None)
    target = StoreTarget.at(tmp_path / "results.zarr")
    assert sorted(json.loads((target.journal / INDEX).read_text())["units"]) == ["stage0-unit00000"]
    return config, target


def resume(config: dict, engine=NoEngine) -> list[str]:
    logged = []
    run({**config, "resume": True}, Path(config["store"]["path"]).parent, engine_factory=engine, log=logged.append)
    return logged


def test_an_unfinished_run_is_refused_until_resumed_or_overwritten(unfinished, tmp_path):
    config, target = unfinished
    before = snapshot(tmp_path)
    proc = interp_run(*SMOKE, f"store.path={target.path}", f"hydra.run.dir={tmp_path.parent / (tmp_path.name + '-h')}")
    assert_refused(proc, "store.path", "an unfinished run is at", "resume=true", "store.overwrite=true")
    assert snapshot(tmp_path) == before
    logged = []
    replaced = {**config, "store": {**config["store"], "overwrite": True}}
    run(replaced, tmp_path, engine_factory=engine_serving(replaced), log=logged.append)
    assert any(f"store.overwrite: discarded the unfinished run at {target.work}" in line for line in logged)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.zarr", "results.zarr.report.html"]


def test_a_resumed_run_takes_its_journal_and_ends_like_an_uninterrupted_one(unfinished, tmp_path):
    config, target = unfinished
    logged = resume(config, engine_serving(config))
    assert any(line.startswith(f"resuming {target.path}: 1 unit(s) already done") for line in logged)
    assert any("stage 0 unit 0: taken from the journal" in line for line in logged)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.zarr", "results.zarr.report.html"]
    whole = {**config, "store": {**config["store"], "path": str(tmp_path / "whole" / "results.zarr")}}
    run(whole, tmp_path / "whole", engine_factory=engine_serving(whole), log=lambda _: None)
    xr.testing.assert_equal(xr.open_zarr(str(target.path), consolidated=False),
                            xr.open_zarr(str(tmp_path / "whole" / "results.zarr"), consolidated=False))


def test_a_pickle_planted_in_the_journal_is_never_loaded(unfinished, tmp_path):
    config, target = unfinished
    marker = tmp_path / "ran"
    (target.journal / "stage0-unit00001.pkl").write_bytes(pickle.dumps({"r": Planted(marker)}))
    with pytest.raises(ConfigError) as err:
        resume(config)
    assert err.value.problems[0][0] == "resume"
    assert "stage0-unit00001.pkl was not written by the journal" in str(err.value)
    assert not marker.exists()


def test_a_pickle_where_the_old_journal_was_is_ignored(unfinished, tmp_path):
    config, target = unfinished
    marker = tmp_path / "ran"
    old = Path(str(target.path) + ".units")
    old.mkdir()
    (old / "stage0-unit00000.pkl").write_bytes(pickle.dumps({"r": Planted(marker)}))
    resume(config, engine_serving(config))
    assert not marker.exists() and dict(zarr.open_group(str(target.path), mode="r").attrs)["status"] == "complete"


UNIT = "stage0-unit00000.msgpack"


def rewrite(target: StoreTarget, change) -> None:
    """Let ``change`` edit the first unit's document (MessagePack, extension values left as they are) and make its
    recorded sha256 match, as someone who rewrote it on purpose would."""
    import hashlib

    path = target.journal / UNIT
    doc = msgspec.msgpack.decode(path.read_bytes())
    change(doc)
    path.write_bytes(msgspec.msgpack.encode(doc))
    index = json.loads((target.journal / INDEX).read_bytes())
    index["units"][UNIT.removesuffix(".msgpack")]["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (target.journal / INDEX).write_text(json.dumps(index))


def first_result(doc: dict) -> dict:
    return next(iter(doc["results"].values()))


def test_a_unit_changed_after_it_was_written_fails_its_sha256_check(unfinished):
    config, target = unfinished
    path = target.journal / UNIT
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError) as err:
        resume(config)
    assert err.value.problems[0][0] == "resume"
    assert f"{UNIT} fails its sha256 check" in str(err.value)


def array_ext(dtype: str, shape: tuple, body: bytes, code: int = 1) -> msgspec.msgpack.Ext:
    header = msgspec.msgpack.encode((dtype, shape))
    return msgspec.msgpack.Ext(code, bytes([len(header)]) + header + body)


@pytest.mark.parametrize("value", [
    array_ext("|O", (1,), pickle.dumps("planted")),
    array_ext("<U1", (1,), "a".encode("utf-32-le")),
    array_ext("<f4", (2,), bytes(4)),
    array_ext("<f4", (-1,), b""),
    array_ext("<f4", (1,), bytes(4), code=7),
    array_ext("<f4", (1,), bytes(4), code=2),
    msgspec.msgpack.Ext(1, b"\xff\x00"),
], ids=["object-dtype", "string-dtype", "short-body", "negative-shape", "unknown-code", "scalar-with-shape",
        "bad-header"])
def test_a_unit_with_a_bad_array_is_refused_even_with_a_matching_hash(unfinished, tmp_path, value):
    config, target = unfinished
    rewrite(target, lambda doc: first_result(doc).update(captures={12: [value, value]}))
    with pytest.raises(ConfigError) as err:
        resume(config)
    assert err.value.problems[0][0] == "resume" and "unit stage0-unit00000 cannot be read" in str(err.value)


@pytest.mark.parametrize("change", [
    lambda doc: doc["results"].update(r={"py/object": ["builtins.open", ["ran", "w"]]}),
    lambda doc: first_result(doc).update(captures=[1, 2]),
    lambda doc: first_result(doc).update(rid="another"),
    lambda doc: doc.update(format="interp-runner-journal/2"),
    lambda doc: doc.update(extra=1),
], ids=["not-a-result", "captures-not-a-map", "rid-not-its-key", "another-format", "unknown-key"])
def test_a_unit_of_another_shape_is_refused(unfinished, change):
    config, target = unfinished
    rewrite(target, change)
    with pytest.raises(ConfigError) as err:
        resume(config)
    assert err.value.problems[0][0] == "resume" and "unit stage0-unit00000 cannot be read" in str(err.value)


def test_a_deleted_unit_runs_again(unfinished):
    config, target = unfinished
    (target.journal / UNIT).unlink()
    logged = resume(config, engine_serving(config))
    assert any("0 unit(s) already done" in line for line in logged)
    assert not any("taken from the journal" in line for line in logged)


def test_the_journal_gives_back_every_field_exactly(tmp_path):
    result = RequestResult(
        rid="r7", prompt_index=3, token_ids=[5, 0], text="é\n", logprobs=[-0.1, float("-inf")],
        top_logprobs=[[(5, -0.1), (9, float("nan"))], []],
        captures={12: (np.arange(2, dtype=np.int32), np.random.default_rng(0).standard_normal((2, 8)).astype(np.float16))},
        score={"token_ids": np.array([4, 2], np.int32), "logprobs": np.array([-1.5, np.nan], np.float32),
               "top_id": 4, "top_logprob": np.float32(-0.25), "ids64": np.int64(2**40), "flag": np.bool_(True)},
        void="source missing", cached_tokens=16,
    )
    journal = Journal(tmp_path / "journal")
    journal.open(resume=False)
    journal.record(1, 2, {"r7": result, "r8": RequestResult("r8", 0, [], "", [])})
    back = Journal(tmp_path / "journal")
    assert back.open(resume=True) == 1
    got = back.load(1, 2)

    def same(a, b):
        assert type(a) is type(b), (a, b)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                same(x, y)
        elif isinstance(a, dict):
            assert list(a) == list(b)
            for k in a:
                same(a[k], b[k])
        elif isinstance(a, (float, np.generic)):
            assert np.array(a).tobytes() == np.array(b).tobytes()  # NaN and -inf included, bit for bit
        else:
            assert a == b

    for rid, expected in {"r7": result, "r8": RequestResult("r8", 0, [], "", [])}.items():
        for field in expected.__dataclass_fields__:
            same(getattr(expected, field), getattr(got[rid], field))
