"""Stand-ins for the plugin's step planner (``InterpState``) without an engine: a planner on a stand-in vLLM config,
worker-side requests carrying payloads, and a V1 runner's view of one step."""

from __future__ import annotations

from types import SimpleNamespace as NS


def engine_config(hidden: int) -> NS:
    """The parts of vLLM's config the planner reads: a rank of two, so that its checksum folds what it applies."""
    import torch

    return NS(model_config=NS(hf_text_config=NS(hidden_size=hidden), dtype=torch.float32),
              scheduler_config=NS(max_num_batched_tokens=64, max_num_seqs=8), parallel_config=NS(world_size=2))


def planner(hidden=16, sites=(4, 9)):
    from unittest import mock

    import vllm.distributed

    from interp_runner.plugin import runtime

    cfg = engine_config(hidden)
    with mock.patch.object(vllm.distributed, "get_tensor_model_parallel_rank", lambda: 0):
        return runtime.InterpState(cfg, {"plugin": "test", "steer_sites": list(sites), "capture_sites": [sites[0]]})


def applied(state, x, site: int, extra=None):
    """A copy of x after the site's op, which works in place (x itself is left as it was)."""
    out = x.clone()
    state.apply_site(out, extra, site)
    return out


def request(payload, prompt_len: int):
    """A worker-side request as the planner reads it: its payload (a ``RequestPayload`` or None) as it travels."""
    from interp_runner.contracts import encode_payload

    extra = {"interp": encode_payload(payload)} if payload is not None else None
    return NS(sampling_params=NS(extra_args=extra), num_prompt_tokens=prompt_len)


def runner(requests: dict, step: list[tuple[str, int, int]]):
    """The planner's view of one step of a V1 model runner: ``step`` lists (request id, first position, rows) in
    batch order."""
    import numpy as np

    from interp_runner.plugin.runner_view import V1RunnerView

    counts = [rows for _, _, rows in step]
    return V1RunnerView(NS(requests=requests,
                           input_batch=NS(num_reqs=len(step), req_ids=[rid for rid, _, _ in step],
                                          num_computed_tokens_cpu=np.array([first for _, first, _ in step], np.int32)),
                           query_start_loc=NS(np=np.concatenate([[0], np.cumsum(counts)]).astype(np.int32))))
