"""An independent reference: plain HF transformers with forward hooks, written from the hook-point definitions.

Hook points of decoder layer L (HF Llama: h = h + attn(norm1(h)); h = h + mlp(norm2(h))):
pre_attn = layer input; attn_out = self_attn output; post_attn = input of post_attention_layernorm;
mlp_out = mlp output; post_block = layer output. Steering adds a vector to the stream (or sub-layer output).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM


@lru_cache(maxsize=2)
def load(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _add(vec):
    def hook(module, args, output):
        if isinstance(output, tuple):
            return (output[0] + vec,) + tuple(output[1:])
        return output + vec

    return hook


def steer_and_keep(steer: dict | None, steer_rows, captured: dict):
    """The two things a family oracle's hooks do: ``add(key, value)`` adds ``steer[key]`` to a hooked value (on
    ``steer_rows`` only, when given), ``keep(key, value)`` records the value of the batch's one sequence."""
    steer = steer or {}

    def add(key, value):
        if key not in steer:
            return value
        v = torch.zeros_like(value)
        v[:, slice(None) if steer_rows is None else steer_rows] = torch.as_tensor(steer[key], dtype=value.dtype)
        return value + v

    def keep(key, value):
        captured[key] = value[0].detach().clone()

    return add, keep


def hooked_logits(model: torch.nn.Module, token_ids: list[int], handles: list) -> torch.Tensor:
    """The model's logits over ``token_ids`` with its hooks ``handles`` in place; the hooks are removed after."""
    try:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0]
    finally:
        for h in handles:
            h.remove()


def forward(
    path: Path,
    token_ids: list[int],
    steer: dict[tuple[int, str], np.ndarray] | None = None,
    steer_rows: slice | np.ndarray | None = None,
):
    """Logits [T, V] and every hook's activations {(layer, hook): [T, D]} for one sequence.

    ``steer`` adds vectors at sites; ``steer_rows`` restricts the addition to some token rows (all by default).
    """
    model = load(str(path))
    layers = model.model.layers
    captured: dict[tuple[int, str], torch.Tensor] = {}
    handles = []

    def vector(key, like):
        v = torch.zeros_like(like)
        rows = slice(None) if steer_rows is None else steer_rows
        v[:, rows] = torch.as_tensor(steer[key], dtype=like.dtype)
        return v

    def keep(key, value):
        captured[key] = value[0].detach().clone()

    for i, layer in enumerate(layers):
        def pre_attn(module, args, kwargs, i=i):
            h = args[0]
            if steer and (i, "pre_attn") in steer:
                h = h + vector((i, "pre_attn"), h)
            keep((i, "pre_attn"), h)
            return (h,) + tuple(args[1:]), kwargs

        def attn(module, args, output, i=i):
            out = output[0]
            if steer and (i, "attn_out") in steer:
                out = out + vector((i, "attn_out"), out)
            keep((i, "attn_out"), out)
            if steer and (i, "post_attn") in steer:  # the stream after the add = residual + this output
                out = out + vector((i, "post_attn"), out)
            return (out,) + tuple(output[1:])

        def post_attn(module, args, i=i):
            keep((i, "post_attn"), args[0])

        def mlp(module, args, output, i=i):
            out = output
            if steer and (i, "mlp_out") in steer:
                out = out + vector((i, "mlp_out"), out)
            keep((i, "mlp_out"), out)
            if steer and (i, "post_block") in steer:
                out = out + vector((i, "post_block"), out)
            return out

        def block(module, args, output, i=i):
            keep((i, "post_block"), output)

        handles += [
            layer.register_forward_pre_hook(pre_attn, with_kwargs=True),
            layer.self_attn.register_forward_hook(attn),
            layer.post_attention_layernorm.register_forward_pre_hook(post_attn),
            layer.mlp.register_forward_hook(mlp),
            layer.register_forward_hook(block),
        ]
    logits = hooked_logits(model, token_ids, handles)
    return logits.float(), {k: v.float().numpy() for k, v in captured.items()}


def greedy(path: Path, token_ids: list[int], n: int, steer=None, phase: str = "base"):
    """Greedy continuation with steering on every token (base), prompt tokens only (prefill) or generated
    tokens only (decode); recomputes the whole sequence each step (slow, simple). Returns (tokens, logprobs)."""
    ids = list(token_ids)
    out, logprobs = [], []
    for _ in range(n):
        rows = {"base": None, "prefill": np.arange(len(token_ids)), "decode": np.arange(len(token_ids), len(ids))}
        logits, _ = forward(path, ids, steer, rows[phase])
        lp = torch.log_softmax(logits[-1], -1)
        token = int(lp.argmax())
        out.append(token)
        logprobs.append(float(lp[token]))
        ids.append(token)
    return out, logprobs


def mix(value: torch.Tensor, rows, source: torch.Tensor, alpha: float) -> torch.Tensor:
    """``value`` with ``rows`` (token positions) replaced by (1 - alpha) * value + alpha * source."""
    out = value.clone()
    out[0, rows] = (1 - alpha) * value[0, rows] + alpha * source
    return out


def patched_logits(path: Path, token_ids: list[int], patches: dict, source: dict) -> torch.Tensor:
    """Logits [T, V] of one sequence with activation patches, written from the hook-point definitions.

    ``patches``: {(layer, hook): (positions, alpha)}; ``source``: {(layer, hook): [T, D]} (another run's values,
    e.g. ``forward``'s). Residual-stream hooks mix the whole stream; post_attn (residual + attention output) is
    mixed by rewriting the attention output so that the stream after the add is the mixed one."""
    model = load(str(path))
    handles, stream_in = [], {}

    def site(i, hook):
        positions, alpha = patches[(i, hook)]
        return positions, torch.as_tensor(source[(i, hook)][positions]), alpha

    for i, layer in enumerate(model.model.layers):
        def pre_attn(module, args, kwargs, i=i):
            h = args[0]
            if (i, "pre_attn") in patches:
                h = mix(h, *site(i, "pre_attn"))
            stream_in[i] = h
            return (h,) + tuple(args[1:]), kwargs

        def attn(module, args, output, i=i):
            out = output[0]
            if (i, "attn_out") in patches:
                out = mix(out, *site(i, "attn_out"))
            if (i, "post_attn") in patches:
                out = mix(stream_in[i] + out, *site(i, "post_attn")) - stream_in[i]
            return (out,) + tuple(output[1:])

        def mlp(module, args, output, i=i):
            return mix(output, *site(i, "mlp_out")) if (i, "mlp_out") in patches else output

        def block(module, args, output, i=i):
            if (i, "post_block") not in patches:
                return output
            if isinstance(output, tuple):
                return (mix(output[0], *site(i, "post_block")),) + tuple(output[1:])
            return mix(output, *site(i, "post_block"))

        handles += [
            layer.register_forward_pre_hook(pre_attn, with_kwargs=True),
            layer.self_attn.register_forward_hook(attn),
            layer.mlp.register_forward_hook(mlp),
            layer.register_forward_hook(block),
        ]
    return hooked_logits(model, token_ids, handles).float()
