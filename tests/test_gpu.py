"""The engine on a CUDA GPU as it runs in production: SmolLM2 in bf16 with torch.compile and CUDA graphs on.

One engine for the module, built with steering and capture ops at every site; each test runs its own plan
on it. References are plain HF transformers with forward hooks (``hf_oracle``) in float32 on the CPU.

bf16 tolerances are calibrated, not guessed: for every compared quantity the same HF forward is also run in
bf16, and the engine may differ from the float32 reference by a few times what bf16 arithmetic itself costs
there, with floors (0.1 on logprobs, 5e-2 on the relative error of an activation row). Steering vectors are
strong (norm 40 on a stream of norm ~100-700), so that what they move is far above bf16 noise; a logprob may
also be off by 5% of what the steering moved it. Over all captured rows, the median relative error must
stay under 2.5e-2.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from functools import lru_cache
from unittest import mock

import numpy as np
import pytest
import torch

from support import hf_oracle
from conftest import build_engine, every_site, rel_err, run_config
from interp_runner.sites import site_id
from interp_runner.vectors.load import random_direction

pytestmark = [pytest.mark.gpu, pytest.mark.engine, pytest.mark.slow]

HIDDEN, LAYERS = 576, 30
PROMPTS = [
    "The Eiffel Tower is located in the city of",
    "My favourite food is",
    "Water boils at a temperature of",
    "The first three planets of the solar system are",
]
LOGPROB_FLOOR = 0.1
ACT_FLOOR = 5e-2
BF16_FACTOR = 4.0
STEER_SHARE = 0.05  # logprob tolerance as a share of the steering effect
MEDIAN_ROW_ERR = 2.5e-2
NORM = 40.0
# every comparison in one place, for the log: label -> (largest error, its tolerance)
REPORT: list[str] = []
ROW_ERRORS: list[np.ndarray] = []
WORST: dict[str, tuple[float, float]] = {}


def note(label: str, err: float, tol: float) -> None:
    if label not in WORST or err / tol > WORST[label][0] / WORST[label][1]:
        WORST[label] = (err, tol)


def config(prompts=PROMPTS, **parts) -> dict:
    cfg = {
        "model": {"name": "smollm2_135m"},
        "engine": {"dtype": "bfloat16", "enforce_eager": False, "max_model_len": 1024},
        "prompts": {"items": prompts},
        "sampling": {"max_tokens": 12, "logprobs": 5},
    }
    cfg.update(parts)
    return cfg


def vec(seed: int, norm: float = NORM) -> np.ndarray:
    return random_direction(seed=seed, norm=norm, size=HIDDEN)


def fixed_shape_run(engine, cfg):
    """Every prompt token computed (no prefix-cache reads) and every request runs to max_tokens, so runs of
    the same prompts have the same batch layout at every step."""
    return run_config(engine, cfg, skip_reading_prefix_cache=True, ignore_eos=True)


# -- references ---------------------------------------------------------------------------------------


@lru_cache(maxsize=2)
def _hf_model(path: str, dtype: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()


def hf(path, ids, steer=None, rows=None, dtype="float32"):
    """hf_oracle.forward in float32 or bfloat16 (CPU): (log-softmax [T, V], {(layer, hook): [T, D]})."""
    with mock.patch.object(hf_oracle, "load", lambda p: _hf_model(p, dtype)):
        logits, acts = hf_oracle.forward(path, list(ids), steer, rows)
    return torch.log_softmax(logits.double(), -1).numpy(), acts


def row_rel(a, b) -> np.ndarray:
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def check_acts(got, ref32, ref16, what: str, label: str) -> None:
    """Engine activations vs the float32 reference, within what bf16 costs for the same rows."""
    assert np.isfinite(got).all(), what
    rows = row_rel(got, ref32)
    ROW_ERRORS.append(rows)
    err = float(rows.max())
    bf16 = float(row_rel(ref16, ref32).max())
    tol = max(ACT_FLOOR, BF16_FACTOR * bf16)
    note(label, err, tol)
    assert err <= tol, f"{what}: max row relative error {err:.4f} > {tol:.4f} (HF bf16 itself: {bf16:.4f})"


def check_logprobs(got, ref32, ref16, plain32, what: str) -> float:
    """Engine logprobs vs the steered float32 reference; ``plain32``: the same without steering. Returns
    how far the steering moved the reference."""
    err = float(np.abs(got - ref32).max())
    bf16 = float(np.abs(ref16 - ref32).max())
    moved = float(np.abs(ref32 - plain32).max())
    tol = max(LOGPROB_FLOOR, BF16_FACTOR * bf16, STEER_SHARE * moved)
    note(what, err, tol)
    assert err <= tol, (f"{what}: logprobs differ from HF float32 by {err:.4f} > {tol:.4f} "
                        f"(HF bf16: {bf16:.4f}, steering moved them by {moved:.3f})")
    return moved


# -- the engine ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(smollm2_path):
    sites = every_site(LAYERS)
    eng = build_engine(
        smollm2_path, sites, sites, dtype="bfloat16", enforce_eager=False, max_model_len=1024,
        max_num_seqs=16, kv_cache_memory_bytes=2 << 30,
    )
    yield eng
    eng.close()
    lines = REPORT + [f"{k}: worst error {e:.4f} (tolerance {t:.4f})" for k, (e, t) in sorted(WORST.items())]
    if ROW_ERRORS:
        rows = np.concatenate(ROW_ERRORS)
        lines.append(f"captured rows: {rows.size}, relative error median {np.median(rows):.4f}, "
                     f"p95 {np.percentile(rows, 95):.4f}, max {rows.max():.4f}")
    print("\n" + "\n".join(lines))
    if os.environ.get("INTERP_GPU_REPORT"):  # bench/gpu_check.sh keeps it with the logs
        with open(os.environ["INTERP_GPU_REPORT"], "a") as f:
            f.write("\n".join(lines) + "\n")


def _runner_info(worker) -> dict:
    from interp_runner.plugin.runners.base import room_name

    runner = worker.model_runner
    return {"class": f"{type(runner).__module__}.{type(runner).__name__}", "room": room_name(runner)}


def test_engine_is_bf16_with_cuda_graphs_and_instrumented_runner(engine):
    from vllm.config import CompilationMode, CUDAGraphMode

    vc = engine.llm.llm_engine.vllm_config
    assert vc.model_config.dtype == torch.bfloat16
    assert not vc.model_config.enforce_eager
    assert vc.compilation_config.mode != CompilationMode.NONE
    assert vc.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
    # the runner vLLM picked (VLLM_USE_V2_MODEL_RUNNER=0 / 1 picks V1 / V2: docs/model_runners.md) is one the
    # planner drives: any other would run the ops without ever filling their buffers
    info = engine.llm.collective_rpc(_runner_info)[0]
    assert engine.status["runner_planned"] and engine.model_runner == info["room"], info
    wanted = {"0": "v1", "1": "v2"}.get(os.environ.get("VLLM_USE_V2_MODEL_RUNNER", ""))
    assert wanted in (None, engine.model_runner), (wanted, info)
    assert engine.status["loaded"] and len(engine.status["instrumented_layers"]) == LAYERS
    REPORT.append(f"runner {info['class']}, cudagraph_mode {vc.compilation_config.cudagraph_mode}")


@pytest.fixture(scope="module")
def unsteered(engine):
    return fixed_shape_run(engine, config())


# -- (a) zero steering is no steering -----------------------------------------------------------------


def test_zero_vector_and_zero_scale_change_nothing(engine, unsteered):
    steering = {
        "global": {
            "base": {"post_block": {"layer": "all", "vector": [0.0] * HIDDEN}},
            "prefill": {"pre_attn": {"layer": [0, 3], "vector": vec(1, 50.0).tolist(), "scale": 0.0}},
            "decode": {"mlp_out": {"layer": 9, "vector": vec(2).tolist(), "scale": 0.0}},
        }
    }
    _, results = fixed_shape_run(engine, config(steering=steering))
    for got, want in zip(results, unsteered[1]):
        assert got.token_ids == want.token_ids
        assert got.logprobs == want.logprobs


# -- (b) batch isolation ------------------------------------------------------------------------------


def test_mixed_batch_unsteered_requests_are_bit_identical(engine, unsteered):
    steering = {"request": [
        {"prompts": [1], "base": {"post_block": {"layer": "all", "vector": vec(3, 4.0).tolist()}}},
        {"prompts": [3], "prefill": {"pre_attn": {"layer": 0, "vector": vec(4).tolist()}},
         "decode": {"mlp_out": {"layer": 12, "vector": vec(5).tolist()}}},
    ]}
    _, mixed = fixed_shape_run(engine, config(steering=steering))
    plain = unsteered[1]
    for i in (0, 2):
        assert mixed[i].token_ids == plain[i].token_ids
        assert mixed[i].logprobs == plain[i].logprobs
        assert mixed[i].top_logprobs == plain[i].top_logprobs
    for i in (1, 3):
        assert mixed[i].logprobs != plain[i].logprobs


# -- (c) steering matches HF hooks --------------------------------------------------------------------


@pytest.mark.parametrize("hook", ["pre_attn", "attn_out", "post_attn", "mlp_out", "post_block"])
def test_steering_matches_hf_hooks(engine, smollm2_path, unsteered, hook):
    layer, v = 7, vec(6)
    steering = {"request": [{"prompts": [0], "base": {hook: {"layer": layer, "vector": v.tolist()}}}]}
    plan, results = fixed_shape_run(engine, config(steering=steering))
    ids = plan.requests[0].prompt.token_ids
    steer = {(layer, hook): v}
    ref32, _ = hf(smollm2_path, ids, steer)
    ref16, _ = hf(smollm2_path, ids, steer, dtype="bfloat16")
    plain32, _ = hf(smollm2_path, ids)

    top = results[0].top_logprobs[0]  # the engine's top tokens at the first generated step
    tokens = [t for t, _ in top]
    got = np.array([lp for _, lp in top])
    moved = check_logprobs(got, ref32[-1, tokens], ref16[-1, tokens], plain32[-1, tokens],
                           f"steer {hook}@{layer} first step")
    # the steering clearly moved the distribution, and the engine went where the reference went
    assert moved > 1.0, f"steering at {hook} moved the reference logprobs by only {moved:.3f}"
    from_plain = float(np.abs(got - plain32[-1, tokens]).max())
    assert float(np.abs(got - ref32[-1, tokens]).max()) < 0.25 * from_plain
    base = dict(unsteered[1][0].top_logprobs[0])
    assert max(abs(lp - base.get(t, -100.0)) for t, lp in top) > 1.0
    # the other requests are untouched
    for got_r, want in zip(results[1:], unsteered[1][1:]):
        assert got_r.token_ids == want.token_ids and got_r.logprobs == want.logprobs


# -- (d) capture matches HF ---------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["last_prompt", "all_prompt"])
def test_capture_matches_hf(engine, smollm2_path, positions):
    hooks = ["pre_attn", "mlp_out", "post_block"]
    capture = [{"name": "acts", "hooks": hooks, "layers": "all", "positions": positions}]
    first = len(ROW_ERRORS)
    plan, results = fixed_shape_run(engine, config(PROMPTS[:3], capture=capture))
    for request, result in zip(plan.requests, results):
        ids = request.prompt.token_ids
        n = len(ids)
        expected = [n - 1] if positions == "last_prompt" else list(range(n))
        _, ref32 = hf(smollm2_path, ids)
        _, ref16 = hf(smollm2_path, ids, dtype="bfloat16")
        for hook in hooks:
            got = np.stack([result.captures[site_id(layer, hook)][1] for layer in range(LAYERS)])
            for layer in range(LAYERS):
                assert result.captures[site_id(layer, hook)][0].tolist() == expected, (layer, hook)
            want32 = np.stack([ref32[(layer, hook)][expected] for layer in range(LAYERS)])
            want16 = np.stack([ref16[(layer, hook)][expected] for layer in range(LAYERS)])
            for layer in range(LAYERS):
                what = f"capture {hook}@{layer} {positions} p{request.prompt.index}"
                check_acts(got[layer], want32[layer], want16[layer], what, f"capture {hook} {positions}")
    median = float(np.median(np.concatenate(ROW_ERRORS[first:])))
    assert median <= MEDIAN_ROW_ERR, f"median relative error of captured rows {median:.4f}"


# -- (e) capture of generated tokens ------------------------------------------------------------------


def test_capture_all_generated_with_steering(engine, smollm2_path):
    max_tokens, layer, v = 8, 7, vec(7)
    steering = {"request": [{"prompts": [0], "base": {"post_block": {"layer": layer, "vector": v.tolist()}}}]}
    capture = [{"name": "gen", "hooks": ["post_block", "mlp_out"], "layers": "all", "positions": "all_generated"}]
    plan, results = fixed_shape_run(
        engine, config(PROMPTS[:2], steering=steering, capture=capture, sampling={"max_tokens": max_tokens}))
    for request, result in zip(plan.requests, results):
        ids = list(request.prompt.token_ids)
        n = len(ids)
        assert len(result.token_ids) == max_tokens
        full = ids + result.token_ids[:-1]  # the last sampled token is never run through the model
        steer = {(layer, "post_block"): v} if request.prompt.index == 0 else None
        _, ref32 = hf(smollm2_path, full, steer)
        _, ref16 = hf(smollm2_path, full, steer, dtype="bfloat16")
        for lay in range(LAYERS):
            for hook in ("post_block", "mlp_out"):
                positions, values = result.captures[site_id(lay, hook)]
                assert positions.tolist() == list(range(n, n + max_tokens - 1)), (lay, hook)
                assert values.shape == (max_tokens - 1, HIDDEN)
                check_acts(values, ref32[(lay, hook)][n:], ref16[(lay, hook)][n:],
                           f"capture {hook}@{lay} all_generated p{request.prompt.index}",
                           f"capture {hook} all_generated")


# -- (f) graph mode is really in effect ---------------------------------------------------------------


@contextmanager
def record_steps():
    """Per model forward: (tokens scheduled, requests, cudagraph runtime mode in effect, CUDA graph replays,
    whether the step captured), under either model runner."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context
    from vllm.v1.worker.gpu import model_runner as v2
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from interp_runner.plugin.runtime import InterpState

    steps, replays, captures = [], [0], []
    graph_replay = torch.cuda.CUDAGraph.replay
    model_forward = GPUModelRunner._model_forward
    before_forward = InterpState.before_forward

    def replay(self, *args, **kwargs):
        replays[0] += 1
        return graph_replay(self, *args, **kwargs)

    def forward(self, *args, **kwargs):
        start = replays[0]
        out = model_forward(self, *args, **kwargs)
        n = self.input_batch.num_reqs
        scheduled = int(self.query_start_loc.np[n])
        mode = get_forward_context().cudagraph_runtime_mode
        steps.append((scheduled, n, mode, replays[0] - start, captures[-1] if captures else None))
        return out

    def planner(self, runner, num_rows):
        captured = before_forward(self, runner, num_rows)
        captures.append(captured)
        return captured

    execute_v2, context_v2, modes = v2.GPUModelRunner.execute_model, v2.set_forward_context, []

    def context(*args, **kwargs):  # V2 enters no forward context for a FULL graph's replay
        modes.append(kwargs.get("cudagraph_runtime_mode"))
        return context_v2(*args, **kwargs)

    def execute(self, scheduler_output, *args, **kwargs):
        start, seen = replays[0], len(modes)
        out = execute_v2(self, scheduler_output, *args, **kwargs)
        done = self.execute_model_state
        if done is not None and not kwargs.get("dummy_run"):
            mode = modes[-1] if len(modes) > seen else CUDAGraphMode.FULL
            steps.append((done.input_batch.num_tokens, done.input_batch.num_reqs, mode, replays[0] - start,
                          captures[-1] if captures else None))
        return out

    with mock.patch.object(torch.cuda.CUDAGraph, "replay", replay), \
            mock.patch.object(GPUModelRunner, "_model_forward", forward), \
            mock.patch.object(v2.GPUModelRunner, "execute_model", execute), \
            mock.patch.object(v2, "set_forward_context", context), \
            mock.patch.object(InterpState, "before_forward", planner):
        yield steps


def test_steered_decode_runs_in_cuda_graphs_and_matches_hf(engine, smollm2_path, unsteered):
    from vllm.config import CUDAGraphMode

    max_tokens = 12
    steering = {"request": [
        {"prompts": [0], "base": {"post_block": {"layer": 7, "vector": vec(8).tolist()}}},
        {"prompts": [1], "decode": {"mlp_out": {"layer": 7, "vector": vec(9).tolist()}}},
        {"prompts": [3], "prefill": {"pre_attn": {"layer": 3, "vector": vec(10).tolist()}}},
    ]}
    with record_steps() as steps:
        plan, results = fixed_shape_run(
            engine, config(steering=steering, sampling={"max_tokens": max_tokens, "logprobs": 5}))
    REPORT.append("steered steps (tokens, reqs, mode, replays, captured): " + repr(steps))
    decode = [s for s in steps if s[0] == s[1]]
    assert len(decode) >= max_tokens - 1, steps
    for scheduled, reqs, mode, replays, captured in decode:
        assert mode != CUDAGraphMode.NONE, steps
        assert replays >= 1, steps
        assert not captured, steps

    # decode-step steering under the graphs is right: teacher-forced HF with the same tiers
    tiers = {0: ({(7, "post_block"): vec(8)}, "base"), 1: ({(7, "mlp_out"): vec(9)}, "decode"),
             3: ({(3, "pre_attn"): vec(10)}, "prefill"), 2: (None, "base")}
    for request, result in zip(plan.requests, results):
        ids = list(request.prompt.token_ids)
        n = len(ids)
        full = ids + result.token_ids[:-1]
        steer, tier = tiers[request.prompt.index]
        rows = {"base": None, "prefill": np.arange(n), "decode": np.arange(n, len(full))}[tier]
        ref32, _ = hf(smollm2_path, full, steer, rows)
        ref16, _ = hf(smollm2_path, full, steer, rows, dtype="bfloat16")
        plain32, _ = hf(smollm2_path, full)
        at = np.arange(n - 1, len(full))
        chosen = np.array(result.token_ids)
        got = np.array(result.logprobs)
        moved = check_logprobs(got, ref32[at, chosen], ref16[at, chosen], plain32[at, chosen],
                               f"teacher-forced {tier} p{request.prompt.index}")
        if tier == "decode":  # generated-token steering happened in graph-replayed steps only
            assert moved > 1.0, f"decode steering moved logprobs by only {moved:.3f}"
            # its first token comes from the unsteered prompt rows: bit for bit the unsteered result
            plain = unsteered[1][request.prompt.index]
            assert result.token_ids[0] == plain.token_ids[0] and result.logprobs[0] == plain.logprobs[0]


def test_steering_outside_cuda_graphs_matches_hf(engine, smollm2_path):
    """A prompt longer than the largest CUDA graph: its prefill step runs outside the graphs, where steering goes
    through ATen (the step's gather of every steered site's rows, then an add a site), and its decode steps replay
    graphs (the Triton kernel). Every generated token matches HF hooks, teacher-forced."""
    from vllm.config import CUDAGraphMode

    largest = max(engine.llm.llm_engine.vllm_config.compilation_config.cudagraph_capture_sizes)
    prompt = " ".join(["The river runs past the old mill and on down to the sea."] * 8)
    vector = 4 * vec(11)  # large enough to move the log-probs well past bf16 noise
    steering = {"request": [{"prompts": [0], "base": {"post_block": {"layer": 7, "vector": vector.tolist()}}}]}
    with record_steps() as steps:
        plan, results = fixed_shape_run(
            engine, config([prompt], steering=steering, sampling={"max_tokens": 6, "logprobs": 5}))
    REPORT.append("steered long prompt's steps (tokens, reqs, mode, replays, captured): " + repr(steps))
    ids = list(plan.requests[0].prompt.token_ids)
    n = len(ids)
    assert n > largest, (n, largest)
    prefill = [s for s in steps if s[0] == n]
    assert prefill and all(s[2] == CUDAGraphMode.NONE and s[3] == 0 for s in prefill), steps
    decode = [s for s in steps if s[0] == s[1] == 1]
    assert decode and all(s[2] != CUDAGraphMode.NONE and s[3] >= 1 for s in decode), steps

    result = results[0]
    full = ids + result.token_ids[:-1]
    steer = {(7, "post_block"): vector}
    ref32, _ = hf(smollm2_path, full, steer)
    ref16, _ = hf(smollm2_path, full, steer, dtype="bfloat16")
    plain32, _ = hf(smollm2_path, full)
    at, chosen = np.arange(n - 1, len(full)), np.array(result.token_ids)
    moved = check_logprobs(np.array(result.logprobs), ref32[at, chosen], ref16[at, chosen], plain32[at, chosen],
                           "teacher-forced, prefill outside the graphs")
    assert moved > 1.0, f"steering moved the reference logprobs by only {moved:.3f}"


def test_capture_runs_in_cuda_graphs_and_overflow_leaves_them(engine):
    """Capture writes through persistent buffers inside the graphs: decode steps that capture replay them. A step
    whose rows exceed the capture buffer runs outside the graphs and returns the same rows."""
    from vllm.config import CUDAGraphMode

    from interp_runner.plugin import runtime

    steering = {"global": {"base": {"post_block": {"layer": 7, "vector": vec(11).tolist()}}}}
    capture = [{"name": "gen", "hooks": ["post_block", "mlp_out"], "layers": [3, 7], "positions": "all_generated"}]
    cfg = config(PROMPTS[:2], steering=steering, capture=capture)
    with record_steps() as steps:
        _, in_graphs = fixed_shape_run(engine, cfg)
    REPORT.append("capture steps (tokens, reqs, mode, replays, overflowed): " + repr(steps))
    decode = [s for s in steps if s[0] == s[1]]
    assert decode, steps
    for scheduled, reqs, mode, replays, overflowed in decode:
        assert mode != CUDAGraphMode.NONE and replays >= 1 and not overflowed, steps
    sites = [site_id(layer, hook) for layer in (3, 7) for hook in ("post_block", "mlp_out")]
    for result in in_graphs:
        for site in sites:
            positions, values = result.captures[site]
            assert len(positions) == len(result.token_ids) - 1 and np.isfinite(values).all()

    state = runtime.active_state()
    kept = state.cap_out
    state.cap_out = torch.zeros((1, kept.shape[1]), dtype=kept.dtype, device=kept.device)
    try:
        with record_steps() as steps:
            _, direct = fixed_shape_run(engine, cfg)
    finally:
        state.cap_out = kept
    decode = [s for s in steps if s[0] == s[1]]
    assert decode and all(s[4] and s[2] == CUDAGraphMode.NONE and s[3] == 0 for s in decode), steps
    for a, b in zip(in_graphs, direct):
        assert a.token_ids == b.token_ids
        for site in sites:
            np.testing.assert_array_equal(a.captures[site][0], b.captures[site][0])
            err = rel_err(b.captures[site][1], a.captures[site][1])
            note("capture in graphs vs outside", err, ACT_FLOOR)
            assert err <= ACT_FLOOR, site
