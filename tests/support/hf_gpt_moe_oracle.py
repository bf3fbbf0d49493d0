"""An independent reference for GPT-2, GPT-NeoX (Pythia) and Qwen3-MoE: plain HF transformers forward hooks.

Written from the hook-point definitions, per family's HF modules (block, attention, the norm the MLP reads, MLP):
pre_attn = block input; attn_out = attention output; post_attn = the stream the MLP's norm reads (sequential
blocks only); mlp_out = MLP output (a MoE block's expert mixture); post_block = block output. Steering adds a
vector to the stream or branch output: at post_attn to the attention output (the stream after the add is then
steered), at post_block to the MLP output (in GPT-NeoX's parallel block too: x + attn + mlp). ``router``: a MoE
block's router logits [T, experts] (HF's ``mlp.gate`` returns logits, top-k weights and top-k indices).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from support import hf_oracle

# HF architecture -> (blocks, attention, the MLP's input norm, MLP, token embedding) module paths
MODULES = {
    "GPT2LMHeadModel": ("transformer.h", "attn", "ln_2", "mlp", "transformer.wte"),
    "GPTNeoXForCausalLM": ("gpt_neox.layers", "attention", "post_attention_layernorm", "mlp", "gpt_neox.embed_in"),
    "Qwen3MoeForCausalLM": ("model.layers", "self_attn", "post_attention_layernorm", "mlp", "model.embed_tokens"),
}


@lru_cache(maxsize=1)
def load(path: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()


def parts(model):
    """(blocks, [(attention, mlp-norm, mlp) per block], embedding) of ``model``."""
    blocks_path, attn, norm, mlp, embed = MODULES[type(model).__name__]
    blocks = model.get_submodule(blocks_path)
    branches = [(b.get_submodule(attn), b.get_submodule(norm), b.get_submodule(mlp)) for b in blocks]
    return blocks, branches, model.get_submodule(embed)


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _replace_first(output, value):
    return (value,) + tuple(output[1:]) if isinstance(output, tuple) else value


def _block_input(args, kwargs):
    return args[0] if args else kwargs["hidden_states"]


def _with_block_input(args, kwargs, value):
    if args:
        return (value,) + tuple(args[1:]), kwargs
    return args, {**kwargs, "hidden_states": value}


def run(model, token_ids, handles) -> torch.Tensor:
    try:
        with torch.no_grad():
            return model(torch.tensor([token_ids])).logits[0].float()
    finally:
        for h in handles:
            h.remove()


def forward(path, token_ids, steer=None, steer_rows=None):
    """Logits [T, V] and every hook's values {(layer, hook): [T, D]} (and {(layer, "router"): [T, E]} for MoE)."""
    model = load(str(path))
    blocks, branches, _ = parts(model)
    captured, handles = {}, []
    add, keep = hf_oracle.steer_and_keep(steer, steer_rows, captured)

    for i, (block, (attn, norm, mlp)) in enumerate(zip(blocks, branches)):
        def pre(module, args, kwargs, i=i):
            h = add((i, "pre_attn"), _block_input(args, kwargs))
            keep((i, "pre_attn"), h)
            return _with_block_input(args, kwargs, h)

        def attn_hook(module, args, output, i=i):
            out = add((i, "attn_out"), _first(output))
            keep((i, "attn_out"), out)
            return _replace_first(output, add((i, "post_attn"), out))

        def mlp_hook(module, args, output, i=i):
            out = add((i, "mlp_out"), _first(output))
            keep((i, "mlp_out"), out)
            return _replace_first(output, add((i, "post_block"), out))

        handles += [block.register_forward_pre_hook(pre, with_kwargs=True),
                    attn.register_forward_hook(attn_hook), mlp.register_forward_hook(mlp_hook),
                    block.register_forward_hook(lambda m, a, o, i=i: keep((i, "post_block"), _first(o)))]
        if getattr(block, "use_parallel_residual", False) is False:  # the stream the MLP's norm reads
            handles.append(norm.register_forward_pre_hook(lambda m, a, i=i: keep((i, "post_attn"), a[0])))
        if hasattr(mlp, "gate"):
            handles.append(mlp.gate.register_forward_hook(
                lambda m, a, o, i=i: captured.__setitem__((i, "router"), o[0].detach().clone())))
    logits = run(model, token_ids, handles)
    return logits, {k: v.float().numpy() for k, v in captured.items()}


def greedy(path, token_ids, n, steer=None):
    """Greedy continuation steered on every token; recomputes the whole sequence each step. (tokens, logprobs)"""
    ids, out, logprobs = list(token_ids), [], []
    for _ in range(n):
        lp = torch.log_softmax(forward(path, ids, steer)[0][-1], -1)
        out.append(int(lp.argmax()))
        logprobs.append(float(lp[out[-1]]))
        ids.append(out[-1])
    return out, logprobs


def mix(value, rows, source, alpha):
    out = value.clone()
    out[0, rows] = (1 - alpha) * value[0, rows] + alpha * source
    return out


def patched_logits(path, token_ids, patches, source):
    """Logits with ``patches`` {(layer, hook): (positions, alpha)} mixing in ``source`` {(layer, hook): [T, D]}.
    Stream hooks mix the stream; post_attn by rewriting the attention output so the stream after the add is the
    mixed one."""
    model = load(str(path))
    blocks, branches, _ = parts(model)
    handles, stream_in = [], {}

    def site(i, hook):
        positions, alpha = patches[(i, hook)]
        return positions, torch.as_tensor(source[(i, hook)][positions]), alpha

    for i, (block, (attn, _, mlp)) in enumerate(zip(blocks, branches)):
        def pre(module, args, kwargs, i=i):
            h = _block_input(args, kwargs)
            if (i, "pre_attn") in patches:
                h = mix(h, *site(i, "pre_attn"))
            stream_in[i] = h
            return _with_block_input(args, kwargs, h)

        def attn_hook(module, args, output, i=i):
            out = _first(output)
            if (i, "attn_out") in patches:
                out = mix(out, *site(i, "attn_out"))
            if (i, "post_attn") in patches:
                out = mix(stream_in[i] + out, *site(i, "post_attn")) - stream_in[i]
            return _replace_first(output, out)

        def mlp_hook(module, args, output, i=i):
            return mix(output, *site(i, "mlp_out")) if (i, "mlp_out") in patches else output

        def block_hook(module, args, output, i=i):
            if (i, "post_block") not in patches:
                return output
            return _replace_first(output, mix(_first(output), *site(i, "post_block")))

        handles += [block.register_forward_pre_hook(pre, with_kwargs=True), attn.register_forward_hook(attn_hook),
                    mlp.register_forward_hook(mlp_hook), block.register_forward_hook(block_hook)]
    return run(model, token_ids, handles)


def trace(path, fact_ids, subject, noise, answer, cells, window):
    """Log-probabilities of ``answer`` for each causal-trace cell (kind, layer, token) and with nothing restored:
    ``noise`` added to the subject's token embeddings, clean states put back at the restored sites (resid: the
    block output; mlp / attn: the branch outputs of the ``window`` layers around the cell's layer)."""
    model = load(str(path))
    blocks, branches, embed = parts(model)
    n = len(fact_ids)
    clean = {}
    handles = []
    for i, (block, (attn, _, mlp)) in enumerate(zip(blocks, branches)):
        for kind, module in (("resid", block), ("attn", attn), ("mlp", mlp)):
            handles.append(module.register_forward_hook(
                lambda m, a, o, k=kind, i=i: clean.__setitem__((k, i), _first(o).clone())))
    run(model, fact_ids, handles)

    batch = len(cells) + 1  # the last row: corrupted, nothing restored
    noise_t = torch.zeros(batch, n, noise.shape[-1])
    noise_t[:, subject] = torch.as_tensor(noise)
    restore = {}
    for row, (kind, layer, token) in enumerate(cells):
        lo, hi = (layer, layer + 1) if kind == "resid" else (max(0, layer - window // 2),
                                                               min(len(blocks), layer + window // 2))
        for lay in range(lo, hi):
            restore.setdefault((kind, lay), []).append((row, token))

    def put_back(kind, i):
        def hook(module, args, output):
            out = _first(output).clone()
            for row, token in restore.get((kind, i), []):
                out[row, token] = clean[(kind, i)][0, token]
            return _replace_first(output, out)
        return hook

    handles = [embed.register_forward_hook(lambda m, a, o: o + noise_t)]
    for i, (block, (attn, _, mlp)) in enumerate(zip(blocks, branches)):
        handles += [block.register_forward_hook(put_back("resid", i)), mlp.register_forward_hook(put_back("mlp", i)),
                    attn.register_forward_hook(put_back("attn", i))]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([fact_ids]).repeat(batch, 1)).logits[:, -1].double()
    finally:
        for h in handles:
            h.remove()
    lp = torch.log_softmax(logits, -1)[:, answer].numpy()
    return lp[:-1], lp[-1]


def routing(router_logits: np.ndarray, top_k: int, normalize: bool):
    """(experts, weights) each token chose from its router logits [T, E]: top-k of the softmax, renormalized
    over the chosen ones where the family does so (``norm_topk_prob``)."""
    probs = torch.softmax(torch.as_tensor(router_logits, dtype=torch.float64), -1)
    weights, experts = torch.topk(probs, top_k, -1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return experts.numpy(), weights.numpy()
