"""Experiment kinds as plugins: the registry and the run config assembled from it (a kind's section runs alone),
the kind of a finished store (recorded, or read from the config of a store that predates the record), the kinds'
report sections and headlines on the golden stores against numbers computed here from their arrays, and the
pipeline's generic hook between stages (vectors derived from stage 0's results) with a fake engine.
"""

from __future__ import annotations

import numpy as np
import pytest
import xarray as xr
import zarr

from conftest import REPO, FakeEngineBase, base_config
from interp_runner.config import ConfigError
from interp_runner.config.schema import Sampling
from interp_runner.contracts import DECODE, PREFILL, Capture, Steer
from interp_runner.engine.results import RequestResult
from interp_runner.store.journal import Journal
from interp_runner.kinds import DEFAULT, KINDS, kind_for, kind_of_store
from interp_runner.pipeline import execute, prepare
from interp_runner.compile.plan import Plan
from interp_runner.compile.requests import Prompt, engine_spec_of, make_request
from interp_runner.config.run import RunConfig, validate_config
from interp_runner.sites import site_id

GOLDEN = REPO / "experiments" / "golden"
FACTS = str(REPO / "experiments" / "causal_trace" / "facts.jsonl")


def trace_config(**keys) -> dict:
    return base_config(prompts={"items": []}, causal_trace={"facts": FACTS, **keys})


def open_golden(name: str) -> tuple[xr.Dataset, dict]:
    path = GOLDEN / f"{name}.zarr"
    return xr.open_zarr(str(path), consolidated=False), dict(zarr.open_group(str(path), mode="r").attrs)


# ------------------------------------------------------------------ registry and run config


def test_each_kind_is_registered_once_with_its_own_section():
    names = [k.name for k in KINDS]
    assert len(set(names)) == len(names) and DEFAULT.section is None
    sections = [k.section for k in KINDS if k.section is not None]
    assert len(set(sections)) == len(sections) == len(KINDS) - 1
    for kind in KINDS:
        if kind.section is not None:
            assert RunConfig.model_fields[kind.section].default is None


def test_the_kind_of_a_config_is_the_one_whose_section_it_sets():
    assert kind_for(base_config()).name == kind_for(validate_config(base_config())).name == "prompts"
    assert kind_for(trace_config()).name == kind_for(validate_config(trace_config())).name == "causal_trace"


@pytest.mark.parametrize("key, value, message", [
    ("steering", {"global": {"base": {"post_block": {"layer": 0, "vector": [0.5] * 128}}}},
     "'steering' cannot be combined with 'causal_trace'"),
    ("capture", [{"hooks": ["post_block"]}], "'capture' cannot be combined with 'causal_trace'"),
    ("patching", [{"prompts": 0, "source": {"zeros": True}, "hook": "post_block", "layers": 0}],
     "'patching' cannot be combined with 'causal_trace'"),
    ("prompts", {"items": ["Hello"]}, "'prompts' cannot be combined with 'causal_trace' (its facts are the prompts)"),
    ("prompts", {"file": "prompts.jsonl"},
     "'prompts' cannot be combined with 'causal_trace' (its facts are the prompts)"),
])
def test_a_kind_section_runs_alone(key, value, message):
    with pytest.raises(ConfigError) as err:
        validate_config({**trace_config(), key: value})
    assert err.value.problems == [("<root>", message)]


def test_prompts_keys_a_kind_does_not_exclude_may_be_set():
    cfg = validate_config({**trace_config(), "prompts": {"items": [], "chat_template": True}})
    assert cfg.prompts.chat_template and cfg.causal_trace is not None  # refused later, by the trace's compile


def test_a_plan_records_the_kind_that_compiled_it():
    assert prepare(base_config()).plan.kind == "prompts"
    trace = trace_config(num_facts=1, components=["resid", "attn"], layers=[0], window=2, noise={"samples": 1})
    assert prepare(trace).plan.kind == "causal_trace"


# ------------------------------------------------------------------ the kind of a store


def test_the_kind_of_a_store_is_recorded_or_read_from_its_config():
    for name, kind in (("steering_smoke", "prompts"), ("causal_trace", "causal_trace")):
        _, attrs = open_golden(name)
        assert attrs["kind"] == kind
        assert kind_of_store(attrs).name == kind
        older = {k: v for k, v in attrs.items() if k != "kind"}  # made before kinds were recorded: its config says
        assert kind_of_store(older).name == kind
    assert kind_of_store({}).name == "prompts"
    with pytest.raises(LookupError, match="'no_such_kind'"):
        kind_of_store({"kind": "no_such_kind"})


def test_value_kinds_of_the_trace_arrays():
    trace = kind_of_store({"kind": "causal_trace"})
    assert trace.value_kind("restored_prob") == trace.value_kind("corrupt_prob") == "probability"
    assert trace.value_kind("indirect_effect") == trace.value_kind("total_effect") == "probability difference"
    assert trace.value_kind("restored_logprob_samples") == trace.value_kind("recovered") == "other"


# ------------------------------------------------------------------ report sections and headlines


def test_trace_headline_is_the_mean_resid_effect_at_the_last_subject_token():
    ds, attrs = open_golden("causal_trace")
    kind = kind_of_store(attrs)
    headline = kind.headline(ds)
    assert "resid" in headline.label and "last subject" in headline.label
    resid = list(ds["component"].values).index("resid")
    grid = ds["indirect_effect"].values[:, resid]  # (fact, layer, token)
    last = ds["subject_end"].values - 1
    expected = np.mean([grid[f, :, last[f]] for f in range(ds.sizes["fact"]) if not ds["filtered"].values[f]])
    assert headline.value == pytest.approx(float(expected), rel=1e-6)


def test_trace_report_has_a_row_per_fact_and_a_section_per_kept_fact():
    ds, attrs = open_golden("causal_trace")
    sections = kind_of_store(attrs).report_sections(ds, [])
    (table,) = sections[0].tables
    assert [row[0] for row in table.rows] == [str(f) for f in ds["fact_id"].values]
    assert [row[3] for row in table.rows] == pytest.approx(ds["clean_prob"].values.tolist())
    assert [row[4] for row in table.rows] == pytest.approx(ds["corrupt_prob"].values.tolist())
    kept = [str(f) for f, filtered in zip(ds["fact_id"].values, ds["filtered"].values) if not filtered]
    assert [s.title for s in sections[1:]] == [f"Fact {f}" for f in kept]
    for section in sections[1:]:
        assert [row[0] for row in section.tables[0].rows] == [str(k) for k in ds["component"].values]


def test_prompts_report_and_headline():
    ds, attrs = open_golden("steering_smoke")
    kind = kind_of_store(attrs)
    requests, captures = kind.report_sections(ds, [])
    assert [row[0] for row in requests.tables[0].rows] == [str(r) for r in ds["request"].values]
    assert [row[3] for row in requests.tables[0].rows] == [str(t) for t in ds["text"].values]
    assert [row[0] for row in captures.tables[0].rows] == ["gen", "last"]
    assert kind.headline(ds) is None  # nothing scored
    scored = ds.assign(logit_diff=("request", np.array([1.0, 2.0, np.nan], np.float32)))
    assert kind.headline(scored).value == pytest.approx(1.5)


# ------------------------------------------------------------------ vectors derived between stages


SITE = site_id(0, "post_block")
OWN = np.full(4, 0.5, np.float32)


class Recorder(FakeEngineBase):
    """The engine interface ``execute`` drives: records what it is asked to run and with which vectors; every
    request captures one row at ``SITE`` holding its prompt index + 1."""

    def __init__(self):
        self.calls = []

    def run(self, requests, vectors=None, use_tqdm=True, progress=None):
        self.calls.append(([r.rid for r in requests], vectors))
        return {r.rid: RequestResult(r.rid, r.prompt.index, [], "", [], captures={
            SITE: (np.zeros(1, np.int32), np.full((1, 4), r.prompt.index + 1, np.float32))}) for r in requests}


def derived_plan(seen: list) -> Plan:
    prompts = [Prompt(i, f"p{i}", f"text {i}", (1, 2, 3 + i)) for i in range(2)]
    s = Sampling(max_tokens=1)
    capture = [Capture((SITE,), b"", False)]
    requests = [make_request("a", prompts[0], s, capture=capture), make_request("b", prompts[1], s, capture=capture),
                make_request("c", prompts[0], s, steer=[Steer(SITE, PREFILL | DECODE, "derived", 1.0)], stage=1)]

    def derive(results: dict) -> dict:
        seen.append(sorted(results))
        return {"derived": results["b"].captures[SITE][1][0] - results["a"].captures[SITE][1][0]}

    return Plan(requests=tuple(requests), vectors={"own": OWN}, engine_spec=engine_spec_of(requests, 0), captures=(),
                kind="test", derive_vectors=derive)


def test_derived_vectors_are_registered_with_the_first_stage_1_requests():
    seen = []
    engine = Recorder()
    results = execute(engine, derived_plan(seen), log=lambda _: None, use_tqdm=False)
    assert seen == [["a", "b"]]  # once, with stage 0's results only
    (first, own), (second, derived) = engine.calls
    assert first == ["a", "b"] and list(own) == ["own"]
    assert second == ["c"] and list(derived) == ["derived"]
    np.testing.assert_array_equal(derived["derived"], np.ones(4, np.float32))
    assert sorted(results) == ["a", "b", "c"]


def test_derived_vectors_come_from_a_journaled_stage_0_too(tmp_path):
    first = Journal(tmp_path / "journal")
    first.open(resume=False)
    execute(Recorder(), derived_plan([]), log=lambda _: None, use_tqdm=False, journal=first)
    (tmp_path / "journal" / "stage1-unit00000.msgpack").unlink()  # as if the run had stopped after stage 0
    journal = Journal(tmp_path / "journal")
    assert journal.open(resume=True) == 1
    seen, engine = [], Recorder()
    execute(engine, derived_plan(seen), log=lambda _: None, use_tqdm=False, journal=journal)
    assert seen == [["a", "b"]]
    ((rids, vectors),) = engine.calls  # stage 0 never ran here: the plan's own vectors come along
    assert rids == ["c"] and sorted(vectors) == ["derived", "own"]
    np.testing.assert_array_equal(vectors["derived"], np.ones(4, np.float32))
