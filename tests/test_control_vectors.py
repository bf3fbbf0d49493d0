"""Vectors in and out: llama.cpp control vectors (GGUF), .safetensors and vectors taken from a ``steering_vectors``
store. The stores here are written with xarray/zarr in that kind's layout, the GGUFs read back with
``gguf.GGUFReader`` and checked against llama.cpp's rules as literals, and the foreign GGUFs written with
``gguf.GGUFWriter`` as repeng's ``export_gguf`` and llama.cpp's ``cvector-generator`` write them. No engine."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import gguf
import numpy as np
import pytest
import xarray as xr
import zarr
from safetensors.numpy import load_file
from zarr.codecs.numcodecs import Delta

from conftest import base_config
from interp_runner.config import ConfigError
from interp_runner.vectors.control import ControlVectorError, export_vectors, gguf_directions, write_gguf
from interp_runner.pipeline import prepare

HIDDEN = 128  # tiny_random: a LlamaForCausalLM of 4 layers
LAYERS = [0, 1, 2, 3]
METHODS = ["mean_diff", "pca"]
POST_BLOCK_SITE = 4  # site id = layer * 5 + hook index; post_block is the 5th hook (interp_runner/sites.py)


def stored_vectors(hooks=("post_block", "mlp_out"), hidden=HIDDEN) -> np.ndarray:
    """[method, hook, layer, hidden] float32 values whose low bits matter (no round numbers)."""
    rng = np.random.default_rng(7)
    return (rng.standard_normal((len(METHODS), len(hooks), len(LAYERS), hidden)) / 3).astype(np.float32)


def write_store(path: Path, values: np.ndarray | None = None, hooks=("post_block", "mlp_out"), status="complete",
                encoding: dict | None = None, degenerate: np.ndarray | None = None, **attrs) -> np.ndarray:
    """A store in the ``steering_vectors`` layout, written with xarray (zarr v3, as the runner writes stores);
    ``degenerate`` (method, hook, layer) flags vectors as no direction."""
    values = stored_vectors(hooks) if values is None else values
    flags = {} if degenerate is None else {"degenerate": (("method", "vector_hook", "vector_layer"), degenerate)}
    ds = xr.Dataset(
        {"vector": (("method", "vector_hook", "vector_layer", "hidden"), values), **flags},
        coords={"method": np.array(METHODS, dtype=np.dtypes.StringDType()),
                "vector_hook": np.array(hooks, dtype=np.dtypes.StringDType()),
                "vector_layer": np.array(LAYERS, dtype=np.int32)},
        attrs={"status": status, "model": {"architecture": "LlamaForCausalLM", "hidden_size": values.shape[-1],
                                           "num_layers": 4}, **attrs},
    )
    ds.to_zarr(str(path), zarr_format=3, consolidated=False, encoding=encoding)
    return values


def plan_of(spec, base: Path, layer: int = 2):
    """The compiled plan of a run steering post_block at ``layer`` with ``spec`` declared as vector ``v``."""
    config = base_config(vectors={"v": spec},
                         steering={"global": {"base": {"post_block": {"layer": layer, "vector": "v"}}}})
    return prepare(config, base=base).plan


def loaded(spec, base: Path, layer: int = 2) -> np.ndarray:
    plan = plan_of(spec, base, layer)
    (vector,) = plan.vectors.values()
    sites = {term.site for r in plan.requests for term in r.payload.steer}
    assert sites == {layer * 5 + POST_BLOCK_SITE}
    return vector


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float32 and a.tobytes() == b.tobytes()


# -- export, and what llama.cpp reads ---------------------------------------------------------------------


def test_exported_gguf_is_what_llama_cpp_loads(tmp_path):
    values = write_store(tmp_path / "sv.zarr")
    written = export_vectors(xr.open_zarr(tmp_path / "sv.zarr", consolidated=False), tmp_path / "out")
    assert sorted(p.name for p in written) == ["vectors.mean_diff.gguf", "vectors.pca.gguf", "vectors.safetensors"]
    for m, method in enumerate(METHODS):
        path = tmp_path / "out" / f"vectors.{method}.gguf"
        raw = path.read_bytes()
        assert raw[:4] == b"GGUF" and int.from_bytes(raw[4:8], "little") == 3  # magic, version 3 (little-endian)
        reader = gguf.GGUFReader(str(path))
        fields = {name: f for name, f in reader.fields.items() if not name.startswith("GGUF.")}
        assert sorted(fields) == ["controlvector.layer_count", "controlvector.model_hint", "general.architecture"]
        assert fields["general.architecture"].types == [gguf.GGUFValueType.STRING]
        assert fields["general.architecture"].contents() == "controlvector"
        assert fields["controlvector.model_hint"].contents() == "llama"
        assert fields["controlvector.layer_count"].types == [gguf.GGUFValueType.UINT32]
        assert fields["controlvector.layer_count"].contents() == 3
        # llama.cpp has no direction.0 (layer 0's output is never steered): layers 1..3, 1-D F32 of n_embd
        assert [t.name for t in reader.tensors] == ["direction.1", "direction.2", "direction.3"]
        for t, layer in zip(reader.tensors, [1, 2, 3]):
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            assert [int(n) for n in t.shape] == [HIDDEN] and t.n_elements == HIDDEN
            assert same_bits(np.asarray(t.data), values[m, 0, layer])  # hook 0 is post_block
    tensors = load_file(str(tmp_path / "out" / "vectors.safetensors"))
    assert len(tensors) == len(METHODS) * 2 * len(LAYERS)
    assert same_bits(tensors["pca.mlp_out.3"], values[1, 1, 3])
    assert same_bits(tensors["mean_diff.post_block.0"], values[0, 0, 0])


def test_export_then_import_is_exact(tmp_path):
    values = write_store(tmp_path / "sv.zarr")
    export_vectors(xr.open_zarr(tmp_path / "sv.zarr", consolidated=False), tmp_path / "out")
    expected = values[1, 0, 2]  # pca, post_block, layer 2
    assert same_bits(loaded({"file": "out/vectors.pca.gguf", "layer": 2}, tmp_path), expected)
    assert same_bits(loaded({"file": "out/vectors.safetensors", "key": "pca.post_block.2"}, tmp_path), expected)
    assert same_bits(loaded({"store": "sv.zarr", "hook": "post_block", "layer": 2, "method": "pca"}, tmp_path),
                     expected)


def test_store_vector_by_name_defaults_to_mean_diff(tmp_path):
    values = write_store(tmp_path / "sv.zarr")
    assert same_bits(loaded({"store": str(tmp_path / "sv.zarr"), "hook": "mlp_out", "layer": 1}, tmp_path),
                     values[0, 1, 1])
    # inline in a steering term, not only under ``vectors:``
    config = base_config(steering={"global": {"base": {"post_block": {
        "layer": 3, "vector": {"store": "sv.zarr", "hook": "post_block", "layer": 3}}}}})
    (vector,) = prepare(config, base=tmp_path).plan.vectors.values()
    assert same_bits(vector, values[0, 0, 3])


@pytest.mark.parametrize("layer_count", ["uint32", "int32"])  # repeng's export_gguf, llama.cpp's cvector-generator
def test_foreign_control_vector_loads_at_its_layer(tmp_path, layer_count):
    rng = np.random.default_rng(3)
    directions = {layer: rng.standard_normal(HIDDEN).astype(np.float32) for layer in (1, 2, 3)}
    arch = "controlvector"  # as repeng/extract.py ControlVector.export_gguf writes it
    writer = gguf.GGUFWriter(str(tmp_path / "cv.gguf"), arch)
    writer.add_string(f"{arch}.model_hint", "llama")
    getattr(writer, f"add_{layer_count}")(f"{arch}.layer_count", len(directions))
    for layer in directions.keys():
        writer.add_tensor(f"direction.{layer}", directions[layer])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for layer in (1, 2, 3):  # direction.N is what llama.cpp adds to decoder layer N's output: post_block N
        assert same_bits(loaded({"file": "cv.gguf", "layer": layer}, tmp_path, layer=layer), directions[layer])


def degenerate_at(method: int, hook: int, layer: int) -> np.ndarray:
    flags = np.zeros((len(METHODS), 2, len(LAYERS)), bool)
    flags[method, hook, layer] = True
    return flags


def test_degenerate_vectors_are_never_exported(tmp_path):
    """A vector flagged degenerate is left out of the safetensors and its method's GGUF, even with finite values."""
    values = write_store(tmp_path / "sv.zarr", degenerate=degenerate_at(1, 0, 2))  # pca, post_block, layer 2
    export_vectors(xr.open_zarr(tmp_path / "sv.zarr", consolidated=False), tmp_path / "out")
    tensors = load_file(str(tmp_path / "out" / "vectors.safetensors"))
    assert len(tensors) == len(METHODS) * 2 * len(LAYERS) - 1 and "pca.post_block.2" not in tensors
    assert same_bits(tensors["pca.post_block.3"], values[1, 0, 3])
    pca = gguf.GGUFReader(str(tmp_path / "out" / "vectors.pca.gguf"))
    assert [t.name for t in pca.tensors] == ["direction.1", "direction.3"]
    assert pca.get_field("controlvector.layer_count").contents() == 2
    mean = gguf.GGUFReader(str(tmp_path / "out" / "vectors.mean_diff.gguf"))
    assert [t.name for t in mean.tensors] == ["direction.1", "direction.2", "direction.3"]


def test_only_post_block_vectors_become_control_vectors(tmp_path):
    write_store(tmp_path / "sv.zarr", hooks=("mlp_out",), values=stored_vectors(("mlp_out",)))
    ds = xr.open_zarr(tmp_path / "sv.zarr", consolidated=False)
    with pytest.raises(ControlVectorError, match="'mlp_out'.*post_block"):
        gguf_directions(ds, "mean_diff", hook="mlp_out")
    assert [p.name for p in export_vectors(ds, tmp_path / "out")] == ["vectors.safetensors"]
    with pytest.raises(ControlVectorError, match="refuses direction.0"):
        write_gguf(tmp_path / "zero.gguf", {0: np.ones(4, np.float32)}, "llama")
    with pytest.raises(ControlVectorError, match="exactly float32"):
        write_gguf(tmp_path / "f64.gguf", {1: np.full(4, 0.1)}, "llama")
    assert not (tmp_path / "zero.gguf").exists() and not (tmp_path / "f64.gguf").exists()


def test_every_supported_architecture_has_a_llama_cpp_name():
    from interp_runner.models.architectures import DECODER_LAYERS, LLAMA_CPP_ARCH

    assert set(LLAMA_CPP_ARCH) == set(DECODER_LAYERS)
    assert set(LLAMA_CPP_ARCH.values()) <= set(gguf.MODEL_ARCH_NAMES.values())


# -- bad inputs: refused through the config path, the key named -------------------------------------------


def write_gguf_raw(path: Path, arch: str = "controlvector", tensors: dict | None = None) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    if arch == "controlvector":
        writer.add_string("controlvector.model_hint", "llama")
    for name, data in (tensors or {"direction.1": np.ones(HIDDEN, np.float32)}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


class Unpickled:
    """Makes a folder if anything ever unpickles it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def make_inputs(d: Path) -> None:
    write_gguf_raw(d / "model.gguf", arch="llama")
    (d / "text.gguf").write_text("general.architecture = controlvector\n")
    write_gguf_raw(d / "cv.gguf", tensors={f"direction.{n}": np.ones(HIDDEN, np.float32) for n in (1, 2, 3)})
    write_gguf_raw(d / "narrow.gguf", tensors={"direction.1": np.ones(64, np.float32)})
    write_gguf_raw(d / "zero.gguf", tensors={"direction.0": np.ones(HIDDEN, np.float32)})
    write_gguf_raw(d / "f16.gguf", tensors={"direction.1": np.ones(HIDDEN, np.float16)})
    write_gguf_raw(d / "named.gguf", tensors={"blk.1.direction": np.ones(HIDDEN, np.float32)})
    write_store(d / "sv.zarr")
    write_store(d / "running.zarr", status="running")
    write_store(d / "failed.zarr", status="failed")
    write_store(d / "traced.zarr", kind="causal_trace")
    write_store(d / "narrow.zarr", values=stored_vectors(hidden=64))
    nan = stored_vectors()
    nan[1, 0, 2] = np.nan  # pca found no direction at post_block layer 2
    write_store(d / "nan.zarr", values=nan)
    write_store(d / "degenerate.zarr", degenerate=degenerate_at(1, 0, 2))  # finite values, flagged no direction
    write_store(d / "short.zarr")  # then its vector array holds 2 layers where its coordinates name 4
    group = zarr.open_group(str(d / "short.zarr"), mode="r+", zarr_format=3)
    del group["vector"]
    short = group.create_array("vector", shape=(2, 2, 2, HIDDEN), dtype="float32",
                               dimension_names=["method", "vector_hook", "vector_layer", "hidden"])
    short[...] = stored_vectors()[:, :, :2]
    xr.Dataset({"tokens": (("request", "slot"), np.zeros((2, 3), np.int32))},
               attrs={"status": "complete"}).to_zarr(str(d / "other.zarr"), zarr_format=3, consolidated=False)
    # codecs beyond plain bytes, compression and strings are not read (a delta filter stands for any such)
    write_store(d / "delta.zarr", encoding={"vector": {"filters": [Delta(dtype="<f4")]}})
    # a zarr v2 store with a pickled object array, which zarr 2 unpickles on reading
    v2 = d / "pickled.zarr"
    (v2 / "vector").mkdir(parents=True)
    (v2 / ".zgroup").write_text(json.dumps({"zarr_format": 2}))
    (v2 / ".zattrs").write_text(json.dumps({"status": "complete"}))
    (v2 / "vector" / ".zarray").write_text(json.dumps({
        "zarr_format": 2, "shape": [1], "chunks": [1], "dtype": "|O", "compressor": None, "fill_value": None,
        "order": "C", "filters": [{"id": "pickle"}]}))
    (v2 / "vector" / "0").write_bytes(pickle.dumps(np.array([Unpickled(d / "ran")], dtype=object)))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("control_vector_inputs")
    make_inputs(d)
    return d


V = "vectors.v"
STORE = {"store": "sv.zarr", "hook": "post_block", "layer": 2}
CASES = [
    ("gguf-of-a-model", {"file": "model.gguf", "layer": 1}, V + ".file", "not a control vector"),
    ("gguf-not-gguf", {"file": "text.gguf", "layer": 1}, V + ".file", "not a readable GGUF"),
    ("gguf-missing", {"file": "nowhere.gguf", "layer": 1}, V + ".file", "not found"),
    ("gguf-layer-it-lacks", {"file": "cv.gguf", "layer": 3 + 2}, V + ".layer", "has layers [1, 2, 3]"),
    ("gguf-layer-0", {"file": "cv.gguf", "layer": 0}, V + ".layer", "no direction for layer 0"),
    ("gguf-width", {"file": "narrow.gguf", "layer": 1}, V, "hidden size is 128"),
    ("gguf-direction-0", {"file": "zero.gguf", "layer": 1}, V + ".file", "N >= 1"),
    ("gguf-f16", {"file": "f16.gguf", "layer": 1}, V + ".file", "not 1-D F32"),
    ("gguf-tensor-name", {"file": "named.gguf", "layer": 1}, V + ".file", "'blk.1.direction'"),
    ("gguf-without-layer", {"file": "cv.gguf"}, V, "with 'layer'"),
    ("gguf-shorthand-without-layer", "cv.gguf", V, "with 'layer'"),
    ("gguf-with-key", {"file": "cv.gguf", "layer": 1, "key": "direction.1"}, V, "'key' only applies"),
    ("store-running", {**STORE, "store": "running.zarr"}, V + ".store", "not complete (status 'running')"),
    ("store-failed", {**STORE, "store": "failed.zarr"}, V + ".store", "not complete (status 'failed')"),
    ("store-of-another-kind", {**STORE, "store": "traced.zarr"}, V + ".store", "'causal_trace' store"),
    ("store-without-vector", {**STORE, "store": "other.zarr"}, V + ".store", "no 'vector' array"),
    ("store-missing", {**STORE, "store": "nowhere.zarr"}, V + ".store", "not found"),
    ("store-is-a-file", {**STORE, "store": "cv.gguf"}, V + ".store", "not a store folder"),
    ("store-zarr-v2-pickle", {**STORE, "store": "pickled.zarr"}, V + ".store", "not a zarr v3 store"),
    ("store-unlisted-codec", {**STORE, "store": "delta.zarr"}, V + ".store", "uses codecs ['numcodecs.delta']"),
    ("store-method-it-lacks", {**STORE, "method": "ica"}, V + ".method", "['mean_diff', 'pca']"),
    ("store-hook-it-lacks", {**STORE, "hook": "attn_out"}, V + ".hook", "['post_block', 'mlp_out']"),
    ("store-layer-it-lacks", {**STORE, "layer": 7}, V + ".layer", "[0, 1, 2, 3]"),
    ("store-width", {**STORE, "store": "narrow.zarr"}, V, "hidden size is 128"),
    ("store-no-direction", {**STORE, "store": "nan.zarr", "method": "pca"}, V, "no pca vector"),
    ("store-degenerate", {**STORE, "store": "degenerate.zarr", "method": "pca"}, V, "is degenerate"),
    ("store-vector-fewer-layers", {**STORE, "store": "short.zarr", "layer": 3}, V + ".store",
     "has shape [2, 2, 2, 128], but its coordinates name [2, 2, 4]"),
    ("store-without-hook", {"store": "sv.zarr", "layer": 2}, V, "needs 'hook' and 'layer'"),
    ("store-bad-hook", {**STORE, "hook": "resid"}, V + ".hook", "Input should be"),
    ("store-and-file", {**STORE, "file": "cv.gguf"}, V, "exactly one of"),
    ("hook-without-store", {"file": "v.npy", "hook": "post_block"}, V, "only apply to a 'store'"),
    ("layer-with-npy", {"file": "v.npy", "layer": 1}, V, "'layer' only applies"),
    ("layer-negative", {**STORE, "layer": -1}, V + ".layer", "greater than or equal to 0"),
]


@pytest.mark.parametrize("spec, key, fragment", [pytest.param(*c[1:], id=c[0]) for c in CASES])
def test_refused_naming_the_key(inputs, spec, key, fragment):
    with pytest.raises(ConfigError) as err:
        plan_of(spec, inputs)
    found = dict(err.value.problems)
    assert key in found, f"expected {key!r} named, got {found}"
    assert fragment in found[key], f"{key}: {found[key]!r} does not say {fragment!r}"
    assert not (inputs / "ran").exists()  # nothing in a store was ever unpickled


def test_refused_inline_in_a_steering_term(inputs):
    config = base_config(steering={"global": {"base": {"post_block": {
        "layer": 1, "vector": {**STORE, "store": "running.zarr"}}}}})
    with pytest.raises(ConfigError) as err:
        prepare(config, base=inputs)
    assert "not complete" in dict(err.value.problems)["steering.global.base.post_block.vector.store"]
