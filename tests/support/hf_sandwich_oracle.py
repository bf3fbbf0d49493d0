"""An independent reference for any pre-norm family: plain HF transformers with forward hooks.

Written from the hook definitions (docs/models.md), with each family's HF module names read off its HF modeling
code (not from the product's layouts): a hook's value is read and changed where HF computes it.
pre_attn = block input; attn_out = what the attention branch adds to the stream (the output of ``attn_out``'s
module: the attention itself, or Gemma's post-attention norm); post_attn = the input of ``post_attn``'s module
(the norm before the MLP), i.e. pre_attn + attn_out; mlp_out = what the MLP branch adds; post_block = block output.
Steering a stream hook adds to the branch output just before the add (the stream after the add moves by the
vector); patching it mixes the stream by rewriting that branch output.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from support import hf_oracle
@dataclass(frozen=True)
class Points:
    attn_out: str  # module whose output the block adds to the stream after attention
    post_attn: str  # module whose input is the stream after the attention add
    mlp_out: str  # module whose output the block adds after the MLP


# HF modeling code: modeling_llama / modeling_phi3 (h + dropout(attn(norm(h))), dropout off in eval) and
# modeling_gemma2 / modeling_gemma3 (h + post_attention_layernorm(attn(input_layernorm(h))); then
# pre_feedforward_layernorm, mlp, post_feedforward_layernorm)
PRE_NORM = Points("self_attn", "post_attention_layernorm", "mlp")
SANDWICH = Points("post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
POINTS = {"LlamaForCausalLM": PRE_NORM, "Phi3ForCausalLM": PRE_NORM, "Gemma2ForCausalLM": SANDWICH,
          "Gemma3ForCausalLM": SANDWICH}


@lru_cache(maxsize=3)
def load(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def points(model) -> Points:
    return POINTS[model.config.architectures[0]]


def _out(output):
    return output[0] if isinstance(output, tuple) else output


def _replace(output, value):
    return (value,) + tuple(output[1:]) if isinstance(output, tuple) else value


def forward(path, token_ids: list[int], steer: dict | None = None, steer_rows=None):
    """Logits [T, V] and every hook's values {(layer, hook): [T, D]} of one sequence; ``steer`` adds vectors at
    sites (on ``steer_rows`` only, when given)."""
    model = load(str(path))
    at = points(model)
    captured, handles = {}, []
    add, keep = hf_oracle.steer_and_keep(steer, steer_rows, captured)

    for i, layer in enumerate(model.model.layers):
        def pre(module, args, kwargs, i=i):
            h = add((i, "pre_attn"), args[0])
            keep((i, "pre_attn"), h)
            return (h,) + tuple(args[1:]), kwargs

        def branch(out_hook, stream_hook, i=i):
            def hook(module, args, output):
                out = add((i, out_hook), _out(output))
                keep((i, out_hook), out)
                return _replace(output, add((i, stream_hook), out))
            return hook

        handles += [
            layer.register_forward_pre_hook(pre, with_kwargs=True),
            layer.get_submodule(at.attn_out).register_forward_hook(branch("attn_out", "post_attn")),
            layer.get_submodule(at.post_attn).register_forward_pre_hook(
                lambda m, args, i=i: keep((i, "post_attn"), args[0])),
            layer.get_submodule(at.mlp_out).register_forward_hook(branch("mlp_out", "post_block")),
            layer.register_forward_hook(lambda m, args, output, i=i: keep((i, "post_block"), _out(output))),
        ]
    logits = hf_oracle.hooked_logits(model, token_ids, handles)
    return logits.float(), {k: v.float().numpy() for k, v in captured.items()}


def greedy(path, token_ids: list[int], n: int, steer=None):
    """Greedy continuation steered on every token; (tokens, logprobs)."""
    ids, out, logprobs = list(token_ids), [], []
    for _ in range(n):
        logits, _ = forward(path, ids, steer)
        lp = torch.log_softmax(logits[-1], -1)
        out.append(int(lp.argmax()))
        logprobs.append(float(lp[out[-1]]))
        ids.append(out[-1])
    return out, logprobs


def patched_logits(path, token_ids: list[int], patches: dict, source: dict) -> torch.Tensor:
    """Logits [T, V] with ``patches`` {(layer, hook): (positions, alpha)} mixing ``source`` {(layer, hook): [T, D]}
    in: value <- (1 - alpha) * value + alpha * source. Stream hooks are mixed by rewriting the branch output
    before the add (pre_attn: the block input)."""
    model = load(str(path))
    at = points(model)
    stream_in, handles = {}, []

    def mixed(i, hook, value):
        if (i, hook) not in patches:
            return value
        positions, alpha = patches[(i, hook)]
        return hf_oracle.mix(value, positions, torch.as_tensor(source[(i, hook)][positions]), alpha)

    for i, layer in enumerate(model.model.layers):
        def pre(module, args, kwargs, i=i):
            h = mixed(i, "pre_attn", args[0])
            stream_in[i] = h
            return (h,) + tuple(args[1:]), kwargs

        def attn(module, args, output, i=i):
            out = mixed(i, "attn_out", _out(output))
            stream_in[i, "mid"] = stream_in[i] + out
            return _replace(output, mixed(i, "post_attn", stream_in[i] + out) - stream_in[i])

        def mlp(module, args, output, i=i):
            out = mixed(i, "mlp_out", _out(output))
            return _replace(output, mixed(i, "post_block", stream_in[i, "mid"] + out) - stream_in[i, "mid"])

        handles += [layer.register_forward_pre_hook(pre, with_kwargs=True),
                    layer.get_submodule(at.attn_out).register_forward_hook(attn),
                    layer.get_submodule(at.mlp_out).register_forward_hook(mlp)]
    return hf_oracle.hooked_logits(model, token_ids, handles).float()


def traced_logprobs(path, ids: list[int], subject: list[int], noise: np.ndarray, answer: int, cells, window: int):
    """ROME's grid of one fact: log-probabilities of ``answer`` with ``noise`` added to layer 0's input at the
    subject's tokens, and per cell (kind, layer, token) the clean values put back at that token (resid: the block
    output; attn / mlp: the branch output as added, in the ``window`` layers around ``layer``). Returns (per cell,
    corrupted with nothing restored)."""
    model = load(str(path))
    at = points(model)
    layers = model.model.layers
    modules = {"resid": lambda layer: layer, "attn": lambda layer: layer.get_submodule(at.attn_out),
               "mlp": lambda layer: layer.get_submodule(at.mlp_out)}
    clean, handles = {}, []
    for i, layer in enumerate(layers):
        for kind, module in modules.items():
            handles.append(module(layer).register_forward_hook(
                lambda m, a, o, key=(kind, i): clean.__setitem__(key, _out(o).clone())))
    hf_oracle.hooked_logits(model, ids, handles)

    batch = len(cells) + 1  # the last row: corrupted, nothing restored
    noise_t = torch.zeros(batch, len(ids), noise.shape[-1])
    noise_t[:, subject] = torch.as_tensor(noise)
    restore: dict = {}
    for row, (kind, layer, token) in enumerate(cells):
        lo, hi = (layer, layer + 1) if kind == "resid" else (max(0, layer - window // 2),
                                                               min(len(layers), layer + window // 2))
        for lay in range(lo, hi):
            restore.setdefault((kind, lay), []).append((row, token))

    def put_back(key):
        def hook(module, args, output):
            out = _out(output).clone()
            for row, token in restore.get(key, []):
                out[row, token] = clean[key][0, token]
            return _replace(output, out)
        return hook

    handles = [layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: ((args[0] + noise_t,) + tuple(args[1:]), kwargs), with_kwargs=True)]
    for i, layer in enumerate(layers):
        handles += [module(layer).register_forward_hook(put_back((kind, i))) for kind, module in modules.items()]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids]).repeat(batch, 1)).logits[:, -1].double()
    finally:
        for h in handles:
            h.remove()
    lp = torch.log_softmax(logits, -1)[:, answer].numpy()
    return lp[:-1], lp[-1]
