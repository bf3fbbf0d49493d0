"""Tiny random models of GPT-2, GPT-NeoX (Pythia) and Qwen3-MoE: the same bytes on every machine.

Each is its family's real config scaled down (4 layers, hidden 128, head_dim 32: a CPU attention size), written
as its hub checkpoints name it (GPT-2's Conv1D weights ``[in, out]`` and tied unembedding, Pythia's parallel
residual and 25% rotary dims, Qwen3-MoE's experts one by one with ``num_experts`` as its config.json spells it),
so HF transformers and vLLM load it as they load the real models. Tensors are drawn as ``tiny_random``'s are (raw
PCG64 bits, plain IEEE arithmetic, a hand-written safetensors file) in the order the family's specs list them;
``WEIGHTS_SHA256`` pins each family's bytes. LayerNorm weights are ones and their biases zeros.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from interp_runner.models.tiny_random import _uniform, write_model_folder

SEED = 0
HIDDEN, LAYERS, HEADS, HEAD_DIM = 128, 4, 4, 32
EXPERTS, TOP_K, EXPERT_INTERMEDIATE = 8, 2, 64
# std of each tensor kind (``tiny_random``'s scales); ``tied``: an embedding that is also the unembedding (at unit
# scale every top-1 probability is 1), ``pos``: GPT-2's learned positions, ``bias``: linear biases
INIT_STD = {"embed": 1.0, "tied": 0.2, "pos": 0.1, "attn": 0.05, "mlp": 0.05, "head": 0.2, "bias": 0.02,
            "router": 0.5}
Spec = Iterator[tuple[str, tuple[int, ...], str]]


def _gpt2(vocab: int) -> Spec:
    yield "transformer.wte.weight", (vocab, HIDDEN), "tied"
    yield "transformer.wpe.weight", (2048, HIDDEN), "pos"
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        yield p + "ln_1.weight", (HIDDEN,), "norm"
        yield p + "ln_1.bias", (HIDDEN,), "zero"
        yield p + "attn.c_attn.weight", (HIDDEN, 3 * HIDDEN), "attn"  # Conv1D: [in, out]
        yield p + "attn.c_attn.bias", (3 * HIDDEN,), "bias"
        yield p + "attn.c_proj.weight", (HIDDEN, HIDDEN), "attn"
        yield p + "attn.c_proj.bias", (HIDDEN,), "bias"
        yield p + "ln_2.weight", (HIDDEN,), "norm"
        yield p + "ln_2.bias", (HIDDEN,), "zero"
        yield p + "mlp.c_fc.weight", (HIDDEN, 4 * HIDDEN), "mlp"
        yield p + "mlp.c_fc.bias", (4 * HIDDEN,), "bias"
        yield p + "mlp.c_proj.weight", (4 * HIDDEN, HIDDEN), "mlp"
        yield p + "mlp.c_proj.bias", (HIDDEN,), "bias"
    yield "transformer.ln_f.weight", (HIDDEN,), "norm"
    yield "transformer.ln_f.bias", (HIDDEN,), "zero"
    # the unembedding is the token embedding (tie_word_embeddings), as in GPT-2's own checkpoints


def _pythia(vocab: int) -> Spec:
    yield "gpt_neox.embed_in.weight", (vocab, HIDDEN), "embed"
    for i in range(LAYERS):
        p = f"gpt_neox.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield p + norm + ".weight", (HIDDEN,), "norm"
            yield p + norm + ".bias", (HIDDEN,), "zero"
        yield p + "attention.query_key_value.weight", (3 * HIDDEN, HIDDEN), "attn"
        yield p + "attention.query_key_value.bias", (3 * HIDDEN,), "bias"
        yield p + "attention.dense.weight", (HIDDEN, HIDDEN), "attn"
        yield p + "attention.dense.bias", (HIDDEN,), "bias"
        yield p + "mlp.dense_h_to_4h.weight", (4 * HIDDEN, HIDDEN), "mlp"
        yield p + "mlp.dense_h_to_4h.bias", (4 * HIDDEN,), "bias"
        yield p + "mlp.dense_4h_to_h.weight", (HIDDEN, 4 * HIDDEN), "mlp"
        yield p + "mlp.dense_4h_to_h.bias", (HIDDEN,), "bias"
    yield "gpt_neox.final_layer_norm.weight", (HIDDEN,), "norm"
    yield "gpt_neox.final_layer_norm.bias", (HIDDEN,), "zero"
    yield "embed_out.weight", (vocab, HIDDEN), "head"


def _qwen3_moe(vocab: int) -> Spec:
    kv_heads = 2
    yield "model.embed_tokens.weight", (vocab, HIDDEN), "embed"
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (HIDDEN,), "norm"
        yield p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN), "attn"
        yield p + "self_attn.k_proj.weight", (kv_heads * HEAD_DIM, HIDDEN), "attn"
        yield p + "self_attn.v_proj.weight", (kv_heads * HEAD_DIM, HIDDEN), "attn"
        yield p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM), "attn"
        yield p + "self_attn.q_norm.weight", (HEAD_DIM,), "norm"
        yield p + "self_attn.k_norm.weight", (HEAD_DIM,), "norm"
        yield p + "post_attention_layernorm.weight", (HIDDEN,), "norm"
        yield p + "mlp.gate.weight", (EXPERTS, HIDDEN), "router"
        for e in range(EXPERTS):
            x = f"{p}mlp.experts.{e}."
            yield x + "gate_proj.weight", (EXPERT_INTERMEDIATE, HIDDEN), "mlp"
            yield x + "up_proj.weight", (EXPERT_INTERMEDIATE, HIDDEN), "mlp"
            yield x + "down_proj.weight", (HIDDEN, EXPERT_INTERMEDIATE), "mlp"
    yield "model.norm.weight", (HIDDEN,), "norm"
    yield "lm_head.weight", (vocab, HIDDEN), "head"


GPT2_CONFIG = {
    "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_positions": 2048, "n_embd": HIDDEN,
    "n_layer": LAYERS, "n_head": HEADS, "n_inner": None, "activation_function": "gelu_new",
    "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
    "add_cross_attention": False, "tie_word_embeddings": True,
}
PYTHIA_CONFIG = {
    "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "intermediate_size": 4 * HIDDEN,
    "hidden_act": "gelu", "max_position_embeddings": 2048, "layer_norm_eps": 1e-5, "use_parallel_residual": True,
    "attention_bias": True, "rotary_pct": 0.25, "rotary_emb_base": 10000,
    "rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
    "attention_dropout": 0.0, "hidden_dropout": 0.0, "tie_word_embeddings": False,
}
QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": HIDDEN,
    "intermediate_size": 4 * HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
    "num_key_value_heads": 2, "head_dim": HEAD_DIM, "hidden_act": "silu", "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6, "attention_bias": False, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "use_sliding_window": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "moe_intermediate_size": EXPERT_INTERMEDIATE, "num_experts": EXPERTS, "num_experts_per_tok": TOP_K,
    "norm_topk_prob": True, "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class TinyFamily:
    name: str
    specs: Callable[[int], Spec]  # vocab size -> (hub checkpoint name, shape, kind) in generation order
    config: dict  # the family's own config.json keys


GPT2 = TinyFamily("tiny_gpt2", _gpt2, GPT2_CONFIG)
PYTHIA = TinyFamily("tiny_pythia", _pythia, PYTHIA_CONFIG)
QWEN3_MOE = TinyFamily("tiny_qwen3_moe", _qwen3_moe, QWEN3_MOE_CONFIG)
FAMILIES = {f.name: f for f in (GPT2, PYTHIA, QWEN3_MOE)}
WEIGHTS_SHA256 = {
    "tiny_gpt2": "0ac8b255295d8c11b9e4304ef8e528151faa2aa5ccea82d91549cde729797408",
    "tiny_pythia": "2494524f2db1f4732b64d64ddbcef2cbdfbc4761cf292176836dbc932270d52a",
    "tiny_qwen3_moe": "f5fbe982cd6438e42d654e11abb3ff94288e0434e9f29c64bf9a8e5c13238765",
}


def weights(family: TinyFamily, vocab_size: int) -> dict[str, np.ndarray]:
    """Every tensor by name (insertion order = generation order)."""
    bits = np.random.default_rng(SEED).bit_generator
    fixed = {"norm": np.ones, "zero": np.zeros}
    return {t: fixed[kind](shape, np.float32) if kind in fixed else _uniform(bits, shape, INIT_STD[kind])
            for t, shape, kind in family.specs(vocab_size)}


def config(family: TinyFamily, vocab_size: int, bos: int, eos: int, pad: int) -> dict:
    """config.json, as transformers and vLLM read it."""
    return {**family.config, "dtype": "float32", "vocab_size": vocab_size, "use_cache": True,
            "initializer_range": INIT_STD["attn"], "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}


def write_folder(family: TinyFamily, out: Path, vocab_size: int, bos: int, eos: int, pad: int) -> None:
    write_model_folder(out, weights(family, vocab_size), config(family, vocab_size, bos, eos, pad), bos, eos, pad)
