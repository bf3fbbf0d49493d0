"""Teacher forcing (``sampling.teacher_forcing: STORE``): each request generates the tokens that the request of the
same id generated in STORE, so its log-probabilities, top-k and captures are this run's for those tokens.

``interp-verify --rerun`` forces a rerun on another kernel path to the store's tokens: greedy generation there may
fork at a near tie, after which nothing would be comparable. The tokens travel in each request's payload
(``force``); the engine's sampler applies them (``interp_runner.plugin.forcing``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from interp_runner.config.errors import ConfigError
from interp_runner.contracts import PAYLOAD_KEY, RequestPayload
from interp_runner.payload import pack_positions

WHERE = "sampling.teacher_forcing"


def generated_tokens(path: Path) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Request id -> (prompt token ids, generated token ids) of a finished store."""
    import zarr

    try:
        group = zarr.open_group(str(path), mode="r")
        status = group.attrs.get("status")
        rids = [str(r) for r in group["request"][:]]
        prompts, prompt_len = group["prompt_tokens"][:], group["prompt_len"][:]
        tokens, generated = group["tokens"][:], group["num_generated"][:]
    except Exception as err:  # zarr raises several kinds for a missing folder, array or chunk
        raise ConfigError.at(WHERE, f"{path} is not a store with generated tokens ({type(err).__name__}: {err})")
    if status != "complete":
        raise ConfigError.at(WHERE, f"{path} is not complete (status {status!r})")
    return {rid: (tuple(int(t) for t in prompts[i, : prompt_len[i]]), tuple(int(t) for t in tokens[i, : generated[i]]))
            for i, rid in enumerate(rids)}


def force_generations(requests: Sequence, path: Path) -> None:
    """Give each request (``compiler.EngineRequest``) the tokens its namesake in the store at ``path`` generated."""
    source = generated_tokens(path)
    for r in requests:
        if r.rid not in source:
            raise ConfigError.at(WHERE, f"{path} has no request {r.rid}")
        prompt, generated = source[r.rid]
        if prompt != tuple(r.prompt.token_ids):
            raise ConfigError.at(WHERE, f"request {r.rid} of {path} had another prompt")
        if len(generated) > r.sampling["max_tokens"]:
            raise ConfigError.at(WHERE, f"request {r.rid} of {path} generated {len(generated)} tokens, more than "
                                        f"sampling.max_tokens ({r.sampling['max_tokens']})")
        if not generated:
            continue
        extra = r.sampling.get("extra_args") or {PAYLOAD_KEY: RequestPayload(r.rid)}
        extra[PAYLOAD_KEY].force = pack_positions(np.asarray(generated))
        r.sampling["extra_args"] = extra
