"""Teacher forcing in vLLM's sampler: a request whose payload lists ``force`` tokens generates exactly those.

Before sampling, every logit of such a request's row but its next forced token's is set to -inf. vLLM computes
the log-probabilities it returns (sampled token and top-k) from the raw logits, before any logits processor: a
forced token's log-probability and its step's top-k are the model's. The engine loads this processor only for
plans that force tokens (``EngineSpec.force_tokens``): vLLM keeps every request's output tokens on the host for
custom processors, a sync per step on a GPU.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from interp_runner.contracts import payload_of
from interp_runner.payload import unpack_positions


class ForcedTokens(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool):
        self.device = device
        self.forced: dict[int, tuple[list[int], list[int]]] = {}  # batch row -> (forced tokens, its output so far)

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the greedy choice

    @staticmethod
    def _forced(params, prompt_ids, output_ids) -> tuple[list[int], list[int]] | None:
        payload = payload_of(params)
        force = payload.force if payload is not None else None
        return (unpack_positions(force).tolist(), output_ids) if force else None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.forced, batch_update, self._forced)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows, tokens = [], []
        for row, (forced, output) in self.forced.items():
            if len(output) < len(forced):
                rows.append(row)
                tokens.append(forced[len(output)])
        if rows:
            rows_t = torch.tensor(rows, dtype=torch.long, device=logits.device)
            tokens_t = torch.tensor(tokens, dtype=torch.long, device=logits.device)
            logits[rows_t] = float("-inf")
            logits[rows_t, tokens_t] = 0.0
        return logits
