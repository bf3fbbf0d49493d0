"""Packed cells that skip layers: the model run layer by layer, each layer over the rows that have entered by then.

Below its lowest restore, a causal-trace cell computes what its corrupted run computes. A step whose cells start
above layer 0 orders its attention sequences by first layer (``sequences.PackedSequences.plan``), so the rows layer
``l`` computes are a prefix of the step's rows: those of the sequences that start at or below ``l``. At its first
layer a segment's rows enter with the residual stream the corrupted run kept there (bank rows), as ``hidden`` with
a zero ``residual``: vLLM's deferred add then gives that stream exactly (a block that returns the stream itself,
``BlockLayout.fused_add_norm`` False, takes it as it is). Each attention layer reads metadata built
for its prefix of sequences, and writes KV for its rows only (layers a segment skips are never read by it). A
segment's padding (to a whole block) is computed in no layer: no token reads it, so its rows stay zeros. The
layers run eagerly (a layer's rows vary), with vLLM's fused kernels on GPUs; the interp ops' work is called
directly, only at the sites that steer, patch or capture something in the step. A cell's positions before its
restored token are computed in no layer either: its run's kept KV blocks are copied into its segment first
(``kept_kv``).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from interp_runner.models.layouts import layout_for

from interp_runner.plugin.records import LayerSkip


def metadata_by_sequences(build, common, skip: LayerSkip, num_seqs: int) -> dict[int, object]:
    """Attention metadata per number of leading sequences a layer computes (``build``: the backend builder's),
    from the step's ``common`` metadata in batch-row order; the slot mapping is put in model-row order (rows never
    computed, a segment's padding, have none: their KV is never written)."""
    slots = skip.slots
    if slots is None:
        slots = skip.slots = common.slot_mapping.index_select(0, skip.perm)
    query_start_cpu = common.query_start_loc_cpu
    seq_lens_cpu = common._seq_lens_cpu
    out = {}
    for k, n in zip(skip.seqs, skip.rows):
        if k in out or k == 0:
            continue
        if k == num_seqs:
            part = common.replace(slot_mapping=slots, num_actual_tokens=n)
        else:
            part = common.replace(
                query_start_loc=common.query_start_loc[: k + 1], query_start_loc_cpu=query_start_cpu[: k + 1],
                seq_lens=common.seq_lens[:k], _seq_lens_cpu=seq_lens_cpu[:k], seq_lens_cpu_upper_bound=seq_lens_cpu[:k],
                _num_computed_tokens_cpu=common._num_computed_tokens_cpu[:k], num_reqs=k, num_actual_tokens=n,
                max_query_len=int((query_start_cpu[1 : k + 1] - query_start_cpu[:k]).max()),
                max_seq_len=int(seq_lens_cpu[:k].max()), block_table_tensor=common.block_table_tensor[:k],
                slot_mapping=slots[:n], is_prefilling=common.is_prefilling[:k],
            )
        out[k] = build(part)
    return out


def _fused_rms_norm(norm, native):
    """RMSNorm (with the residual add) in vLLM's fused CUDA kernels, which work in place as its own path does."""
    weight = norm.weight.data if norm.pass_weight else None
    weight_add = norm.weight.data if norm.pass_weight_add else None
    eps = norm.variance_epsilon

    def forward(x, residual=None):
        if norm.weight.dtype != x.dtype or not x.is_contiguous():
            return native(x, residual)
        if residual is None:
            out = torch.empty_like(x)
            torch.ops._C.rms_norm(out, x, weight, eps)
            return out
        torch.ops._C.fused_add_rms_norm(x, residual, weight_add, eps)
        return x, residual

    return forward


@contextmanager
def fused_kernels(model):
    """vLLM's own kernels for its custom ops (norms, activations, rotary) while the model runs eagerly: under
    torch.compile they run as plain torch code, for Inductor to fuse."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.layernorm import RMSNorm

    kernels = model.__dict__.get("_interp_fused_kernels")
    if kernels is None:
        kernels = []
        for module in model.modules() if torch.cuda.is_available() else ():
            if type(module) is RMSNorm:
                if module.variance_size_override is None:
                    kernels.append((module, module._forward_method, _fused_rms_norm(module, module._forward_method)))
            elif isinstance(module, CustomOp) and type(module).forward_cuda is not CustomOp.forward_cuda:
                kernels.append((module, module._forward_method, module.forward_cuda))
        model._interp_fused_kernels = kernels
    for module, _, fused in kernels:
        module._forward_method = fused
    try:
        yield
    finally:
        for module, usual, _ in kernels:
            module._forward_method = usual


def run_layers(view, state, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The step's hidden states (batch-row order, as the model would return them), each row computed from its
    sequence's first layer on (``view``: the model runner's ``runner_view.RunnerView``)."""
    from vllm.forward_context import get_forward_context

    packing = state.packing
    skip = packing.sequences["skip"]
    metadata = packing.layer_metadata
    bank = state.patch_bank.values
    model = view.model()
    layout = layout_for(model.config.architectures[0])
    inner = getattr(model, layout.inner)
    layers = getattr(inner, layout.blocks)
    fused = layout.fused_add_norm  # else a block takes and returns the stream itself
    if getattr(inner, "start_layer", 0) != 0 or getattr(inner, "end_layer", len(layers)) != len(layers):
        raise RuntimeError("interp: cells that skip layers need the whole model on one pipeline stage")
    context = get_forward_context()
    if not isinstance(context.attn_metadata, dict) or not isinstance(context.slot_mapping, dict):
        raise RuntimeError("interp: cells that skip layers need one attention metadata per layer")
    names = view.attention_layers()
    rows, seqs, perm, inject = skip.rows, skip.seqs, skip.perm, skip.inject
    slots = skip.slots
    ids = input_ids.index_select(0, perm)
    first = rows[0]
    saved = dict(context.attn_metadata), dict(context.slot_mapping)
    if skip.reuse is not None:  # cells' positions their runs computed: their kept KV blocks
        at, kept_rows = skip.reuse
        state.kept_kv.copy_in(view, view.slot_mapping().index_select(0, at), kept_rows)
    hidden = inner.embed_input_ids(ids[:first])
    if layout.position_embed is not None:
        hidden = hidden + getattr(inner, layout.position_embed)(positions[:first])  # in model-row order
    residual = None
    state.call_ops_directly(True)  # the interp ops' work called directly, where it has any
    try:
        with fused_kernels(model):
            for index, layer in enumerate(layers):
                n = rows[min(index, len(rows) - 1)]
                k = seqs[min(index, len(seqs) - 1)]
                have = hidden.shape[0]
                if n > have:  # rows that start here: the stream their run kept, all in hidden
                    entering = bank.index_select(0, inject[have - first : n - first])
                    hidden = torch.cat([hidden, entering])
                    zeros = torch.zeros_like(entering)
                    if fused:
                        residual = zeros if residual is None else torch.cat([residual, zeros])
                if n == 0:
                    continue
                for name, builder in names[index]:
                    context.attn_metadata[name] = metadata[builder][k]
                    context.slot_mapping[name] = slots[:n]
                if fused:
                    hidden, residual = layer(positions[:n], hidden, residual)
                else:
                    hidden = layer(positions[:n], hidden) if layout.block_takes_positions else layer(hidden)
            final_norm = getattr(inner, layout.final_norm)
            hidden = final_norm(hidden, residual)[0] if fused else final_norm(hidden)
    finally:
        state.call_ops_directly(False)
        context.attn_metadata.clear()
        context.attn_metadata.update(saved[0])
        context.slot_mapping.clear()
        context.slot_mapping.update(saved[1])
    out = torch.zeros((input_ids.shape[0], hidden.shape[1]), dtype=hidden.dtype, device=hidden.device)
    return out.index_copy_(0, perm, hidden)
