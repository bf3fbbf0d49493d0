"""Teacher forcing in vLLM's V2 sampler (``vllm/v1/worker/gpu/sample/sampler.py``).

V2 refuses custom logits processors (V1 forces tokens with one: ``plugin.forcing``). Its sampler keeps each
request's sampling state in the request's slot, set in ``add_request``; there the forced tokens of a payload with
``force`` are kept by slot. ``apply_sampling_params`` returns the logits V2 samples from (its raw logits, copied
first where log-probabilities are returned): a forced row's every logit but its next forced token's becomes -inf
there. The log-probabilities V2 returns are the raw logits' (``logprobs_mode`` raw_logprobs, vLLM's default): a
forced token's log-probability and its step's top-k are the model's, as under V1. A row at position ``p`` of a
request of prompt length ``n`` samples its generated token ``p + 1 - n``.
"""

from __future__ import annotations

import torch

from interp_runner.plugin.forcing import ForcedTokens

FORCED_ATTR = "_interp_forced"  # on a sampler: slot -> (forced tokens, prompt length)


def _force(logits: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, forced: dict) -> None:
    rows, tokens = [], []
    for row, (slot, p) in enumerate(zip(slots.tolist(), pos.tolist())):
        entry = forced.get(slot)
        if entry is None:
            continue
        ids, prompt_len = entry
        k = p + 1 - prompt_len
        if 0 <= k < len(ids):
            rows.append(row)
            tokens.append(ids[k])
    if rows:
        rows_t = torch.tensor(rows, dtype=torch.long, device=logits.device)
        tokens_t = torch.tensor(tokens, dtype=torch.long, device=logits.device)
        logits[rows_t] = float("-inf")
        logits[rows_t, tokens_t] = 0.0


def instrument() -> None:
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    if "_interp_original_add_request" in Sampler.__dict__:
        return
    add, apply = Sampler.add_request, Sampler.apply_sampling_params
    Sampler._interp_original_add_request = add

    def add_request(self, req_idx, prompt_len, sampling_params):
        add(self, req_idx, prompt_len, sampling_params)
        forced = self.__dict__.setdefault(FORCED_ATTR, {})
        entry = ForcedTokens._forced(sampling_params, None, None)
        if entry is None:
            forced.pop(req_idx, None)
        else:
            forced[req_idx] = (entry[0], prompt_len)

    def apply_sampling_params(self, logits, expanded_idx_mapping, idx_mapping_np, pos, *args, **kwargs):
        out = apply(self, logits, expanded_idx_mapping, idx_mapping_np, pos, *args, **kwargs)
        forced = self.__dict__.get(FORCED_ATTR)
        if forced and any(int(slot) in forced for slot in idx_mapping_np):
            _force(out, expanded_idx_mapping, pos, forced)
        return out

    Sampler.add_request = add_request
    Sampler.apply_sampling_params = apply_sampling_params
