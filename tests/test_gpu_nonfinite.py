"""The non-finite flag on a CUDA GPU as it runs in production: SmolLM2 in bf16 with torch.compile and CUDA graphs.

The check of the final norm's input is compiled into the model's graph and its flag op captured in the CUDA graphs:
a request whose generated tokens are steered by 1e19 x a unit vector at every layer (each term accepted by the
config: its squares sum to 1e38) overflows the norms only in decode steps, which replay the graphs. The oracle is
plain HF transformers in float32 on the CPU (``hf_oracle``): the float32 sum of squares of the stream its final
norm reads, with the same steering.
"""

from __future__ import annotations

import numpy as np
import pytest

from support import hf_oracle
from conftest import build_engine
from interp_runner.sites import site_id
from interp_runner.vectors.load import random_direction
from test_gpu import HIDDEN, LAYERS, config, fixed_shape_run, record_steps, vec

pytestmark = [pytest.mark.gpu, pytest.mark.engine, pytest.mark.slow]

UNIT = random_direction(seed=7, norm=1.0, size=HIDDEN)
HUGE = 1e19
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def engine(smollm2_path):
    sites = tuple(site_id(layer, "post_block") for layer in range(LAYERS))
    eng = build_engine(smollm2_path, sites, (), dtype="bfloat16", enforce_eager=False, max_model_len=1024,
                       max_num_seqs=16, kv_cache_memory_bytes=2 << 30)
    yield eng
    eng.close()


def huge(tier: str) -> dict:
    return {tier: {"post_block": {"layer": "all", "vector": UNIT.tolist(), "scale": HUGE}}}


def test_requests_overflowing_in_graph_replayed_decode_steps_are_flagged_and_no_other(engine, smollm2_path):
    from vllm.config import CompilationMode, CUDAGraphMode

    compilation = engine.llm.llm_engine.vllm_config.compilation_config
    assert compilation.mode != CompilationMode.NONE and compilation.cudagraph_mode != CUDAGraphMode.NONE
    steering = {"request": [
        {"prompts": [0], "decode": {"post_block": {"layer": 7, "vector": vec(21).tolist()}}},  # steered, finite
        {"prompts": [1], **huge("decode")},  # overflows from its first generated token on
        {"prompts": [3], **huge("base")},  # overflows from its prompt on
    ]}
    sampling = {"max_tokens": MAX_TOKENS, "logprobs": 5}
    with record_steps() as steps:
        plan, results = fixed_shape_run(engine, config(steering=steering, sampling=sampling))
    _, plain = fixed_shape_run(engine, config(sampling=sampling))
    decode = [s for s in steps if s[0] == s[1]]
    assert len(decode) >= MAX_TOKENS - 1, steps
    for scheduled, reqs, mode, replays, captured in decode:
        assert mode != CUDAGraphMode.NONE and replays >= 1 and not captured, steps

    assert [r.nonfinite for r in results] == [False, True, False, True]
    assert not any(r.nonfinite for r in plain)
    # request 2 (unsteered) is bit for bit the unsteered run's; request 1's first token comes from its unsteered
    # prompt rows
    assert results[2].token_ids == plain[2].token_ids and results[2].logprobs == plain[2].logprobs
    assert results[1].token_ids[0] == plain[1].token_ids[0]

    # the oracle: HF's final norm input overflows on exactly the rows the engine's steering made huge
    for request, result in zip(plan.requests, results):
        index = request.prompt.index
        if index not in (1, 3):
            continue
        ids = list(request.prompt.token_ids)
        full = ids + result.token_ids[:-1]
        steer = {(layer, "post_block"): UNIT * np.float32(HUGE) for layer in range(LAYERS)}
        rows = np.arange(len(ids), len(full)) if index == 1 else None
        _, acts = hf_oracle.forward(smollm2_path, full, steer, rows)
        stream = acts[(LAYERS - 1, "post_block")].astype(np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            overflows = ~np.isfinite(np.square(stream).sum(axis=-1, dtype=np.float32))
        if index == 1:
            assert not overflows[: len(ids)].any() and overflows[len(ids):].all()
        else:
            assert overflows.all()


def test_a_read_back_copies_flags_without_waiting_for_a_step_queued_after_them():
    """A request released by the read-back itself (its results asked for before the runner's next step dropped it),
    while the engine's next step is still running on the device: its flag comes back at once, and its slot is
    zeroed only once that step has ended, before the slot's next owner."""
    import time
    from types import SimpleNamespace as NS

    import torch

    from interp_runner.plugin.nonfinite import ResultFlags
    from interp_runner.plugin.staging import PinnedRing

    device = torch.device("cuda")
    flags = ResultFlags(32, device, PinnedRing.for_device(device), True)
    bad, good = NS(rid="bad", cells=None, flag_slot=0), NS(rid="good", cells=None, flag_slot=0)
    flags.acquire(bad)
    flags.acquire(good)
    flags.plan(np.array([bad.flag_slot, good.flag_slot]), [], np.array([0, 1, 2]), np.array([0, 0]), 2, 2, None)
    flags.flag_rows(torch.tensor([True, False], device=device))
    slot = bad.flag_slot
    torch.cuda.synchronize()  # the requests' last step has ended, as their outputs reached the host
    torch.cuda._sleep(2_000_000_000)  # the next step, queued on the engine's stream: about a second
    flags.release(bad)
    flags.release(good)
    t0 = time.perf_counter()
    got = flags.collect(["bad", "good"])
    waited = time.perf_counter() - t0
    assert got == {"bad": True, "good": False}
    assert waited < 0.1, f"the read-back waited {waited:.3f} s for the step queued after the requests"
    torch.cuda.synchronize()
    assert int(flags.flags[slot]) == 0  # zeroed after that step, on the device
