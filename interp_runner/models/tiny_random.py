"""``tiny_random``: a 4-layer random Llama whose weights are the same bytes on every machine.

No library's init code is involved: every tensor is drawn, in a fixed order, from the raw 64-bit output of
numpy's PCG64 (``np.random.default_rng(SEED)``), whose bit stream numpy keeps stable across versions, and mapped
to a uniform float32 by plain IEEE arithmetic. The file is written by hand in the safetensors format (tensors in
that order, little-endian float32), so no writer version changes its bytes either. ``WEIGHTS_SHA256`` pins them
(the same on an AMD EPYC with Python 3.11 and numpy 2.3 and an Intel Xeon with Python 3.12 and numpy 2.5).

Init scales (std of each tensor kind) keep the model useful for tests and stable under rounding. Measured with
HF transformers on the probe prompts (``perturbation_growth``): a 1e-6 relative perturbation of the input
embeddings changes the final logits by at most 1.2x as much (relative), where the former all-0.2 init grew it
12x; fp32 logits differ from fp64 ones by 3e-7 relative (log-probabilities by < 1e-5), against 1.5e-5 (1.4e-4)
before. Prompts still disagree on their first token, with top-1 probabilities over 400x uniform.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

SEED = 0
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 128, 256, 4, 4, 2, 32
# std of each tensor kind: embeddings of unit scale, layers that add a fraction of the stream each, and an
# unembedding large enough that greedy choices are clear (``0.2`` everywhere amplified perturbations 12x)
INIT_STD = {"embed": 1.0, "attn": 0.05, "mlp": 0.05, "head": 0.2}
WEIGHTS_SHA256 = "e444424a991db3f28828bd93d56eacef1f110072841b790ccce63ee3af1ea89e"
MAX_PERTURBATION_GROWTH = 4.0
PROBES = ("The Eiffel Tower is located in the city of", "Hello, my name is", "1 2 3 4", "def main():",
          "Once upon a time", "The capital of France is")


def tensor_specs(vocab_size: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(HF Llama state-dict name, shape, kind) of every tensor, in generation order."""
    yield "model.embed_tokens.weight", (vocab_size, HIDDEN), "embed"
    for i in range(LAYERS):
        layer = f"model.layers.{i}."
        yield layer + "input_layernorm.weight", (HIDDEN,), "norm"
        yield layer + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN), "attn"
        yield layer + "self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), "attn"
        yield layer + "self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), "attn"
        yield layer + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM), "attn"
        yield layer + "post_attention_layernorm.weight", (HIDDEN,), "norm"
        yield layer + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN), "mlp"
        yield layer + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN), "mlp"
        yield layer + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE), "mlp"
    yield "model.norm.weight", (HIDDEN,), "norm"
    yield "lm_head.weight", (vocab_size, HIDDEN), "head"


def _uniform(bits: np.random.BitGenerator, shape: tuple[int, ...], std: float) -> np.ndarray:
    """Uniform on [-a, a) with standard deviation ``std``, from 53 raw bits per value (exact float64 steps)."""
    raw = bits.random_raw(int(np.prod(shape)))
    unit = (raw >> np.uint64(11)).astype(np.float64) * 2.0**-53
    half_width = std * np.sqrt(3.0)
    return ((2.0 * unit - 1.0) * half_width).astype(np.float32).reshape(shape)


def weights(vocab_size: int) -> dict[str, np.ndarray]:
    """Every tensor by name (insertion order = generation order); RMSNorm weights are ones."""
    bits = np.random.default_rng(SEED).bit_generator
    return {name: np.ones(shape, np.float32) if kind == "norm" else _uniform(bits, shape, INIT_STD[kind])
            for name, shape, kind in tensor_specs(vocab_size)}


def write_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """The safetensors format by hand: u64 header length, JSON header (padded with spaces to 8 bytes), data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, array in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for array in tensors.values():
            f.write(np.ascontiguousarray(array, dtype="<f4").tobytes())


def config(vocab_size: int, bos: int, eos: int, pad: int) -> dict:
    """config.json of a LlamaForCausalLM, as transformers and vLLM read it."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "float32",
        "vocab_size": vocab_size, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": INIT_STD["attn"], "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
        "use_cache": True,
    }


def write_model_folder(out: Path, tensors: dict[str, np.ndarray], config_json: dict, bos: int, eos: int,
                       pad: int) -> None:
    """model.safetensors, config.json and generation_config.json of a tiny model (tokenizer files are the
    caller's), the same bytes on every machine."""
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, out / "model.safetensors")
    dump = lambda obj: json.dumps(obj, indent=2, sort_keys=True) + "\n"  # noqa: E731
    (out / "config.json").write_text(dump(config_json))
    (out / "generation_config.json").write_text(dump({"bos_token_id": bos, "eos_token_id": eos,
                                                      "pad_token_id": pad}))


def write_folder(out: Path, vocab_size: int, bos: int, eos: int, pad: int) -> None:
    write_model_folder(out, weights(vocab_size), config(vocab_size, bos, eos, pad), bos, eos, pad)


def perturbation_growth(model, ids_list, relative: float = 1e-6, seed: int = 1) -> float:
    """Largest (relative change of a position's logits) / (relative change of its input embedding) when every
    input embedding is moved by ``relative`` of its norm in a random direction; computed in float64 (``model`` is
    converted to it)."""
    import torch

    model = model.to(torch.float64)
    generator = torch.Generator().manual_seed(seed)
    worst = 0.0
    with torch.no_grad():
        for ids in ids_list:
            embeds = model.get_input_embeddings()(ids)
            step = torch.randn(embeds.shape, generator=generator, dtype=torch.float64)
            step *= relative * embeds.norm(dim=-1, keepdim=True) / step.norm(dim=-1, keepdim=True)
            a, b = model(inputs_embeds=embeds).logits, model(inputs_embeds=embeds + step).logits
            worst = max(worst, ((a - b).norm(dim=-1) / a.norm(dim=-1)).max().item() / relative)
    return worst
