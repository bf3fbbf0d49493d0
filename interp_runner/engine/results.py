"""What the engine returns for each request (``RequestResult``): tokens, log-probabilities, captures, scores and
flags. Pure data: the store and the kinds read it without starting vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    rid: str
    prompt_index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]  # of each sampled token
    top_logprobs: list[list[tuple[int, float]]] | None = None
    captures: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # site -> (positions, values)
    score: dict | None = None  # token_ids, logprobs (exact, any rank), top_id, top_logprob
    void: str | None = None  # why its patches could not be applied: it must not count as patched
    # computed through a non-finite value (the final norm's input, or the logits it was scored from): its numbers are
    # artifacts, never results
    nonfinite: bool = False
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
