"""The interp site ops on a planner without an engine: what an op launches outside CUDA graphs, the step's one
gather of every steered site's rows, the ops working in place, compiled as in an engine, and inert stream sites
leaving a compiled block's numbers bit for bit."""

from __future__ import annotations

import pytest

from support import planner as stand_in


def test_ops_outside_graphs_launch_only_what_the_step_does():
    """Run outside CUDA graphs (a step longer than the graphs, or a CPU), a site's op launches the steering kernel
    only in a step that steers some row, and the capture kernel only at a site the step captures at; it adds the
    rows' steering to its input in place, through ATen (``eager``: fewer host cycles than a Triton launch), and at a
    site with nothing to do it touches nothing. Before the engine's first request (its warm-up runs, which compile the kernels) and captured into a
    graph, it launches both at every site, steering through the kernel."""
    from unittest import mock

    import numpy as np
    import torch

    from interp_runner.contracts import DECODE, PREFILL, Capture, RequestPayload, Steer
    from interp_runner.payload import pack_positions

    hidden, sites = 16, (4, 9)
    vec = np.arange(hidden, dtype=np.float32)
    state = stand_in.planner(hidden, sites)
    state.register_vectors({"v": vec.tobytes()})
    requests = {"plain": stand_in.request(None, 3),
                "steered": stand_in.request(RequestPayload("steered", steer=(Steer(9, PREFILL | DECODE, "v", 2.0),)), 2),
                "captured": stand_in.request(RequestPayload("captured", capture=(Capture((4,), pack_positions([1]), False),)),
                                     2)}
    launches = []
    steer, capture = state._steer, state._capture
    state._steer = lambda x, site, eager: launches.append(("steer", site, eager)) or steer(x, site, eager)
    state._capture = lambda site, out, extra: launches.append(("capture", site)) or capture(site, out, extra)

    def step(batch: list[tuple[str, int, int]]) -> dict[int, torch.Tensor]:
        launches.clear()
        rows = sum(n for _, _, n in batch)
        state.before_forward(stand_in.runner(requests, batch), rows)
        out = {site: stand_in.applied(state, torch.ones(rows, hidden), site) for site in sites}
        state.after_forward()
        return out

    x = torch.ones(2, hidden)  # a warm-up run: no request yet
    assert all(torch.equal(stand_in.applied(state, x, site), x) for site in sites)
    assert sorted(launches) == [("capture", 4), ("capture", 9), ("steer", 4, False), ("steer", 9, False)]
    out = step([("plain", 0, 3)])
    assert launches == [] and all(torch.equal(o, torch.ones(3, hidden)) for o in out.values())
    out = step([("plain", 3, 1), ("steered", 0, 2)])
    assert sorted(launches) == [("steer", 4, True), ("steer", 9, True)]
    np.testing.assert_array_equal(out[9][1:].numpy(), np.ones((2, hidden)) + 2 * vec)
    np.testing.assert_array_equal(out[9][0].numpy(), np.ones(hidden))
    np.testing.assert_array_equal(out[4].numpy(), np.ones((3, hidden)))
    step([("plain", 4, 1), ("captured", 0, 2)])
    assert launches == [("capture", 4)]
    # captured into a graph: every launch a later replay may need (the kernels themselves stand aside here: no GPU)
    state._steer = lambda x, site, eager: launches.append(("steer", site, eager)) or x.clone()
    state._capture = lambda site, out, extra: launches.append(("capture", site))
    with mock.patch.object(torch.Tensor, "is_cuda", True), \
            mock.patch.object(torch.cuda, "is_current_stream_capturing", lambda: True):
        step([("plain", 5, 1)])
    assert sorted(launches) == [("capture", 4), ("capture", 9), ("steer", 4, False), ("steer", 9, False)]


def test_steps_outside_graphs_gather_every_site_s_steering_once(monkeypatch):
    """Outside the graphs a step's first steered site gathers its rows' vectors at every site at once; each site
    then adds its own. The values equal the per-site kernel path's bit for bit: in a planned step, in a repeated one
    that keeps the gather, with other rows at a site (per site), and above the size limit (per site). Each step's
    plan drops the previous step's gather."""
    import numpy as np
    import torch

    import interp_runner_kernels as kernels
    from interp_runner.contracts import DECODE, PREFILL, RequestPayload, Steer
    from interp_runner.plugin import steering as steering_module

    hidden, sites = 16, (4, 9)
    rng = np.random.default_rng(0)
    state = stand_in.planner(hidden, sites)
    state.register_vectors({k: rng.standard_normal(hidden).astype(np.float32).tobytes() for k in "ab"})
    requests = {"a": stand_in.request(RequestPayload("a", steer=(Steer(4, PREFILL, "a", 1.5), Steer(9, DECODE, "b", -2.0))), 3),
                "b": stand_in.request(RequestPayload("b", steer=(Steer(9, PREFILL | DECODE, "a", 0.5),)), 2),
                "plain": stand_in.request(None, 2)}
    table = state.steering

    def expected(x, site):
        return kernels.steer_add(x, table.table[table.index[site]], table.row_slot)

    def check(x):
        made = []
        for site in sites:
            assert torch.equal(stand_in.applied(state, x, site), expected(x, site))
            made.append(table._step_gather)
        assert made[0] is not None and all(g is made[0] for g in made)  # one gather for the step

    batch = [("a", 0, 3), ("plain", 0, 2), ("b", 0, 2)]  # prompts: prefill slots
    state.before_forward(stand_in.runner(requests, batch), 7)
    x = torch.from_numpy(rng.standard_normal((7, hidden)).astype(np.float32))
    check(x)
    assert table._step_gather is not None and [g.shape for g in table._step_gather] == [(7, hidden)] * len(sites)
    gathered = table._step_gather
    assert torch.equal(stand_in.applied(state, x[:5], 9), expected(x[:5], 9))  # other rows: site by site
    assert table._step_gather is gathered
    state.after_forward()
    decode = [("a", 3, 1), ("plain", 2, 1), ("b", 2, 1)]  # one generated token each: decode slots
    state.before_forward(stand_in.runner(requests, decode), 3)
    assert table._step_gather is None  # planned afresh: the last step's gather is dropped
    y = torch.from_numpy(rng.standard_normal((3, hidden)).astype(np.float32))
    check(y)
    state.after_forward()
    monkeypatch.setattr(steering_module, "GATHER_BYTES", 0)  # too large to gather: site by site, same values
    state.before_forward(stand_in.runner(requests, [("a", 4, 1), ("plain", 3, 1), ("b", 3, 1)]), 3)
    table._step_gather = None
    for site in sites:
        assert torch.equal(stand_in.applied(state, y, site), expected(y, site))
    assert table._step_gather is None


@pytest.mark.slow  # compiled mode: Inductor's first compile in a process takes ~10 s
def test_site_ops_work_in_place_and_compile_without_a_copy():
    """The site op changes its input in place and returns nothing: steering adds to the steered rows, a site with
    nothing to do leaves the tensor as it was. Under torch.compile (Inductor, as vLLM compiles the model) the op is
    called on Inductor's own buffer, with no copy made for it, and the compiled block gives the eager values."""
    import re

    import numpy as np
    import torch
    from torch._inductor.utils import run_and_get_code

    from interp_runner.contracts import DECODE, PREFILL, RequestPayload, Steer
    from interp_runner.plugin import ops

    hidden = 16
    state = stand_in.planner(hidden, (4, 9))
    state.register_vectors({"v": np.full(hidden, 0.5, np.float32).tobytes()})
    requests = {"plain": stand_in.request(None, 2),
                "steered": stand_in.request(RequestPayload("steered", steer=(Steer(9, PREFILL | DECODE, "v", 2.0),)),
                                            3)}
    weight = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0))

    def block(x):
        h = torch.relu(x @ weight)
        h = ops.apply_site(h, None, 4)  # nothing to do at this site in this step
        h = ops.apply_site(h, None, 9)  # steers the steered request's rows
        return h * 2

    ops.register_ops()
    ops.activate(state)
    try:
        state.before_forward(stand_in.runner(requests, [("plain", 0, 2), ("steered", 0, 3)]), 5)
        x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(1))
        plain = torch.relu(x @ weight)
        h = plain.clone()
        assert ops.apply_site(h, None, 4) is h and torch.equal(h, plain)
        eager = block(x)
        torch._dynamo.reset()
        compiled, codes = run_and_get_code(torch.compile(block, backend="inductor", fullgraph=True), x)
    finally:
        ops.deactivate(state)
        torch._dynamo.reset()
    want = plain * 2
    want[2:] += 2.0  # 0.5 x scale 2, doubled with the block's output
    torch.testing.assert_close(eager, want)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    code = codes[-1]
    calls = re.findall(r"torch\.ops\.interp\.site\.default\((\w+), None, (\d+)\)", code)
    assert [site for _, site in calls] == ["4", "9"], code
    assert calls[0][0] == calls[1][0], code  # one buffer, changed in place by both
    assert "clone" not in code and "copy_" not in code, code


@pytest.mark.slow  # three Inductor compiles
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Gemma2ForCausalLM"])
def test_inert_sites_leave_the_compiled_blocks_bit_for_bit(architecture):
    """Compiled, blocks whose residual stream goes from one fused add+norm to the next (vLLM's native form) carry
    that stream in float32: Inductor drops the round trip through bfloat16 between the two, and between a Gemma
    block's post-branch norm and the add after it. Ops with nothing to do at every hook (post_attn aside: below)
    then leave the blocks' numbers as they are, bit for bit, because they take those tensors in float32
    (``layers._wide``); the same ops given the bfloat16 tensors would round them and move the numbers."""
    from types import SimpleNamespace

    import torch

    from interp_runner.models.layouts import layout_for
    from interp_runner.plugin import layers, ops

    hidden = 64
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(hidden, hidden, generator=gen, dtype=torch.bfloat16) / 8 for _ in range(2)]
    norm_weight = (1 + torch.randn(hidden, generator=gen) / 4).to(torch.bfloat16)

    class AddNorm(torch.nn.Module):  # vLLM's native fused add + RMS norm (vllm.ir.ops.layernorm)
        def forward(self, x, residual=None):
            dtype = x.dtype
            x = x.float() if residual is None else x.float() + residual.float()
            new_residual = x.to(dtype)
            x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype) * norm_weight
            return x if residual is None else (x, new_residual)

    class Linear(torch.nn.Module):
        def __init__(self, w):
            super().__init__()
            self.w = w

        def forward(self, hidden_states=None, positions=None, **kwargs):
            return hidden_states @ self.w  # a matrix product: its output is rounded in stock's graph too

    state = stand_in.planner(hidden, (4, 9))
    requests = {"plain": stand_in.request(None, 6)}
    layout = layout_for(architecture)
    forward = layers.fused_add_norm_forward(layout)
    norms = [n for n in (layout.pre_attn_norm, layout.post_attn_norm, layout.pre_mlp_norm, layout.post_mlp_norm) if n]
    # every hook but post_attn: on a GPU vLLM's graph splits at attention, so the stream reaches post_attn rounded
    # (this test compiles one graph, as vLLM's CPU build does, where it would not)
    every_site = {hook: 20 + i for i, hook in enumerate(layout.hooks) if hook != "post_attn"}

    def block(sites: dict):
        module = torch.nn.Module()
        for name in norms:
            setattr(module, name, AddNorm())
        setattr(module, layout.attn, Linear(weights[0]))
        setattr(module, layout.mlp, Linear(weights[1]))
        parts = SimpleNamespace(**dict(module.named_children()), _interp_sites=sites, _interp_state=state,
                                _interp_pair_sites=frozenset(), _interp_router_site=None, _interp_last=False)
        final_norm = AddNorm()

        def two_layers(positions, h, r):  # the next layer's add+norm reads the stream the first one leaves
            h, r = forward(parts, positions, h, r)
            h, r = forward(parts, positions, h, r)
            return final_norm(h, r)

        return two_layers

    x = torch.randn(6, hidden, generator=gen).to(torch.bfloat16)
    r = torch.randn(6, hidden, generator=gen).to(torch.bfloat16)
    positions = torch.arange(6)

    def compiled(sites: dict):
        torch._dynamo.reset()
        return torch.compile(block(sites), backend="inductor", fullgraph=True)(positions, x, r)

    ops.register_ops()
    ops.activate(state)
    try:
        state.before_forward(stand_in.runner(requests, [("plain", 0, 6)]), 6)
        stock = compiled({})
        inert = compiled(every_site)
        layers_wide = layers._wide
        layers._wide = lambda self, at: at  # the ops given the bfloat16 tensors
        try:
            rounded = compiled(every_site)
        finally:
            layers._wide = layers_wide
    finally:
        state.after_forward()
        ops.deactivate(state)
        torch._dynamo.reset()
    for got, want in zip(inert, stock):
        assert torch.equal(got, want)
    assert not all(torch.equal(got, want) for got, want in zip(rounded, stock))
