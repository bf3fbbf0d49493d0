"""Tiny random models of the Phi-3, Gemma 2 and Gemma 3 (text) families: the same bytes on every machine.

Each is its family's real transformers config (Phi-3-mini, Gemma-2-2b, Gemma-3-4b's text model) scaled down to
a few layers of width 128-192, with the SmolLM2 tokenizer. Weights are drawn as ``tiny_random``'s are (raw PCG64
bits, plain IEEE arithmetic, a hand-written safetensors file), in the order of ``tensor_specs``, so
``WEIGHTS_SHA256`` pins them. Norm weights are drawn too (around 1 for Phi-3's ``x * w``, around 0 for Gemma's
``x * (1 + w)``), so a norm applied with the wrong convention shows.

Scaled so that every code path of the family runs in a short prompt:
- Phi-3: fused ``qkv_proj`` / ``gate_up_proj`` weights, multi-head attention with head_dim 96 (Phi-3-mini's).
- Gemma 2: sliding-window layers alternate with global ones and the window (4 tokens) is shorter than the test
  prompts; both soft caps bind (attention 2.0, final 10.0: test logits reach past them);
  ``query_pre_attn_scalar`` (64) is not head_dim (32), so a reader that ignored it would show.
- Gemma 3: q/k norms, three sliding layers (window 4) then a global one, RoPE settings keyed by layer type
  (sliding: theta 10k; global: theta 1M with linear scaling x8, as Gemma-3-4b), no soft caps.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from interp_runner.models.tiny_random import _uniform, write_model_folder

PROBES = ("The Eiffel Tower is located in the city of", "Hello, my name is", "1 2 3 4", "def main():",
          "Once upon a time", "The capital of France is")


@dataclass(frozen=True)
class TinyFamily:
    name: str
    seed: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    init_std: dict
    config: dict = field(default_factory=dict)  # the family's own config.json keys
    fused: bool = False  # Phi-3's fused qkv_proj and gate_up_proj
    gemma: bool = False  # sandwich norms, norms as (1 + w), tied embeddings
    qk_norm: bool = False


PHI3 = TinyFamily(
    "tiny_phi3", seed=3, hidden=192, intermediate=384, layers=4, heads=2, kv_heads=2, head_dim=96,
    init_std={"embed": 1.0, "attn": 0.05, "mlp": 0.05, "head": 0.2, "norm": 0.1}, fused=True,
    config={"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "max_position_embeddings": 4096, "original_max_position_embeddings": 4096,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 1.0},
            "sliding_window": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0,
            "attention_bias": False, "tie_word_embeddings": False},
)
GEMMA2 = TinyFamily(
    "tiny_gemma2", seed=2, hidden=128, intermediate=256, layers=4, heads=4, kv_heads=2, head_dim=32,
    init_std={"embed": 0.2, "q": 0.15, "attn": 0.05, "mlp": 0.05, "norm": 0.1}, gemma=True,
    config={"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_activation": "gelu_pytorch_tanh",
            "hidden_act": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "max_position_embeddings": 8192,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "query_pre_attn_scalar": 64,
            "attn_logit_softcapping": 2.0, "final_logit_softcapping": 10.0, "sliding_window": 4,
            "layer_types": ["sliding_attention", "full_attention"] * 2, "attention_bias": False,
            "attention_dropout": 0.0, "tie_word_embeddings": True},
)
GEMMA3 = TinyFamily(
    "tiny_gemma3", seed=4, hidden=128, intermediate=256, layers=4, heads=4, kv_heads=1, head_dim=32,
    init_std={"embed": 0.2, "q": 0.15, "attn": 0.05, "mlp": 0.05, "norm": 0.1}, gemma=True, qk_norm=True,
    config={"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
            "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
            "query_pre_attn_scalar": 32, "attn_logit_softcapping": None, "final_logit_softcapping": None,
            "sliding_window": 4, "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
            "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": True},
)
FAMILIES = {f.name: f for f in (PHI3, GEMMA2, GEMMA3)}
WEIGHTS_SHA256 = {
    "tiny_phi3": "2c734980590fabcc6ef7d4f1bacdd15838682b9ac85c7e88d5f1f9d65939a715",
    "tiny_gemma2": "5829b416ad211239fd45df523848d87d018e9041cf7dcfd96bf5fcc0a84786fc",
    "tiny_gemma3": "3639e047645631376c3e5b98205246b0a0c2871f8f5249172f0c005263aac18c",
}


def tensor_specs(family: TinyFamily, vocab_size: int) -> Iterator[tuple[str, tuple[int, ...], str]]:
    """(HF state-dict name, shape, kind) of every tensor, in generation order."""
    h, q, kv = family.hidden, family.heads * family.head_dim, family.kv_heads * family.head_dim
    yield "model.embed_tokens.weight", (vocab_size, h), "embed"
    for i in range(family.layers):
        layer = f"model.layers.{i}."
        yield layer + "input_layernorm.weight", (h,), "norm"
        if family.fused:
            yield layer + "self_attn.qkv_proj.weight", (q + 2 * kv, h), "attn"
        else:
            yield layer + "self_attn.q_proj.weight", (q, h), "q"
            yield layer + "self_attn.k_proj.weight", (kv, h), "q"
            yield layer + "self_attn.v_proj.weight", (kv, h), "attn"
        yield layer + "self_attn.o_proj.weight", (h, q), "attn"
        if family.qk_norm:
            yield layer + "self_attn.q_norm.weight", (family.head_dim,), "norm"
            yield layer + "self_attn.k_norm.weight", (family.head_dim,), "norm"
        yield layer + "post_attention_layernorm.weight", (h,), "norm"
        if family.gemma:
            yield layer + "pre_feedforward_layernorm.weight", (h,), "norm"
        if family.fused:
            yield layer + "mlp.gate_up_proj.weight", (2 * family.intermediate, h), "mlp"
        else:
            yield layer + "mlp.gate_proj.weight", (family.intermediate, h), "mlp"
            yield layer + "mlp.up_proj.weight", (family.intermediate, h), "mlp"
        yield layer + "mlp.down_proj.weight", (h, family.intermediate), "mlp"
        if family.gemma:
            yield layer + "post_feedforward_layernorm.weight", (h,), "norm"
    yield "model.norm.weight", (h,), "norm"
    if not family.gemma:
        yield "lm_head.weight", (vocab_size, h), "head"


def weights(family: TinyFamily, vocab_size: int) -> dict[str, np.ndarray]:
    """Every tensor by name (insertion order = generation order)."""
    bits = np.random.default_rng(family.seed).bit_generator
    out = {}
    for name, shape, kind in tensor_specs(family, vocab_size):
        values = _uniform(bits, shape, family.init_std[kind])
        if kind == "norm" and not family.gemma:  # x * w: around 1
            values = values + np.float32(1.0)
        out[name] = values
    return out


def config(family: TinyFamily, vocab_size: int, bos: int, eos: int, pad: int) -> dict:
    """config.json, as transformers and vLLM read it."""
    return {
        **family.config, "dtype": "float32", "vocab_size": vocab_size, "hidden_size": family.hidden,
        "intermediate_size": family.intermediate, "num_hidden_layers": family.layers,
        "num_attention_heads": family.heads, "num_key_value_heads": family.kv_heads, "head_dim": family.head_dim,
        "initializer_range": family.init_std["attn"], "bos_token_id": bos, "eos_token_id": eos,
        "pad_token_id": pad, "use_cache": True,
    }


def write_folder(family: TinyFamily, out: Path, vocab_size: int, bos: int, eos: int, pad: int) -> None:
    write_model_folder(out, weights(family, vocab_size), config(family, vocab_size, bos, eos, pad), bos, eos, pad)
