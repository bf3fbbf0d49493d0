"""The block layouts (``interp_runner.models.layouts``) and docs/models.md agree; the layouts are well formed;
unsupported architectures and hooks a family lacks are refused by name before any engine starts.

docs/models.md holds two generated tables, each between ``<!-- NAME -->`` and ``<!-- /NAME -->``: where each hook
sits in each family's block (from the layouts) and the support table (family x hooks x CPU/GPU tests x model
runners, from the layouts and the test files that exist). ``python tests/test_layouts.py`` prints both;
``python tests/test_layouts.py --write`` puts them into docs/models.md.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from conftest import REPO, base_config  # noqa: E402
from interp_runner.config import ConfigError  # noqa: E402
from interp_runner.models import layouts  # noqa: E402
from interp_runner.models.architectures import DECODER_LAYERS  # noqa: E402
from interp_runner.sites import CAPTURE_HOOKS, HOOKS, RESIDUAL_HOOKS  # noqa: E402

DOC = REPO / "docs" / "models.md"


# -- the generated tables ---------------------------------------------------------------------------------


def _code(name: str | None) -> str:
    return f"`{name}`"


def placement_rows(layout: layouts.BlockLayout) -> dict[str, str]:
    """Where each hook sits, in words, from the layout's fields."""
    attn, mlp = _code(layout.attn), _code(layout.mlp)
    attn_norm = f" → {_code(layout.post_attn_norm)}" if layout.post_attn_norm else ""
    mlp_norm = f" → {_code(layout.post_mlp_norm)}" if layout.post_mlp_norm else ""
    router = f" (experts routed by {_code(layout.mlp + '.' + layout.router)})" if layout.router else ""
    embed = " × √hidden" if layout.embed_scale == "sqrt_hidden" else ""
    reads = f"what {_code(layout.pre_mlp_norm)} reads" if layout.pre_mlp_norm else "what the MLP reads"
    rows = {
        "pre_attn": "block input (layer 0: " + ("token embeddings × √hidden)" if embed else
                                               "token + learned position embeddings)" if layout.position_embed
                                               else "the embedding output)"),
        "attn_out": f"{attn}{attn_norm} output, as added",
        "post_attn": f"pre_attn + attn_out ({reads})",
        "mlp_out": f"{mlp}{router}{mlp_norm} output, as added",
        "post_block": ("pre_attn + attn_out + mlp_out" if layout.parallel_residual else "post_attn + mlp_out")
        + " (block output)",
        "router_logits": f"{_code(layout.mlp + '.' + str(layout.router))} logits of what the MLP reads, one per "
        "expert (capture only)",
    }
    return {hook: rows[hook] if hook in layout.capture_hooks else "— (refused)" for hook in CAPTURE_HOOKS}


def placement_table() -> str:
    lines = ["| family | " + " | ".join(CAPTURE_HOOKS) + " |", "|---" * (len(CAPTURE_HOOKS) + 1) + "|"]
    for layout in layouts.LAYOUTS.values():
        lines.append(f"| {layout.family} | " + " | ".join(placement_rows(layout).values()) + " |")
    return "\n".join(lines)


def test_models() -> dict[str, str]:
    """Each built-in model name -> its architecture (config.json of its materialized folder)."""
    from interp_runner.models.materialize import BUILDERS, model_path

    return {name: json.loads((model_path(name) / "config.json").read_text())["architectures"][0]
            for name in BUILDERS}


test_models.__test__ = False  # a helper, not a test


def _mentions(text: str, name: str) -> bool:
    return re.search(rf"[\"']{re.escape(name)}[\"']", text) is not None or (
        name == "tiny_random" and "tiny_engine" in text) or (name == "smollm2_135m" and "smollm2_engine" in text)


def support_rows(models: dict[str, str]) -> list[list[str]]:
    """Per family: its hooks, its test models, the test files that run them on an engine against an HF oracle (GPU:
    ``test_gpu*.py``; CPU: the others), and the model runners the CPU files run them under (V2: a file that also
    runs ``engine.model_runner`` v2)."""
    files = {path.name: path.read_text() for path in sorted(TESTS.glob("test_*.py")) if path.name != Path(__file__).name}
    rows = []
    for layout in layouts.LAYOUTS.values():
        names = [n for n, arch in models.items() if arch in layout.architectures]
        using = {f for f, text in files.items() if any(_mentions(text, n) for n in names)
                 and "pytest.mark.engine" in text and "oracle" in text}
        gpu = sorted(f for f in using if f.startswith("test_gpu"))
        cpu = sorted(using - set(gpu))
        runners = (["V1"] if cpu else []) + (["V2"] if any(re.search(r"MODEL_RUNNERS|model_runner=\"v2\"",
                                                                     files[f]) for f in cpu) else [])
        rows.append([layout.family, ", ".join(layout.architectures),
                     *("✓" if hook in layout.capture_hooks else "—" for hook in CAPTURE_HOOKS),
                     ", ".join(names) or "—", ", ".join(cpu) or "—", ", ".join(gpu) or "—", ", ".join(runners) or "—"])
    return rows


def support_table(models: dict[str, str]) -> str:
    head = ["family", "architectures", *CAPTURE_HOOKS, "test models", "CPU tests (fp32, vs HF)", "GPU tests",
            "CPU runners"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in support_rows(models)]
    return "\n".join(lines)


def tables(models: dict[str, str]) -> dict[str, str]:
    return {"hook-placement": placement_table(), "support-table": support_table(models)}


def region(text: str, name: str) -> str:
    match = re.search(rf"<!-- {name} -->\n(.*?)<!-- /{name} -->", text, re.S)
    assert match, f"docs/models.md has no <!-- {name} --> ... <!-- /{name} --> region"
    return match.group(1).removesuffix("\n")


def test_docs_tables_match_the_layouts_and_the_tests():
    text = DOC.read_text()
    for name, table in tables(test_models()).items():
        assert region(text, name) == table, f"docs/models.md's {name} is stale: run python tests/test_layouts.py --write"


# -- the layouts --------------------------------------------------------------------------------------------


def test_every_layout_names_real_vllm_modules_and_hf_architectures():
    """Each layout's decoder-layer class exists in vLLM and its architectures in vLLM's registry; the layout's
    norms and branches are modules of that layer class (as its __init__ builds them, read from its source)."""
    import importlib
    import inspect

    from vllm.model_executor.models.registry import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    for layout in layouts.LAYOUTS.values():
        module, name = layout.decoder_layer
        cls = getattr(importlib.import_module(module), name)
        source = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("vllm"))
        for attr in (layout.attn, layout.mlp, layout.pre_attn_norm, layout.pre_mlp_norm, layout.post_attn_norm,
                     layout.post_mlp_norm):
            if attr is not None:
                assert f"self.{attr} =" in source, (layout.family, attr)
        assert set(layout.architectures) <= supported, layout.family


def test_a_layout_refuses_hooks_out_of_order_or_unknown():
    with pytest.raises(ValueError, match="not hooks of sites.HOOKS"):
        layouts.BlockLayout("x", ("X",), ("m", "C"), "x", hooks=("attn_out", "pre_attn"))
    with pytest.raises(ValueError, match="not hooks of sites.HOOKS"):
        layouts.BlockLayout("x", ("X",), ("m", "C"), "x", hooks=("pre_attn", "resid_mid"))
    with pytest.raises(ValueError, match="no post_attn stream"):
        layouts.BlockLayout("x", ("X",), ("m", "C"), "x", parallel_residual=True)


def test_sandwich_families_name_their_post_branch_norms():
    for family in ("gemma2", "gemma3"):
        layout = layouts.LAYOUTS[family]
        assert layout.sandwich and layout.embed_scale == "sqrt_hidden"
        assert (layout.post_attn_norm, layout.pre_mlp_norm, layout.post_mlp_norm) == (
            "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    assert layouts.LAYOUTS["gemma2"].final_softcap_key == "final_logit_softcapping"
    assert not layouts.LAYOUTS["phi3"].sandwich
    assert set(HOOKS) >= RESIDUAL_HOOKS


def test_decoder_layers_are_derived_from_the_layouts():
    assert DECODER_LAYERS == {a: lay.decoder_layer for lay in layouts.LAYOUTS.values() for a in lay.architectures}
    assert len(layouts.layouts_by_class()) == len({lay.decoder_layer for lay in layouts.LAYOUTS.values()})


# -- refusals before any engine -----------------------------------------------------------------------------


def test_an_unsupported_architecture_is_refused_listing_the_supported_ones(tmp_path, tiny_path):
    from interp_runner.pipeline import prepare

    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny_path.iterdir():
        (folder / f.name).symlink_to(f)
    (folder / "config.json").unlink()
    config = json.loads((tiny_path / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["FooForCausalLM"]}))
    with pytest.raises(ConfigError) as err:
        prepare({**base_config(), "model": {"name": "foo", "path": str(folder)}})
    key, reason = err.value.problems[0]
    assert key == "model.path" and "unsupported architecture FooForCausalLM" in reason
    for arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "Phi3ForCausalLM"):
        assert arch in reason


def test_a_hook_the_family_lacks_is_refused_naming_every_key(monkeypatch):
    """With a family whose block has no post_attn and no attn_out (as if Llama's had none), each config key naming
    one is refused, before anything is compiled; a causal trace's attn component is refused by its key too."""
    from interp_runner.pipeline import prepare

    lacking = dataclasses.replace(layouts.LAYOUTS["llama"], hooks=("pre_attn", "mlp_out", "post_block"))
    monkeypatch.setitem(layouts.BY_ARCHITECTURE, "LlamaForCausalLM", lacking)
    vec = [0.0] * 128
    config = base_config(
        steering={"global": {"prefill": {"post_attn": {"layer": 1, "vector": vec}}},
                  "request": [{"prompts": [0], "base": {"attn_out": [{"layer": 0, "vector": vec}],
                                                        "post_block": {"layer": 0, "vector": vec}}}]},
        capture=[{"hooks": ["pre_attn", "post_attn"], "layers": "all"}],
        patching=[{"prompts": [1], "source": {"prompt": 0}, "hook": "attn_out", "layers": [1]}])
    with pytest.raises(ConfigError) as err:
        prepare(config)
    keys = [key for key, _ in err.value.problems]
    assert keys == ["steering.global.prefill.post_attn", "steering.request[0].base.attn_out", "capture[0].hooks[1]",
                    "patching[0].hook"]
    assert all("not a hook of llama blocks" in r and "pre_attn, mlp_out, post_block" in r
               for _, r in err.value.problems)
    trace = {"model": {"name": "tiny_random"}, "prompts": {"items": []},
             "causal_trace": {"facts": str(REPO / "experiments" / "causal_trace" / "facts.jsonl"),
                              "components": ["resid", "attn"]}}
    with pytest.raises(ConfigError) as err:
        prepare(trace)
    assert [key for key, _ in err.value.problems] == ["causal_trace.components[1]"]


def test_the_plan_backstop_refuses_sites_of_missing_hooks():
    from interp_runner.models.hook_check import check_plan_hooks
    from interp_runner.sites import site_id

    lacking = dataclasses.replace(layouts.LAYOUTS["llama"], hooks=("pre_attn", "mlp_out", "post_block"))
    check_plan_hooks([site_id(3, "mlp_out"), site_id(0, "pre_attn")], lacking, "model.name")
    with pytest.raises(ConfigError) as err:
        check_plan_hooks([site_id(2, "post_attn"), site_id(0, "pre_attn")], lacking, "model.name")
    assert err.value.problems[0][0] == "model.name" and "'post_attn' is not a hook" in err.value.problems[0][1]


if __name__ == "__main__":
    generated = tables(test_models())
    if sys.argv[1:] == ["--write"]:
        text = DOC.read_text()
        for name, table in generated.items():
            region(text, name)
            text = re.sub(rf"(<!-- {name} -->\n).*?(<!-- /{name} -->)",
                          lambda m: m.group(1) + table + "\n" + m.group(2), text, flags=re.S)
        DOC.write_text(text)
    else:
        for name, table in generated.items():
            print(f"<!-- {name} -->\n{table}\n<!-- /{name} -->\n")
