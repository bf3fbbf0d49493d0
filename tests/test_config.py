"""Config validation: every bad input is a ConfigError naming the exact key path, before any engine starts.

Covers the pydantic schema (shape of the config), the checks that need the model (layers, prompt lengths,
architecture), the CLI's exit code 2, and that every shipped experiment composes with Hydra and compiles; vectors
and vector files: ``test_config_vectors.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, base_config
from interp_runner.config import ConfigError
from interp_runner.pipeline import prepare
from interp_runner.config.run import validate_config
from support.inprocess import Completed, interp_run

HIDDEN = 128  # tiny_random
V = [0.25] * HIDDEN


def problems(config: dict, base: Path | None = None) -> dict[str, str]:
    with pytest.raises(ConfigError) as err:
        prepare(config, base=base)
    found = err.value.problems
    assert found and all(isinstance(p, tuple) and len(p) == 2 for p in found)
    # the message lists every problem as "path: reason"
    for path, reason in found:
        assert f"{path}: {reason}" in str(err.value)
    return dict(found)


def assert_problem(config: dict, path: str, fragment: str, base: Path | None = None, only: bool = True) -> None:
    found = problems(config, base)
    assert path in found, f"expected a problem at {path!r}, got {found}"
    assert fragment in found[path], f"{path}: {found[path]!r} does not say {fragment!r}"
    if only:
        assert list(found) == [path], found


def steer_global(vector, tier: str = "base", hook: str = "post_block", layer=0, **extra) -> dict:
    return base_config(steering={"global": {tier: {hook: {"layer": layer, "vector": vector}}}}, **extra)


VEC = "steering.global.base.post_block.vector"


# ---------------------------------------------------------------- shape of the config (pydantic)


def test_unknown_top_level_key():
    assert_problem(base_config(bogus=1), "bogus", "unknown key")


def test_unknown_nested_key():
    config = base_config(steering={"global": {"base": {"post_blok": {"layer": 0, "vector": V}}}})
    assert_problem(config, "steering.global.base.post_blok", "unknown key")


def test_unknown_key_deep_in_a_request_term():
    config = base_config(
        steering={"request": [{"prompts": 0, "decode": {"mlp_out": [{"layer": 0, "vector": V, "scael": 2}]}}]}
    )
    assert_problem(config, "steering.request[0].decode.mlp_out[0].scael", "unknown key")


def test_unknown_key_in_capture_and_engine():
    found = problems(base_config(capture=[{"hooks": ["post_block"], "layer": 1}]))
    assert found == {"capture[0].layer": "unknown key"}
    found = problems(base_config(engine={"max_model_length": 100}))
    assert found == {"engine.max_model_length": "unknown key"}


def test_missing_required_key():
    config = base_config()
    del config["prompts"]
    assert_problem(config, "prompts", "required key is missing")
    assert_problem(base_config(capture=[{"name": "x"}]), "capture[0].hooks", "required key is missing")


def test_unknown_hook_in_capture():
    assert_problem(base_config(capture=[{"hooks": ["resid_post"]}]), "capture[0].hooks[0]", "post_block")


def test_unknown_hook_in_capture_second_entry():
    config = base_config(capture=[{"hooks": ["post_block"]}, {"name": "b", "hooks": ["mlp_out", "mlp"]}])
    assert_problem(config, "capture[1].hooks[1]",
                   "'pre_attn', 'attn_out', 'post_attn', 'mlp_out', 'post_block' or 'router_logits'")


def test_capture_needs_a_hook():
    assert_problem(base_config(capture=[{"hooks": []}]), "capture[0].hooks", "at least 1")


def test_bad_capture_positions_keyword():
    found = problems(base_config(capture=[{"hooks": ["post_block"], "positions": "last"}]))
    assert list(found) == ["capture[0].positions"], found


def test_bad_capture_name_and_dtype():
    assert_problem(base_config(capture=[{"name": "1st", "hooks": ["post_block"]}]), "capture[0].name", "pattern")
    found = problems(base_config(capture=[{"hooks": ["post_block"], "dtype": "int8"}]))
    assert list(found) == ["capture[0].dtype"] and "float32" in found["capture[0].dtype"]


def test_two_sources_for_one_vector():
    found = problems(steer_global({"values": V, "random": {"seed": 0, "norm": 1.0}}))
    assert list(found) == [VEC]
    assert "exactly one of values, file, name, random" in found[VEC] and "'values', 'random'" in found[VEC]


def test_no_source_for_a_vector():
    assert_problem(steer_global({}), VEC, "exactly one of values, file, name, random, store (got none)")


def test_key_without_file():
    assert_problem(steer_global({"values": V, "key": "a"}), VEC, "'key' only applies to a .safetensors or .pt file")


def test_random_norm_must_be_positive():
    assert_problem(steer_global({"random": {"seed": 0, "norm": 0}}), VEC + ".random.norm", "greater than 0")


def test_sampling_and_engine_ranges():
    assert_problem(base_config(sampling={"max_tokens": 0}), "sampling.max_tokens", "greater than or equal to 1")
    assert_problem(base_config(sampling={"logprobs": 21}), "sampling.logprobs", "less than or equal to 20")
    assert_problem(base_config(sampling={"temperature": -1}), "sampling.temperature", "greater than or equal")
    found = problems(base_config(engine={"dtype": "float64"}))
    assert list(found) == ["engine.dtype"]


def test_items_and_file_together():
    assert_problem(base_config(prompts={"items": ["a"], "file": "p.jsonl"}), "prompts", "either 'items' or 'file'")


def test_empty_prompt_text():
    assert_problem(base_config(prompts={"items": [{"text": ""}]}), "prompts.items[0].text", "at least 1 character")


def test_duplicate_capture_names():
    # both entries default to name "acts"
    config = base_config(capture=[{"hooks": ["post_block"]}, {"hooks": ["mlp_out"]}])
    found = problems(config)
    assert len(found) == 1
    ((path, reason),) = found.items()
    assert "distinct names" in reason
    # the problem must name a config key, not the root of the config
    assert path in ("capture", "capture[1].name"), found


def test_several_problems_reported_together():
    config = base_config(bogus=1, sampling={"max_tokens": 0}, capture=[{"hooks": ["nope"]}])
    found = problems(config)
    assert {"bogus", "sampling.max_tokens", "capture[0].hooks[0]"} <= set(found)


def test_validate_config_alone_needs_no_model():
    cfg = validate_config(base_config(steering={"global": {"base": {"post_block": {"layer": 400, "vector": V}}}}))
    assert cfg.steering.global_.base.post_block.layer == 400  # range checks need the model: the compiler's job


# ---------------------------------------------------------------- checks against the model (compiler)


def test_layer_out_of_range_in_third_request_entry():
    entry = {"prompts": [0], "base": {"post_block": {"layer": 1, "vector": V}}}
    bad = {"prompts": [1], "prefill": {"post_block": {"layer": 40, "vector": V}}}
    config = base_config(steering={"request": [entry, entry, bad]})
    assert_problem(config, "steering.request[2].prefill.post_block.layer", "40 out of range, model has 4 layers")


def test_layer_in_a_list_out_of_range():
    assert_problem(steer_global(V, layer=[0, 9]), "steering.global.base.post_block.layer[1]",
                   "9 out of range, model has 4 layers")


def test_negative_layer_out_of_range():
    assert_problem(steer_global(V, layer=-1), "steering.global.base.post_block.layer", "-1 out of range")


def test_layer_in_a_term_list_out_of_range():
    config = base_config(steering={"global": {"decode": {"attn_out": [
        {"layer": 0, "vector": V}, {"layer": [1, 2, 4], "vector": V}]}}})
    assert_problem(config, "steering.global.decode.attn_out[1].layer[2]", "4 out of range, model has 4 layers")


def test_layer_range_selecting_nothing():
    assert_problem(steer_global(V, layer="3:2"), "steering.global.base.post_block.layer", "selects no layer")


@pytest.mark.parametrize("selector", ["5:9", "2:99", "4:", "2:5"])
def test_layer_range_past_the_model_is_refused_not_clamped(selector):
    assert_problem(steer_global(V, layer=selector), "steering.global.base.post_block.layer",
                   "out of range, model has 4 layers")


def test_layer_selector_garbage():
    for selector in ("x", "1:2:3", "-1", "a:b"):
        assert_problem(steer_global(V, layer=selector), "steering.global.base.post_block.layer",
                       "is not a layer selector")


def test_capture_layers_out_of_range():
    assert_problem(base_config(capture=[{"hooks": ["post_block"], "layers": 4}]), "capture[0].layers",
                   "4 out of range, model has 4 layers")
    assert_problem(base_config(capture=[{"hooks": ["post_block"], "layers": [0, 1, 7]}]), "capture[0].layers[2]",
                   "7 out of range, model has 4 layers")
    assert_problem(base_config(capture=[{"hooks": ["post_block"], "layers": "6:"}]), "capture[0].layers",
                   "out of range, model has 4 layers")


@pytest.mark.parametrize(
    "config, path",
    [
        (steer_global(V, layer=[]), "steering.global.base.post_block.layer"),
        (base_config(steering={"request": [{"prompts": [], "base": {"post_block": {"layer": 0, "vector": V}}}]}),
         "steering.request[0].prompts"),
        (base_config(capture=[{"hooks": ["post_block"], "layers": []}]), "capture[0].layers"),
        (base_config(capture=[{"hooks": ["post_block"], "positions": []}]), "capture[0].positions"),
    ],
    ids=["steer-layers", "steer-prompts", "capture-layers", "capture-positions"],
)
def test_empty_selectors_are_rejected(config, path):
    """An empty list would silently steer or capture nothing (as 'hooks: []' and '5:9' already are errors)."""
    found = problems(config)
    assert list(found) == [path], found


def test_empty_prompt_list():
    assert_problem(base_config(prompts={"items": []}), "prompts", "empty prompt list")


def test_empty_prompt_file(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n\n")
    assert_problem(base_config(prompts={"file": "p.jsonl"}), "prompts", "empty prompt list", base=tmp_path)


def test_prompt_file_missing(tmp_path):
    assert_problem(base_config(prompts={"file": "missing.jsonl"}), "prompts.file",
                   f"file not found: {tmp_path / 'missing.jsonl'}", base=tmp_path)


def test_prompt_file_bad_lines(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"text": "hello"}\nnot json\n')
    assert_problem(base_config(prompts={"file": "p.jsonl"}), "prompts.file", "p.jsonl:2 is not valid JSON",
                   base=tmp_path)
    (tmp_path / "q.jsonl").write_text('{"text": "hello"}\n{"id": "x"}\n')
    assert_problem(base_config(prompts={"file": "q.jsonl"}), "prompts.file[1].text",
                   "q.jsonl:2: required key is missing", base=tmp_path)
    (tmp_path / "r.jsonl").write_text('{"text": "hello"}\n["hello"]\n')
    assert_problem(base_config(prompts={"file": "r.jsonl"}), "prompts.file", "r.jsonl:2 is not a JSON object",
                   base=tmp_path)


def test_empty_prompt_text_in_a_list():
    assert_problem(base_config(prompts={"items": ["ok", ""]}), "prompts.items[1]", "at least 1 character")


def test_capture_position_beyond_the_prompt():
    config = base_config(prompts={"items": ["Hello, my name is"]},
                         capture=[{"hooks": ["post_block"], "positions": [0, 50]}])
    assert_problem(config, "capture[0].positions[1]", "position 50 is beyond prompt 0")
    config = base_config(prompts={"items": ["Hello, my name is"]},
                         capture=[{"hooks": ["post_block"], "positions": [-1, -50]}])
    assert_problem(config, "capture[0].positions[1]", "position -50 is beyond prompt 0")


def test_prompt_selector_out_of_range():
    request = {"prompts": 2, "base": {"post_block": {"layer": 0, "vector": V}}}
    assert_problem(base_config(steering={"request": [request]}), "steering.request[0].prompts",
                   "prompt 2 out of range, there are 2 prompts")
    request = {"prompts": [0, 5], "base": {"post_block": {"layer": 0, "vector": V}}}
    assert_problem(base_config(steering={"request": [request]}), "steering.request[0].prompts[1]",
                   "prompt 5 out of range")
    assert_problem(base_config(capture=[{"hooks": ["post_block"], "prompts": [3]}]), "capture[0].prompts[0]",
                   "prompt 3 out of range")


def test_max_model_len_too_small():
    config = base_config(engine={"max_model_len": 16}, sampling={"max_tokens": 10})
    assert_problem(config, "engine.max_model_len", "16 is too small: longest prompt + sampling.max_tokens")


def test_null_max_model_len_is_the_models_own():
    """``engine.max_model_len: null`` (interp-serve's default) takes the model's length: the plan checks prompts
    against it and the engine and store get the number."""
    from interp_runner.models.facts import ModelFacts
    from interp_runner.models.materialize import model_folder

    prepared = prepare(base_config(engine={"max_model_len": None}))
    facts = ModelFacts.from_folder(model_folder(prepared.cfg.model), None)
    assert facts.max_model_len and prepared.cfg.engine.max_model_len == facts.max_model_len
    assert prepare(base_config(engine={"max_model_len": 512})).cfg.engine.max_model_len == 512


def test_unknown_model_name():
    config = {**base_config(), "model": {"name": "gpt-17"}}
    found = problems(config)
    assert len(found) == 1 and list(found)[0] in ("model", "model.name")
    assert "gpt-17" in next(iter(found.values()))


def test_model_path_without_config(tmp_path):
    config = {**base_config(), "model": {"name": "x", "path": str(tmp_path)}}
    assert_problem(config, "model.path", "is not a model folder (no config.json)")


def fake_model_folder(tmp_path, tiny_path, **config_changes) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    config = json.loads((tiny_path / "config.json").read_text())
    config.update(config_changes)
    (folder / "config.json").write_text(json.dumps(config))
    for f in tiny_path.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "special_tokens_map.json":
            shutil.copy(f, folder / f.name)
    return folder


def test_unsupported_architecture(tmp_path, tiny_path):
    folder = fake_model_folder(tmp_path, tiny_path, architectures=["Olmo2ForCausalLM"])
    config = {**base_config(), "model": {"name": "olmo2", "path": str(folder)}}
    found = problems(config)
    assert list(found) in (["model"], ["model.path"]), found
    reason = next(iter(found.values()))
    assert "unsupported architecture Olmo2ForCausalLM" in reason and "LlamaForCausalLM" in reason


def test_unsupported_architecture_with_its_own_config_keys(tmp_path, tiny_path):
    # a real BLOOM config.json has n_layer / n_embed, not num_hidden_layers / hidden_size
    folder = fake_model_folder(tmp_path, tiny_path, architectures=["BloomForCausalLM"], n_layer=4, n_embed=128)
    config = json.loads((folder / "config.json").read_text())
    del config["num_hidden_layers"], config["hidden_size"]
    (folder / "config.json").write_text(json.dumps(config))
    found = problems({**base_config(), "model": {"name": "bloom", "path": str(folder)}})
    assert list(found) in (["model"], ["model.path"]), found
    assert "BloomForCausalLM" in next(iter(found.values()))


# ---------------------------------------------------------------- the CLI


def _cli(*args, run_dir: Path) -> Completed:
    return interp_run(*args, f"hydra.run.dir={run_dir}", engines=None)


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """The CLI's ``main`` in this process (``support.inprocess``), three times."""
    root = tmp_path_factory.mktemp("cli")
    runs = {
        "bad": _cli("+experiment=steering_demo", "steering.request.0.base.post_block.layer=40", "dry_run=true",
                    run_dir=root / "bad"),
        "bad_no_dry": _cli("+experiment=steering_demo", "steering.request.0.base.post_block.layer=40",
                           f"store.path={root / 'bad_store.zarr'}", run_dir=root / "bad_no_dry"),
        "ok": _cli("+experiment=steering_demo", "dry_run=true", run_dir=root / "ok"),
    }
    return root, {name: (run.returncode, run.stdout, run.stderr) for name, run in runs.items()}


def test_cli_config_error_exits_2(cli_runs):
    root, out = cli_runs
    for name in ("bad", "bad_no_dry"):
        rc, stdout, stderr = out[name]
        assert rc == 2, stderr[-3000:]
        assert "config error: steering.request[0].base.post_block.layer: 40 out of range, model has 30 layers" \
            in stderr
        assert "starting engine" not in stdout
    assert not list(root.rglob("*.zarr")), list(root.rglob("*.zarr"))
    assert not (root / "bad_store.zarr").exists()


def test_cli_valid_dry_run_exits_0(cli_runs):
    root, out = cli_runs
    rc, stdout, stderr = out["ok"]
    assert rc == 0, stderr[-3000:]
    assert "dry run: config valid" in stdout and "plan: 4 requests" in stdout
    assert not list(root.rglob("results.zarr"))


# ---------------------------------------------------------------- shipped experiments compose and compile

EXPERIMENTS = sorted(
    str(p.relative_to(REPO / "conf" / "experiment").with_suffix(""))
    for p in (REPO / "conf" / "experiment").rglob("*.yaml")
)


def test_there_are_experiments():
    assert {"steering_demo", "steering_smoke"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "causal_trace_full" else n
                                  for n in EXPERIMENTS])  # the full trace's plan: 100k requests, twice
def test_experiment_composes_and_compiles(name):
    import interp_runner.cli  # noqa: F401  registers the experiments_dir resolver
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"+experiment={name}"])
    config = OmegaConf.to_container(cfg, resolve=True)
    assert config["experiment"]["name"] == Path(name).name
    prepared = prepare(config, base=REPO)
    assert prepared.plan.requests and len(prepared.plan.requests_sha256) == 64
    assert prepared.cfg.dry_run is False
    # the same config again compiles to the same requests
    assert prepare(config, base=REPO).plan.requests_sha256 == prepared.plan.requests_sha256


def test_open_engine_settings_are_decided_per_device_and_plan():
    """Where the config leaves them open: eager except for plans that decode on a GPU; packed trace cells
    everywhere, and 32-token KV blocks on a CPU that packs them (vLLM's CPU default, 128, pads every cell to 128)."""
    from interp_runner.config.schema import EngineConfig

    open_ = EngineConfig()
    assert open_.packs_cells()
    cpu, gpu = open_.resolved(gpu=False, decodes=False), open_.resolved(gpu=True, decodes=True)
    assert (cpu.enforce_eager, cpu.block_size) == (True, 32)
    assert (gpu.enforce_eager, gpu.block_size) == (False, None)  # vLLM's block size on a GPU
    assert EngineConfig(pack_cells=False).resolved(gpu=False, decodes=False).block_size is None
    assert EngineConfig(block_size=128).resolved(gpu=False, decodes=False).block_size == 128
