"""Steering vectors as files other tools read: llama.cpp control vectors (GGUF) and ``.safetensors``.

**What a GGUF control vector's ``direction.N`` means** (ggml-org/llama.cpp, read at the commits named):

- ``common/common.cpp``, ``common_control_vector_load_one`` (17fce9be) reads only the tensors; it refuses any
  name other than ``direction.<int>``, and ``direction.0``, any tensor not F32 or not 1-D, and widths that differ::

      } else if (layer_idx == 0) {
          LOG_ERR("%s: invalid (zero) direction tensor layer index in %s\\n", ...
      float * dst = result.data.data() + result.n_embd * (layer_idx - 1);  // layer 1 at [0]

- ``src/llama-adapter.cpp`` (0650ea8c): ``llama_adapter_cvec::apply`` gives that buffer to layer ``il``::

      for (size_t il = 1; il < hparams.n_layer; il++) {
          const size_t off = n_embd * (il - 1); // buffer doesn't have data for layer 0, since it's never present
          ... ggml_backend_tensor_set(tensors[il], data + off, ...

  and ``apply_to(ctx, cur, il)`` does ``cur = ggml_add(ctx, cur, tensor_for(il))``.
- ``src/models/llama.cpp``, ``llm_build_llama`` (4add2b49), at the end of decoder layer ``il`` (0-based)::

      cur = ggml_add(ctx0, cur, ffn_inp);
      cb(cur, "ffn_out", il);
      cur = build_cvec(cur, il);      // src/llama-graph.cpp: return cvec->apply_to(ctx0, cur, il);
      cb(cur, "l_out", il);

So ``direction.N`` is added, at every position, to the output of 0-based decoder layer N after its MLP residual
add: interp-runner's ``post_block`` at layer N. N runs from 1 to n_layer - 1; layer 0's output has no control
vector. Only ``post_block`` vectors are control vectors.

Writers (the same layout here): repeng (vgel/repeng 0ba7196d, ``repeng/extract.py`` ``ControlVector.export_gguf``)::

    writer = gguf.GGUFWriter(path, "controlvector")
    writer.add_string("controlvector.model_hint", self.model_type)
    writer.add_uint32("controlvector.layer_count", len(self.directions))
    writer.add_tensor(f"direction.{layer}", self.directions[layer])

where ``layer`` indexes ``model.layers`` (repeng adds ``directions[layer]`` to that module's output): llama.cpp's N.
llama.cpp's ``tools/cvector-generator`` (``export_gguf``, 2fb62f8f) writes the same keys (``layer_count`` as i32,
``model_hint`` the model's own ``general.architecture``); its ``mean.hpp``/``pca.hpp`` name the direction read at
``l_out`` of layer il ``direction.%zu`` with ``il+1``, so its files hold at N what it read at layer N - 1.

Files written here: ``general.architecture = "controlvector"``, ``controlvector.model_hint`` (llama.cpp's name of
the model's architecture, ``LLAMA_CPP_ARCH``), ``controlvector.layer_count`` (uint32, the number of directions, as
repeng), one F32 1-D tensor ``direction.N`` of n_embd per layer N >= 1.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from interp_runner.models.architectures import LLAMA_CPP_ARCH

ARCH = "controlvector"
HOOK = "post_block"  # the only hook llama.cpp's control vectors act on (each decoder layer's output)
DIRECTION = re.compile(r"direction\.(\d+)")


class ControlVectorError(ValueError):
    """A file that is not a control vector llama.cpp would load, or directions it could not hold."""


@dataclass(frozen=True)
class ControlVector:
    model_hint: str | None
    directions: dict[int, np.ndarray]  # decoder layer N (0-based; llama.cpp's direction.N) -> float32 [n_embd]


def _exact_float32(vector, what: str) -> np.ndarray:
    vec = np.asarray(vector)
    if not np.issubdtype(vec.dtype, np.floating) or vec.ndim != 1 or not len(vec):
        raise ControlVectorError(f"{what}: a direction is a 1-D float vector, got {vec.dtype} {list(vec.shape)}")
    with np.errstate(over="ignore"):
        out = vec.astype(np.float32)
    if not np.isfinite(out).all() or not np.array_equal(out.astype(vec.dtype), vec):
        raise ControlVectorError(f"{what}: not finite, or not exactly float32 (what a control vector holds)")
    return out


def write_gguf(path: Path, directions: Mapping[int, np.ndarray], model_hint: str) -> None:
    """Write ``directions`` (0-based decoder layer -> vector added to that layer's output) as a control vector."""
    import gguf

    if not directions:
        raise ControlVectorError("no directions to write")
    vectors = {}
    for layer in sorted(directions):
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or layer < 1:
            raise ControlVectorError(f"layer {layer!r}: llama.cpp's control vectors act on the outputs of decoder "
                                     "layers 1 and up (it refuses direction.0)")
        vectors[int(layer)] = _exact_float32(directions[layer], f"layer {layer}")
    if len({v.shape for v in vectors.values()}) != 1:
        raise ControlVectorError(f"directions of different widths: {sorted({len(v) for v in vectors.values()})}")
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        writer = gguf.GGUFWriter(str(partial), ARCH)  # writes general.architecture
        writer.add_string(f"{ARCH}.model_hint", model_hint)
        writer.add_uint32(f"{ARCH}.layer_count", len(vectors))
        for layer, vec in vectors.items():
            writer.add_tensor(f"direction.{layer}", vec)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _string_field(reader, key: str) -> str | None:
    import gguf

    field = reader.get_field(key)
    if field is None or field.types != [gguf.GGUFValueType.STRING]:
        return None
    return field.contents()


def read_gguf(path: Path) -> ControlVector:
    """A control vector file, checked as llama.cpp's loader checks it, plus its ``general.architecture``."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path), "r")
    except Exception as err:  # the reader raises ValueError, struct.error, IndexError... on a file it cannot parse
        raise ControlVectorError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err})") from None
    arch = _string_field(reader, "general.architecture")
    if arch != ARCH:
        raise ControlVectorError(f"{path} is not a control vector: its general.architecture is {arch!r}, "
                                 f"not {ARCH!r} (a model file?)")
    directions: dict[int, np.ndarray] = {}
    for tensor in reader.tensors:
        match = DIRECTION.fullmatch(tensor.name)
        if match is None or int(match[1]) == 0:
            raise ControlVectorError(f"{path}: tensor {tensor.name!r} is not direction.N with N >= 1 (llama.cpp "
                                     "refuses the file)")
        ne = [int(n) for n in tensor.shape]  # GGUF order: ne[0] is the row
        while len(ne) > 1 and ne[-1] == 1:  # ggml_n_dims leaves out trailing dimensions of 1
            ne.pop()
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32 or len(ne) != 1:
            raise ControlVectorError(f"{path}: {tensor.name} is {tensor.tensor_type.name} of shape "
                                     f"{[int(n) for n in tensor.shape]}, not 1-D F32 (llama.cpp refuses the file)")
        directions[int(match[1])] = np.array(tensor.data, dtype=np.float32).reshape(-1)
    if not directions:
        raise ControlVectorError(f"{path} holds no direction tensors")
    if len({v.shape for v in directions.values()}) != 1:
        raise ControlVectorError(f"{path}: its directions differ in width (llama.cpp refuses the file)")
    return ControlVector(_string_field(reader, f"{ARCH}.model_hint"), dict(sorted(directions.items())))


# -- a derived-vectors dataset (the ``steering_vectors`` kind's ``vector``) as files --------------------------


def tensor_name(method: str, hook: str, layer: int) -> str:
    """A vector's name in the exported ``.safetensors``: ``mean_diff.post_block.12`` (0-based decoder layer, as
    in configs: ``{file: vectors.safetensors, key: mean_diff.post_block.12}``)."""
    return f"{method}.{hook}.{layer}"


def _vectors(ds) -> dict[tuple[str, str, int], np.ndarray]:
    """(method, hook, layer) -> vector, for the finite ones not marked ``degenerate`` (where a method found no
    direction the store holds NaN and marks it)."""
    vector = ds["vector"].transpose("method", "vector_hook", "vector_layer", "hidden")
    values = np.asarray(vector.values)
    degenerate = (np.asarray(ds["degenerate"].transpose(*vector.dims[:3]).values, dtype=bool) if "degenerate" in ds
                  else np.zeros(values.shape[:3], dtype=bool))
    out = {}
    for i, method in enumerate(vector["method"].values):
        for j, hook in enumerate(vector["vector_hook"].values):
            for k, layer in enumerate(vector["vector_layer"].values):
                if np.isfinite(values[i, j, k]).all() and not degenerate[i, j, k]:
                    out[(str(method), str(hook), int(layer))] = values[i, j, k].astype(np.float32)
    return out


def model_hint_of(architecture: str) -> str:
    if architecture not in LLAMA_CPP_ARCH:
        raise ControlVectorError(f"no llama.cpp name known for architecture {architecture!r}")
    return LLAMA_CPP_ARCH[architecture]


def gguf_directions(ds, method: str, hook: str = HOOK) -> dict[int, np.ndarray]:
    """The dataset's ``method`` vectors at ``hook`` as llama.cpp directions (layer 0 has none in llama.cpp)."""
    if hook != HOOK:
        raise ControlVectorError(f"hook {hook!r}: llama.cpp adds a control vector to each decoder layer's output, "
                                 f"which is {HOOK!r}; {hook} vectors have no GGUF form")
    return {layer: v for (m, h, layer), v in _vectors(ds).items() if m == method and h == hook and layer >= 1}


def export_vectors(ds, out_dir: Path, stem: str = "vectors", architecture: str | None = None) -> list[Path]:
    """Write ``<stem>.safetensors`` (every finite vector not marked ``degenerate``, named by ``tensor_name``) and,
    where the dataset has ``post_block`` vectors of layers >= 1, one llama.cpp control vector per method,
    ``<stem>.<method>.gguf``.
    ``architecture`` (HF name) defaults to the manifest's ``model.architecture``."""
    from safetensors.numpy import save_file

    architecture = architecture or (ds.attrs.get("model") or {}).get("architecture")
    vectors = _vectors(ds)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if vectors:
        path = out_dir / f"{stem}.safetensors"
        meta = {"names": "method.hook.layer", "layer": "0-based decoder layer", "architecture": str(architecture)}
        save_file({tensor_name(*key): v for key, v in vectors.items()}, str(path), metadata=meta)
        written.append(path)
    methods = dict.fromkeys(m for m, h, _ in vectors if h == HOOK)
    for method in methods:
        directions = gguf_directions(ds, method)
        if directions:
            path = out_dir / f"{stem}.{method}.gguf"
            write_gguf(path, directions, model_hint_of(architecture))
            written.append(path)
    return written
