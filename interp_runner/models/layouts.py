"""Decoder-block layouts: each supported family's block described once, as data; the plugin instruments from it.

A ``BlockLayout`` says, for one family, which vLLM decoder-layer class runs its blocks, how that block carries the
residual stream, which modules (by attribute name on the vLLM layer) are its norms and branches, and where each
hook point (``interp_runner.sites.HOOKS``) sits. ``LAYOUTS`` maps a family name to its layout; ``layout_for`` maps
an HF architecture name (``config.json``'s ``architectures[0]``) to it. Nothing else in the project branches on
the family: the plugin (``plugin/layers.py``) builds each block's instrumented forward from these fields, the
compiler refuses hooks a family lacks (``hook_check``), and ``docs/models.md``'s support table is checked against
them (``tests/test_layouts.py``).

Fields (module names are attributes of the vLLM decoder layer; for every family here HF uses the same names):

- ``architectures``: HF architecture names served by this layout; ``decoder_layer``: (vLLM module, class).
- ``hooks``: the hook points the block has, in block order. A config naming any other hook for this model is
  refused (a ``ConfigError`` naming the key), never approximated.
- ``fused_add_norm``: vLLM's block takes and returns ``(hidden, residual)`` and defers each branch's add into the
  next norm (``norm(hidden, residual)`` returns the normed sum and the sum; CUDA kernels do it in place). The
  stream at a residual hook is then ``hidden + residual``. False: the block returns the stream itself.
- ``parallel_residual``: both branches read the same normed stream and are added together (no ``post_attn``).
- ``pre_attn_norm`` / ``pre_mlp_norm``: the norm each branch reads the stream through (None: the branch reads the
  stream itself).
- ``post_attn_norm`` / ``post_mlp_norm``: "sandwich" norms applied to a branch's output before it is added
  (None: the output is added as it is).
- ``attn`` / ``mlp``: the branch modules; ``router``: the MoE router module inside ``mlp`` (None: dense MLP).
  A layout with a router also has the capture-only hook ``router_logits`` (``capture_hooks``).
- ``router_config``: the config.json keys of (number of experts, experts chosen per token, whether the chosen
  experts' softmax weights are renormalized to sum to 1); read only where ``router`` is set.
- ``embed_scale``: what multiplies the token embedding rows before layer 0 ("sqrt_hidden": sqrt(hidden_size);
  None: nothing). Layer 0's ``pre_attn`` holds the scaled rows; causal-trace noise is scaled from them.
- ``attn_softcap_key`` / ``final_softcap_key``: the config keys of the attention-logit and final-logit soft caps
  (``cap * tanh(x / cap)``) the family applies (None: the family has none).
- ``embed_tensor``: how the checkpoint's token-embedding tensor name ends (causal-trace noise is scaled from its
  rows; GPT-2's learned positions are added after them, so its layer-0 ``pre_attn`` also holds the positions).
- ``inner`` / ``blocks`` / ``final_norm``: where vLLM's model keeps its decoder stack, its blocks and its final
  norm (``model.layers``, ``model.norm`` for Llama; packed cells that skip layers run them one by one);
  ``position_embed``: the stack's learned-position embedding added to the token embedding (GPT-2's ``wpe``);
  ``block_takes_positions``: vLLM calls a block with the positions before the stream (GPT-2's does not).
- ``config_aliases``: (standard key, the family's config.json key) pairs, e.g. GPT-2's ``n_layer``.
- ``config_requires``: (config.json key, value) pairs a model must have for this layout to describe its block
  (e.g. GPT-NeoX's ``use_parallel_residual``); another value is refused.
- ``llama_cpp_arch``: llama.cpp's name for the architecture (its GGUF ``general.architecture``, copied into a
  control vector's ``controlvector.model_hint``).

Hook points, for every layout (``x``: the stream entering block L):

- ``pre_attn``: ``x``, the stream entering the block (layer 0: the scaled token embeddings).
- ``attn_out``: the attention branch's output exactly as it is added to the stream, i.e. after
  ``post_attn_norm`` where the family has one.
- ``post_attn``: the stream after the attention add, ``pre_attn + attn_out``.
- ``mlp_out``: the MLP branch's output as added, after ``post_mlp_norm`` where the family has one.
- ``post_block``: the stream leaving the block, ``post_attn + mlp_out`` = block L+1's ``pre_attn``.

- ``router_logits`` (capture only, layouts with a ``router``): the router's logits, one per expert, for the token
  the MLP reads (``router(pre_mlp_norm(post_attn))``), as the experts are chosen from them: Qwen3-MoE takes the
  softmax over all experts, keeps the top ``num_experts_per_tok`` and renormalizes them where ``norm_topk_prob``.

Residual hooks (``sites.RESIDUAL_HOOKS``) hold a stream value, branch hooks a branch's contribution to it, so
``post_attn = pre_attn + attn_out`` and ``post_block = post_attn + mlp_out`` hold in every family. Any op the
plugin runs at a hook (steer: add; capture: copy; patch: mix; a later per-token probe or SAE encode/decode: read
or replace) sees exactly that value and its result is what the rest of the block reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from interp_runner.sites import HOOKS, ROUTER_LOGITS


@dataclass(frozen=True)
class BlockLayout:
    family: str
    architectures: tuple[str, ...]
    decoder_layer: tuple[str, str]
    llama_cpp_arch: str
    hooks: tuple[str, ...] = HOOKS
    fused_add_norm: bool = True
    parallel_residual: bool = False
    pre_attn_norm: str | None = "input_layernorm"
    pre_mlp_norm: str | None = "post_attention_layernorm"
    post_attn_norm: str | None = None
    post_mlp_norm: str | None = None
    attn: str = "self_attn"
    mlp: str = "mlp"
    router: str | None = None
    router_config: tuple[str, str, str] = ("num_experts", "num_experts_per_tok", "norm_topk_prob")
    embed_scale: str | None = None
    attn_softcap_key: str | None = None
    final_softcap_key: str | None = None
    embed_tensor: str = "embed_tokens.weight"
    inner: str = "model"
    blocks: str = "layers"
    final_norm: str = "norm"
    position_embed: str | None = None
    block_takes_positions: bool = True
    config_aliases: tuple[tuple[str, str], ...] = ()
    config_requires: tuple[tuple[str, object], ...] = ()

    def __post_init__(self):
        unknown = [h for h in self.hooks if h not in HOOKS]
        if unknown or list(self.hooks) != sorted(self.hooks, key=HOOKS.index):
            raise ValueError(f"{self.family}: hooks {self.hooks} are not hooks of sites.HOOKS in their order")
        if self.parallel_residual and "post_attn" in self.hooks:
            raise ValueError(f"{self.family}: a parallel-residual block has no post_attn stream")
        if self.embed_scale not in (None, "sqrt_hidden"):
            raise ValueError(f"{self.family}: unknown embed_scale {self.embed_scale!r}")

    @property
    def sandwich(self) -> bool:
        """Whether a branch's output is normed before it is added (then ``attn_out``/``mlp_out`` are post-norm)."""
        return self.post_attn_norm is not None or self.post_mlp_norm is not None

    @property
    def capture_hooks(self) -> tuple[str, ...]:
        """The hooks a capture entry may name: ``hooks``, and ``router_logits`` where the block has a router."""
        return self.hooks + ((ROUTER_LOGITS,) if self.router is not None else ())


def _pre_norm(family: str, architectures: tuple[str, ...], module: str, cls: str, cpp: str) -> BlockLayout:
    return BlockLayout(family, architectures, (f"vllm.model_executor.models.{module}", cls), cpp)


_SANDWICH = dict(pre_mlp_norm="pre_feedforward_layernorm", post_attn_norm="post_attention_layernorm",
                 post_mlp_norm="post_feedforward_layernorm", embed_scale="sqrt_hidden")

LAYOUTS: dict[str, BlockLayout] = {
    "llama": _pre_norm("llama", ("LlamaForCausalLM",), "llama", "LlamaDecoderLayer", "llama"),
    # convert_hf_to_gguf.py converts MistralForCausalLM as llama
    "mistral": _pre_norm("mistral", ("MistralForCausalLM",), "mistral", "MistralDecoderLayer", "llama"),
    "qwen2": _pre_norm("qwen2", ("Qwen2ForCausalLM",), "qwen2", "Qwen2DecoderLayer", "qwen2"),
    "qwen3": _pre_norm("qwen3", ("Qwen3ForCausalLM",), "qwen3", "Qwen3DecoderLayer", "qwen3"),
    # vLLM runs Phi-3 with Llama's decoder layer (fused qkv_proj / gate_up_proj weights are split on load)
    "phi3": _pre_norm("phi3", ("Phi3ForCausalLM",), "llama", "LlamaDecoderLayer", "phi3"),
    "gemma2": BlockLayout("gemma2", ("Gemma2ForCausalLM",), ("vllm.model_executor.models.gemma2", "Gemma2DecoderLayer"),
                          "gemma2", attn_softcap_key="attn_logit_softcapping",
                          final_softcap_key="final_logit_softcapping", **_SANDWICH),
    "gemma3": BlockLayout("gemma3", ("Gemma3ForCausalLM",), ("vllm.model_executor.models.gemma3", "Gemma3DecoderLayer"),
                          "gemma3", final_softcap_key="final_logit_softcapping", **_SANDWICH),
    # blocks that return the stream itself (no fused add+norm); GPT-2's projections are Conv1D in HF (weights
    # [in, out]) and transposed by vLLM's loader
    "gpt2": BlockLayout("gpt2", ("GPT2LMHeadModel",), ("vllm.model_executor.models.gpt2", "GPT2Block"), "gpt2",
                        fused_add_norm=False, pre_attn_norm="ln_1", pre_mlp_norm="ln_2", attn="attn",
                        embed_tensor="wte.weight", inner="transformer", blocks="h", final_norm="ln_f",
                        position_embed="wpe", block_takes_positions=False,
                        config_aliases=(("num_hidden_layers", "n_layer"), ("hidden_size", "n_embd"),
                                        ("num_attention_heads", "n_head"), ("intermediate_size", "n_inner"),
                                        ("max_position_embeddings", "n_positions"))),
    # Pythia: attention and MLP both read the block input (x + attn(ln1(x)) + mlp(ln2(x))): no post_attn stream
    "gpt_neox": BlockLayout("gpt_neox", ("GPTNeoXForCausalLM",), ("vllm.model_executor.models.gpt_neox",
                            "GPTNeoXLayer"), "gptneox", hooks=("pre_attn", "attn_out", "mlp_out", "post_block"),
                            fused_add_norm=False, parallel_residual=True, attn="attention",
                            embed_tensor="embed_in.weight", inner="gpt_neox", final_norm="final_layer_norm",
                            config_requires=(("use_parallel_residual", True),)),
    # mlp_out: the routed experts' weighted mixture (Qwen3-MoE has no shared expert)
    "qwen3_moe": BlockLayout("qwen3_moe", ("Qwen3MoeForCausalLM",), ("vllm.model_executor.models.qwen3_moe",
                             "Qwen3MoeDecoderLayer"), "qwen3moe", router="gate"),
}

BY_ARCHITECTURE: dict[str, BlockLayout] = {arch: layout for layout in LAYOUTS.values() for arch in layout.architectures}


class UnsupportedArchitecture(ValueError):
    pass


def layout_for(architecture: str) -> BlockLayout:
    """The layout of an HF architecture; an unsupported one is refused, listing the supported ones."""
    layout = BY_ARCHITECTURE.get(architecture)
    if layout is None:
        raise UnsupportedArchitecture(f"unsupported architecture {architecture}; supported: "
                                      f"{', '.join(sorted(BY_ARCHITECTURE))}")
    return layout


def router_families() -> list[str]:
    """The families whose blocks have a router (and so the ``router_logits`` capture site)."""
    return [layout.family for layout in LAYOUTS.values() if layout.router is not None]


def layouts_by_class() -> dict[tuple[str, str], BlockLayout]:
    """Each vLLM decoder-layer class with the one block layout it runs (families sharing a class share it)."""
    out: dict[tuple[str, str], BlockLayout] = {}
    for layout in LAYOUTS.values():
        known = out.setdefault(layout.decoder_layer, layout)
        if _block_fields(known) != _block_fields(layout):
            raise ValueError(f"{layout.family} and {known.family} share {layout.decoder_layer} with different "
                             "block layouts")
    return out


def _block_fields(layout: BlockLayout) -> tuple:
    """What the instrumented forward depends on."""
    return (layout.hooks, layout.fused_add_norm, layout.parallel_residual, layout.pre_attn_norm,
            layout.pre_mlp_norm, layout.post_attn_norm, layout.post_mlp_norm, layout.attn, layout.mlp, layout.router)
