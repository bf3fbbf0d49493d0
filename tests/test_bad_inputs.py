"""A campaign of bad inputs: each one is refused before any engine starts, with exit code 2 and the config key named.

Classes: (1) floats that are not finite, or not finite as float32 or the engine's dtype; (2) settings only vLLM
checks (model limits, tensor parallelism, scheduler, KV cache, sampling ranges); (3) selectors that would clamp or
repeat; (4) files and folders that would raise (bad UTF-8, folders, malformed lines, a model without tokenizer or
weights, chat templates where character spans are needed); (5) Hydra's own errors; (6) input that would be
converted with loss (strings, floats or bools for ints, int vector files, out-of-range seeds); (7) capture-only sites
(a MoE router's logits) steered (a steering vector's hooks included), patched, mixed into an entry of hidden-size
hooks, or named for a dense model.

Most cases run in this process through ``prepare()`` (what a dry run does); a subset, every Hydra error among them,
runs through the CLI's ``main`` (in this process: ``support.inprocess``), which must exit 2, name the key, print no
traceback, start no engine and leave the files that were there as they were.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, base_config, has_cuda
from interp_runner.config import ConfigError
from interp_runner.pipeline import prepare
from support.inprocess import Completed, interp_run as run_main

FACTS = REPO / "experiments" / "causal_trace" / "facts.jsonl"
HIDDEN = 128  # tiny_random: 4 layers, 4 heads, 2 KV heads, max_position_embeddings 2048
V = [0.25] * HIDDEN
ON_CPU = pytest.mark.skipif(has_cuda(), reason="a CPU rule")
ENGINE_LOG = ("engine started", "engine reused", "engine start")


# ---------------------------------------------------------------- inputs on disk


def tiny_folder() -> Path:
    from interp_runner.models.materialize import model_path

    return model_path("tiny_random")


def make_inputs(d: Path) -> Path:
    """Every bad file a case points at, under ``d``."""
    (d / "latin1.jsonl").write_bytes('{"text": "caf\u00e9"}\n'.encode("latin-1"))
    (d / "folder.jsonl").mkdir()
    facts = [json.loads(line) for line in FACTS.read_text().splitlines()[:2]]
    (d / "latin1_facts.jsonl").write_bytes(b'{"subject": "Caf\xe9", "prompt": "Caf\xe9 is", "answer": " x"}\n')
    (d / "bad_json.jsonl").write_text(json.dumps(facts[0]) + "\n{subject: Rome}\n")
    (d / "no_answer.jsonl").write_text(json.dumps({k: v for k, v in facts[0].items() if k != "answer"}) + "\n")
    (d / "int_subject.jsonl").write_text(json.dumps({**facts[0], "subject": 5}) + "\n")
    (d / "list_line.jsonl").write_text(json.dumps(list(facts[0].values())) + "\n")
    (d / "number_answer.jsonl").write_text(json.dumps({**facts[0], "answer": 7}) + "\n")
    (d / "same_ids.jsonl").write_text(json.dumps(facts[0]) + "\n" + json.dumps({**facts[1], "id": facts[0]["id"]}))
    (d / "number_answer_prompts.jsonl").write_text('{"text": "The capital of France is", "answer": 7}\n')
    (d / "text_and_prompt.jsonl").write_text('{"text": "a", "prompt": "b"}\n')
    (d / "dir.npy").mkdir()
    np.save(d / "huge.npy", np.full(HIDDEN, 1e39))
    np.save(d / "ints.npy", np.arange(HIDDEN))
    torch.save(torch.arange(HIDDEN), d / "ints.pt")
    tiny = tiny_folder()
    no_tokenizer = d / "no_tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors", "weights.sha256"):
        os.symlink(tiny / name, no_tokenizer / name)
    no_weights = d / "no_weights"
    no_weights.mkdir()
    broken = d / "broken_config"
    broken.mkdir()
    for f in tiny.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "config.json":
            shutil.copy(f, no_weights / f.name)
            shutil.copy(f, broken / f.name)
    os.symlink(tiny / "model.safetensors", broken / "model.safetensors")
    (broken / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    # the tokenizer without its chat template; a config whose vocabulary is smaller than the tokenizer's
    for name, config_changes in (("no_chat_template", {}), ("small_vocab", {"vocab_size": 100})):
        folder = d / name
        folder.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "model.safetensors", "weights.sha256"):
            os.symlink(tiny / f, folder / f)
        config = json.loads((tiny / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    (d / "pt_folder.pt").mkdir()
    return d


def snapshot(d: Path) -> dict[str, bytes | str | None]:
    """Every path under ``d``: a file's bytes, a link's target (the model's weights: not read), None for a folder."""
    def state(p: Path):
        return os.readlink(p) if p.is_symlink() else p.read_bytes() if p.is_file() else None

    return {str(p.relative_to(d)): state(p) for p in sorted(d.rglob("*"))}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return make_inputs(tmp_path_factory.mktemp("inputs"))


@pytest.fixture()
def untouched(inputs):
    """The input files are exactly as they were after the case."""
    before = snapshot(inputs)
    yield inputs
    assert snapshot(inputs) == before


# ---------------------------------------------------------------- configs


def engine(config: dict | None = None, **settings) -> dict:
    """``config`` (default: the base config) with these engine settings."""
    config = config or base_config()
    return {**config, "engine": {**config["engine"], **settings}}


def steer(term: dict | None = None, vector=None) -> dict:
    return base_config(steering={"global": {"base": {"post_block": {
        "layer": 0, "vector": V if vector is None else vector, **(term or {})}}}})


def sampling(**settings) -> dict:
    return base_config(sampling={"max_tokens": 4, **settings})


def capture(**spec) -> dict:
    return base_config(capture=[{"hooks": ["post_block"], **spec}])


def patch(**spec) -> dict:
    """A zero patch into prompt 1 ("Hello, my name is": 5 tokens)."""
    return base_config(patching=[{"prompts": [1], "source": {"zeros": True}, "hook": "post_block", "layers": [0],
                                  **spec}])


def request(prompts) -> dict:
    return base_config(steering={"request": [{"prompts": prompts, "base": {"post_block": {"layer": 0, "vector": V}}}]})


def trace(facts: str | Path = FACTS, prompts: dict | None = None, **keys) -> dict:
    spec = {"facts": str(facts), "num_facts": 1, "components": ["resid"], "layers": [0], "window": 2,
            "noise": {"samples": 1}, "filter": False, "plots": False}
    for key, value in keys.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and key in spec else value
    return base_config(prompts=prompts or {"items": []}, causal_trace=spec)


def chat_template(config: dict) -> dict:
    return {**config, "prompts": {**config["prompts"], "chat_template": True}}


def prompt_file(name: str) -> callable:
    return lambda d: base_config(prompts={"file": str(d / name)})


def model_path(name: str) -> callable:
    return lambda d: {**base_config(), "model": {"name": "local", "path": str(d / name)}}


VEC = "steering.global.base.post_block.vector"
SCALE = "steering.global.base.post_block.scale"

# (id, config or config(inputs dir), key named, fragment of the reason)
NON_FINITE = [
    ("scale-nan", steer({"scale": float("nan")}), SCALE, "finite"),
    ("scale-inf", steer({"scale": float("inf")}), SCALE, "finite"),
    ("scale-beyond-float32", steer({"scale": 1e39}), SCALE, "float32"),
    ("scale-underflows-float32", steer({"scale": 1e-50}), SCALE, "rounds to 0"),
    ("scale-times-vector-overflows", steer({"scale": 1e30}, [1e10] * HIDDEN), SCALE, "float32"),
    ("vector-value-beyond-float32", steer(vector=[1e39] + V[1:]), VEC + ".values[0]", "float32"),
    ("vector-value-nan", steer(vector=[float("nan")] + V[1:]), VEC + ".values[0]", "finite"),
    ("random-norm-inf", steer(vector={"random": {"seed": 0, "norm": float("inf")}}), VEC + ".random.norm", "finite"),
    ("random-norm-underflows", steer(vector={"random": {"seed": 0, "norm": 1e-50}}), VEC + ".random.norm",
     "rounds to 0"),
    ("noise-k-inf", trace(noise={"k": float("inf")}), "causal_trace.noise.k", "finite"),
    ("noise-k-beyond-float32", trace(noise={"k": 1e39}), "causal_trace.noise.k", "float32"),
    ("noise-std-beyond-float32", trace(noise={"k": 3e38}), "causal_trace.noise.k", "float32"),
    ("patch-alpha-nan", patch(alpha=float("nan")), "patching[0].alpha", "finite"),
    ("temperature-nan", sampling(temperature=float("nan")), "sampling.temperature", "finite"),
    ("top-p-nan", sampling(top_p=float("nan")), "sampling.top_p", "finite"),
    ("gpu-memory-utilization-inf", engine(gpu_memory_utilization=float("inf")), "engine.gpu_memory_utilization",
     "finite"),
    ("steering-beyond-float16", engine(steer({"scale": 1e6}), dtype="float16"), "engine.dtype", "float16"),
    ("patch-vector-beyond-float16", engine(patch(source={"vector": [1e6] * HIDDEN}), dtype="float16"),
     "engine.dtype", "float16"),
]

VLLM_RULES = [
    ("tp-does-not-divide-heads", engine(tensor_parallel_size=3), "engine.tensor_parallel_size", "4 attention heads"),
    ("tp-more-than-devices", engine(tensor_parallel_size=8), "engine.tensor_parallel_size", "ranks need 8"),
    ("max-model-len-beyond-model", engine(max_model_len=4096), "engine.max_model_len", "max_position_embeddings"),
    ("temperature-above-2", sampling(temperature=2.5), "sampling.temperature", "less than or equal to 2"),
    ("temperature-inf", sampling(temperature=float("inf")), "sampling.temperature", "finite"),
    ("top-p-zero", sampling(top_p=0.0), "sampling.top_p", "greater than 0"),
    ("top-p-above-1", sampling(top_p=1.5), "sampling.top_p", "less than or equal to 1"),
    ("logprobs-above-vllm-max", sampling(logprobs=21), "sampling.logprobs", "less than or equal to 20"),
    ("batched-tokens-below-seqs", engine(max_num_seqs=64, max_num_batched_tokens=32),
     "engine.max_num_batched_tokens", "less than engine.max_num_seqs"),
    ("seqs-above-default-batched-tokens", engine(max_num_seqs=20000), "engine.max_num_seqs",
     "max_num_batched_tokens"),
    ("default-seqs-above-batched-tokens", engine(max_num_seqs=None, max_num_batched_tokens=128),
     "engine.max_num_batched_tokens", "vLLM's default max_num_seqs"),
    ("kv-cache-below-the-models-length", engine(max_model_len=None, kv_cache_memory_bytes=1000),
     "engine.kv_cache_memory_bytes", "KV cache"),
    ("kv-cache-below-one-sequence", engine(kv_cache_memory_bytes=1000), "engine.kv_cache_memory_bytes",
     "KV cache"),
    ("engine-seed-beyond-32-bits", engine(seed=2**32), "engine.seed", "less than"),
    ("block-size-not-whole-16s", engine(block_size=24), "engine.block_size", "multiple of 16"),
    pytest.param(engine(batch_invariant=True), "engine.batch_invariant", "GPU", marks=ON_CPU,
                 id="batch-invariant-on-cpu"),
]

SELECTORS = [
    ("layer-range-past-the-end", steer({"layer": "2:99"}), SCALE.replace("scale", "layer"), "out of range"),
    ("capture-layer-range-past-the-end", capture(layers="2:5"), "capture[0].layers", "out of range"),
    ("layer-range-negative-start", capture(layers="-2:"), "capture[0].layers", "not a layer selector"),
    ("layer-negative", capture(layers=[-1]), "capture[0].layers[0]", "out of range"),
    ("layers-repeat", capture(layers=[1, 1]), "capture[0].layers", "repeat"),
    ("prompts-repeat", request([1, 1]), "steering.request[0].prompts", "repeat"),
    ("capture-prompts-negative", capture(prompts=[-1]), "capture[0].prompts[0]", "out of range"),
    ("capture-positions-repeat", capture(positions=[0, 0]), "capture[0].positions[1]", "repeats"),
    ("capture-positions-alias", capture(positions=[-1, 0, -1]), "capture[0].positions[2]", "repeats"),
    ("patch-positions-repeat", patch(positions=[2, 2]), "patching[0].positions[1]", "repeats"),
    ("patch-positions-alias", patch(positions=[0, -5]), "patching[0].positions[1]", "repeats"),
    ("patch-prompts-repeat", patch(prompts=[1, 1]), "patching[0].prompts", "repeat"),
    ("trace-layers-past-the-end", trace(layers="0:9"), "causal_trace.layers", "out of range"),
    ("trace-layers-repeat", trace(layers=[0, 0]), "causal_trace.layers", "repeat"),
    ("trace-window-past-the-model", trace(components=["mlp"], window=9), "causal_trace.window",
     "larger than the model"),
    ("trace-components-under-their-old-key", trace(kinds=["resid"]), "causal_trace.kinds",
     "renamed: give causal_trace.components"),
    ("trace-more-facts-than-the-file", trace(num_facts=999), "causal_trace.num_facts", "holds 24 facts"),
]

FILES = [
    ("prompt-file-not-utf8", prompt_file("latin1.jsonl"), "prompts.file", "not UTF-8"),
    ("prompt-file-is-a-folder", prompt_file("folder.jsonl"), "prompts.file", "is a folder"),
    ("prompt-file-missing", prompt_file("missing.jsonl"), "prompts.file", "not found"),
    ("prompt-line-text-and-prompt", prompt_file("text_and_prompt.jsonl"), "prompts.file[0]", "not both"),
    ("facts-not-utf8", lambda d: trace(d / "latin1_facts.jsonl"), "causal_trace.facts", "not UTF-8"),
    ("facts-folder", lambda d: trace(d / "folder.jsonl"), "causal_trace.facts", "is a folder"),
    ("facts-missing", lambda d: trace(d / "missing.jsonl"), "causal_trace.facts", "not found"),
    ("facts-line-bad-json", lambda d: trace(d / "bad_json.jsonl", num_facts=None), "causal_trace.facts",
     "bad_json.jsonl:2 is not valid JSON"),
    ("facts-line-missing-field", lambda d: trace(d / "no_answer.jsonl"), "causal_trace.facts[0].answer",
     "required key is missing"),
    ("facts-line-wrong-type", lambda d: trace(d / "int_subject.jsonl"), "causal_trace.facts[0].subject",
     "valid string"),
    ("facts-line-not-an-object", lambda d: trace(d / "list_line.jsonl"), "causal_trace.facts", "not a JSON object"),
    ("facts-ids-repeat", lambda d: trace(d / "same_ids.jsonl", num_facts=None), "causal_trace.facts[1].id",
     "already"),
    ("model-without-tokenizer", model_path("no_tokenizer"), "model.path", "no tokenizer"),
    ("model-without-weights", model_path("no_weights"), "model.path", "no .safetensors"),
    ("model-config-not-json", model_path("broken_config"), "model.path", "config.json"),
    ("chat-template-with-span", chat_template(patch(positions={"span": "Eiffel"})), "patching[0].positions.span",
     "chat template"),
    ("chat-template-with-trace", trace(prompts={"items": [], "chat_template": True}), "prompts.chat_template",
     "chat template"),
    ("vector-file-is-a-folder", lambda d: steer(vector=str(d / "dir.npy")), VEC + ".file", "is a folder"),
    ("vector-pt-is-a-folder", lambda d: steer(vector=str(d / "pt_folder.pt")), VEC + ".file", "is a folder"),
    ("model-without-chat-template", lambda d: chat_template(model_path("no_chat_template")(d)),
     "prompts.chat_template", "has no chat template"),
    ("tokenizer-beyond-the-vocabulary", model_path("small_vocab"), "prompts.items[0]", "beyond the model's vocab"),
    ("vector-file-missing", lambda d: steer(vector=str(d / "nowhere.npy")), VEC + ".file", "not found"),
    ("vector-file-unknown-type", steer(vector={"file": "love.txt"}), VEC, "a vector file is one of"),
]

RECONVERTED = [
    ("prompt-index-float", request([1.5]), "steering.request[0].prompts[0]", "integer"),
    ("prompt-index-string", request(["1"]), "steering.request[0].prompts[0]", "integer"),
    ("prompt-index-bool", request(True), "steering.request[0].prompts", "integer"),
    ("patch-source-prompt-bool", patch(source={"prompt": True}), "patching[0].source.prompt", "integer"),
    ("patch-source-prompt-float", patch(source={"prompt": 0.0}), "patching[0].source.prompt", "integer"),
    ("layer-string", steer({"layer": "3"}), SCALE.replace("scale", "layer"), "not a layer selector"),
    ("layer-bool", capture(layers=True), "capture[0].layers", "integer"),
    ("max-tokens-float", sampling(max_tokens=2.0), "sampling.max_tokens", "integer"),
    ("max-tokens-string", sampling(max_tokens="4"), "sampling.max_tokens", "integer"),
    ("temperature-string", sampling(temperature="0.5"), "sampling.temperature", "number"),
    ("scale-bool", steer({"scale": True}), SCALE, "number"),
    ("dry-run-string", {**base_config(), "dry_run": "yes"}, "dry_run", "boolean"),
    ("vector-npy-beyond-float32", lambda d: steer(vector=str(d / "huge.npy")), VEC, "float32"),
    ("vector-npy-of-ints", lambda d: steer(vector=str(d / "ints.npy")), VEC, "not a float dtype"),
    ("vector-pt-of-ints", lambda d: steer(vector=str(d / "ints.pt")), VEC, "not a float dtype"),
    ("facts-answer-a-number", lambda d: trace(d / "number_answer.jsonl"), "causal_trace.facts[0].answer",
     "valid string"),
    ("prompt-answer-a-number", prompt_file("number_answer_prompts.jsonl"), "prompts.file[0].answer", "valid string"),
    ("sampling-seed-negative", sampling(seed=-1), "sampling.seed", "greater than or equal to 0"),
    ("sampling-seed-beyond-32-bits", sampling(seed=2**40), "sampling.seed", "less than"),
    ("noise-seed-negative", trace(noise={"seed": -1}), "causal_trace.noise.seed", "greater than or equal to 0"),
    ("random-seed-negative", steer(vector={"random": {"seed": -3}}), VEC + ".random.seed", "greater than"),
    ("prompt-id-empty", base_config(prompts={"items": [{"text": "a", "id": ""}]}), "prompts.items[0].id",
     "at least 1"),
    ("prompt-ids-repeat", base_config(prompts={"items": [{"text": "a", "id": "x"}, {"text": "b", "id": "x"}]}),
     "prompts.items[1].id", "already"),
]

ROUTER = {"hooks": ["router_logits"], "layers": [0]}
PAIRS, HELDOUT = (REPO / "experiments" / "steering_vectors" / name for name in ("pairs.jsonl", "heldout.jsonl"))


def steering_vectors(**section) -> dict:
    """A steering_vectors run on tiny_qwen3_moe (a MoE model: its router_logits exist, and still cannot be steered)."""
    return {**base_config("tiny_qwen3_moe", prompts={"items": []}),
            "steering_vectors": {"pairs": str(PAIRS), "eval": {"prompts": str(HELDOUT)}, **section}}


CAPTURE_ONLY = [
    ("router-logits-on-a-dense-model", base_config(capture=[ROUTER]), "capture[0].hooks[0]",
     "exists in the blocks of MoE families with a router: qwen3_moe"),
    ("router-logits-beside-hidden-size-hooks", base_config("tiny_qwen3_moe", capture=[
        {**ROUTER, "hooks": ["mlp_out", "router_logits"]}]), "capture[0].hooks", "capture entry of its own"),
    ("router-logits-steered", base_config("tiny_qwen3_moe", steering={"global": {"prefill": {"router_logits": {
        "layer": 0, "vector": V}}}}), "steering.global.prefill.router_logits", "capture-only site"),
    ("router-logits-patched", base_config("tiny_qwen3_moe", patching=[{
        "prompts": [1], "source": {"zeros": True}, "hook": "router_logits", "layers": [0]}]), "patching[0].hook",
     "capture-only site"),
    ("router-logits-steered-while-decoding", base_config("tiny_qwen3_moe", steering={"global": {"decode": {
        "router_logits": {"layer": 0, "vector": V}}}}), "steering.global.decode.router_logits", "not steered"),
    ("router-logits-steered-per-request", base_config("tiny_qwen3_moe", steering={"request": [{"prompts": [0],
        "base": {"router_logits": {"layer": 0, "vector": V}}}]}), "steering.request[0].base.router_logits",
     "not steered"),
    ("router-logits-steered-on-a-dense-model", base_config(steering={"global": {"base": {"router_logits": {
        "layer": 0, "vector": V}}}}), "steering.global.base.router_logits", "capture-only site"),
    ("router-logits-patched-on-a-dense-model", base_config(patching=[{"prompts": [1], "source": {"zeros": True},
        "hook": "router_logits", "layers": [0]}]), "patching[0].hook", "not patched"),
    ("router-logits-layer-past-the-end", base_config("tiny_qwen3_moe", capture=[{**ROUTER, "layers": [99]}]),
     "capture[0].layers[0]", "out of range"),
    ("router-logits-range-past-the-end", base_config("tiny_qwen3_moe", capture=[{**ROUTER, "layers": "0:99"}]),
     "capture[0].layers", "out of range"),
    ("router-logits-twice-in-an-entry", base_config("tiny_qwen3_moe", capture=[
        {**ROUTER, "hooks": ["router_logits", "router_logits"]}]), "capture[0].hooks", "repeat"),
    ("router-logits-as-a-steering-vector-hook", steering_vectors(hooks=["post_block", "router_logits"]),
     "steering_vectors.hooks[1]", "capture-only site"),
    ("router-logits-as-the-evaluated-hook", steering_vectors(eval={"prompts": str(HELDOUT), "hook": "router_logits"}),
     "steering_vectors.eval.hook", "capture-only site"),
]


CLASSES = {"non-finite": NON_FINITE, "vllm-rule": VLLM_RULES, "selector": SELECTORS, "file": FILES,
           "reconverted": RECONVERTED, "capture-only": CAPTURE_ONLY}


def campaign() -> list:
    """Every in-process case, its id prefixed by its class."""
    out = []
    for name, cases in CLASSES.items():
        for case in cases:
            if hasattr(case, "marks"):
                out.append(pytest.param(*case.values, marks=case.marks, id=f"{name}:{case.id}"))
            else:
                out.append(pytest.param(*case[1:], id=f"{name}:{case[0]}"))
    return out


def refused(config, inputs: Path) -> dict[str, str]:
    """The problems ``prepare`` finds, by key (the reasons of one key joined)."""
    config = config(inputs) if callable(config) else config
    with pytest.raises(ConfigError) as err:
        prepare(config, base=inputs)
    found: dict[str, str] = {}
    for key, reason in err.value.problems:
        found[key] = f"{found[key]}; {reason}" if key in found else reason
    return found


@pytest.mark.parametrize("config, key, fragment", campaign())
def test_refused_before_any_engine(config, key, fragment, untouched):
    found = refused(config, untouched)
    assert key in found, f"expected {key!r} named, got {found}"
    assert fragment in found[key], f"{key}: {found[key]!r} does not say {fragment!r}"


def test_tensor_parallel_on_cpu_needs_a_core_list_per_rank(monkeypatch, untouched):
    if has_cuda():
        pytest.skip("a CPU rule")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
    found = refused(engine(tensor_parallel_size=2), untouched)
    assert "lists cores for 1" in found["engine.tensor_parallel_size"]
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    if len(os.sched_getaffinity(0)) >= 2:
        prepare(engine(tensor_parallel_size=2), base=untouched)  # what test_tensor_parallel runs


def test_the_campaign_is_large():
    assert all(len(cases) >= 10 for cases in CLASSES.values()) and len(CLI_CASES) >= 10


def test_good_inputs_still_pass(untouched):
    """The checks refuse what would fail or mislead, not what the README documents."""
    config = base_config(
        prompts={"items": ["The Eiffel Tower is located in the city of", {"text": "Hello, my name is", "id": "hi"}]},
        steering={"global": {"base": {"post_block": {"layer": "1:4", "vector": {"random": {"seed": 0, "norm": 4}},
                                                     "scale": -2}}},
                  "request": [{"prompts": [1], "decode": {"mlp_out": {"layer": [0, 3], "vector": V}}}]},
        capture=[{"hooks": ["pre_attn"], "layers": ":2", "positions": [0, -1]}],
        patching=[{"prompts": [1], "source": {"zeros": True}, "hook": "post_block", "layers": "all", "alpha": 0.5,
                   "positions": [0, -1]}],
        sampling={"max_tokens": 4, "temperature": 2.0, "top_p": 0.9, "seed": 2**32 - 1, "logprobs": 20},
    )
    assert prepare(config).plan.requests
    assert prepare(trace(layers="0:4", num_facts=24)).plan.requests


# ---------------------------------------------------------------- through the real CLI

SMOKE = ["+experiment=steering_smoke", "model=tiny_random"]
CLI_CASES = [
    # (id, overrides, key named, fragment of the reason); {d}: the inputs folder
    ("hydra:unknown-experiment", ["+experiment=causl_trace"], "experiment", "did you mean 'causal_trace'"),
    ("hydra:unknown-key-without-plus", ["engine.foo=1"], "engine.foo", "+engine.foo=1"),
    ("hydra:misspelt-key", ["engine.max_modl_len=512"], "engine.max_modl_len", "did you mean 'engine.max_model_len'"),
    ("hydra:bad-override-syntax", ["sampling={a:1"], "sampling", "cannot parse"),
    ("hydra:unknown-group-option", ["model=nope"], "model", "tiny_random"),
    ("hydra:misspelt-group-option", ["engine=eagre"], "engine", "did you mean 'eager'"),
    ("hydra:experiment-without-plus", ["experiment=causal_trace"], "experiment", "+experiment"),
    ("hydra:delete-missing-key", ["~engine.nope"], "engine.nope", "does not exist"),
    ("hydra:multirun-unknown-key", ["-m", *SMOKE, "sampling.seed=1,2", "engine.fo=1"], "engine.fo", "no such key"),
    ("hydra:multirun-unknown-option", ["-m", "+experiment=steering_smoke", "model=tiny_random,nope"], "model",
     "no model 'nope'"),
    ("hydra:unresolved-interpolation", [*SMOKE, "experiment.name=${oops}"], "experiment.name", "oops"),
    ("non-finite:noise-k-inf", ["+experiment=causal_trace", "model=tiny_random", "causal_trace.noise.k=inf"],
     "causal_trace.noise.k", "finite"),
    ("vllm-rule:tp-3", [*SMOKE, "engine.tensor_parallel_size=3"], "engine.tensor_parallel_size", "attention heads"),
    ("vllm-rule:max-model-len", [*SMOKE, "engine.max_model_len=4096"], "engine.max_model_len", "2048"),
    ("selector:layer-range", [*SMOKE, "capture.0.layers='2:99'"], "capture[0].layers", "out of range"),
    ("file:prompt-file-not-utf8", [*SMOKE, "prompts.items=[]", "+prompts.file={d}/latin1.jsonl"], "prompts.file",
     "UTF-8"),
    ("file:model-without-tokenizer", ["+experiment=steering_smoke", "model.path={d}/no_tokenizer"], "model.path",
     "no tokenizer"),
    # not dry runs: each stops before the store and the engine
    ("vllm-rule:no-dry-run-tp-3", [*SMOKE, "engine=eager", "engine.tensor_parallel_size=3",
                                   "store.path={d}/kept.zarr", "dry_run=false"], "engine.tensor_parallel_size",
     "attention heads"),
    ("reconverted:no-dry-run-seed", [*SMOKE, "engine=eager", "sampling.seed=-1", "store.path={d}/kept.zarr",
                                     "dry_run=false"], "sampling.seed", "greater than or equal to 0"),
]


def interp_run(args: list[str], run_dir: Path) -> Completed:
    """``interp-run`` (a dry run unless the case says otherwise), its run and sweep folders under ``run_dir``."""
    dry = [] if "dry_run=false" in args else ["dry_run=true"]
    where = [f"hydra.run.dir={run_dir / 'run'}", f"hydra.sweep.dir={run_dir / 'sweep'}"]
    return run_main(*args, *dry, *where, engines=None)


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    """Every CLI case, with a store that was there before."""
    d = make_inputs(tmp_path_factory.mktemp("cli_inputs"))
    kept = d / "kept.zarr"
    kept.mkdir()
    (kept / "zarr.json").write_text('{"a store": "that was here before"}')
    before = snapshot(d)
    runs = tmp_path_factory.mktemp("cli_runs")
    jobs = {name: ([a.replace("{d}", str(d)) for a in args], runs / name.replace(":", "_"))
            for name, args, *_ in CLI_CASES}
    done = {name: interp_run(*job) for name, job in jobs.items()}
    return done, before, snapshot(d), runs


@pytest.mark.parametrize("name, key, fragment", [pytest.param(c[0], c[2], c[3], id=c[0]) for c in CLI_CASES])
def test_cli_exits_2_naming_the_key(cli_results, name, key, fragment):
    done, before, after, runs = cli_results
    proc = done[name]
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"config error: {key}: " in proc.stderr, proc.stderr[-3000:]
    reason = proc.stderr.split(f"config error: {key}: ", 1)[1].splitlines()[0]
    assert fragment in reason, reason
    assert "Traceback" not in out, out[-3000:]
    assert not any(line in out for line in ENGINE_LOG), out[-3000:]
    run_dir = runs / name.replace(":", "_")
    assert not list(run_dir.rglob("*.zarr")), list(run_dir.rglob("*"))


def test_cli_leaves_existing_files_as_they_were(cli_results):
    _, before, after, _ = cli_results
    assert after == before
