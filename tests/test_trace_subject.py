"""Causal tracing's subject: its token positions, found here from the tokenizer alone (never from the product's
span), are the ones the store names and the noise corrupts, and the grid matches plain HF hooks that corrupt them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from test_causal_trace import FACTS, run_packed, trace_config
from test_causal_trace_hf import hf_trace
from interp_runner.kinds.causal_trace.grids import trace_dataset


def subject_tokens(tokenizer, prompt: str, subject: str) -> list[int]:
    """The subject's token positions, found by tokenizing the text before it and through it: the tokens the
    prompt shares with the text through the subject, less those it shares with the text before it."""
    ids = tokenizer(prompt)["input_ids"]
    start = prompt.index(subject)
    before = tokenizer(prompt[:start].rstrip(" "))["input_ids"] if prompt[:start].strip() else []
    through = tokenizer(prompt[: start + len(subject)])["input_ids"]
    assert ids[: len(before)] == before and ids[: len(through)] == through, (prompt, subject)
    assert tokenizer.decode(through[len(before):]).strip() == subject
    return list(range(len(before), len(through)))


@pytest.mark.engine
def test_subject_positions_and_the_grid_match_hf_at_independently_found_subject_tokens(tiny_engine, tiny_path):
    """The subject's tokens, found here from the tokenizer alone (not from the product's span), are the ones the
    store names, the ones the noise goes on and the ones the grid's HF oracle corrupts (the subject at the start
    of a prompt and inside it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_path))
    config = trace_config("tiny_random", components=["resid", "mlp", "attn"], layers=[0, 2], window=2, num_facts=2,
                          noise={"samples": 1, "seed": 1}, filter=False, plots=False)
    plan, results = run_packed(tiny_engine, config, False)
    ds = trace_dataset(plan, results)
    rows = [json.loads(line) for line in FACTS.read_text().splitlines()[:2]]
    spans = [subject_tokens(tokenizer, row["prompt"], row["subject"]) for row in rows]
    assert [s[0] for s in spans] == [3, 0]  # the subject inside the prompt, and first
    for fact, row, subject in zip(plan.layout.facts, rows, spans):
        f = fact.index
        ids = tokenizer(row["prompt"])["input_ids"]
        assert list(fact.clean.token_ids) == ids
        assert list(fact.subject_positions) == subject
        assert (int(ds["subject_start"][f]), int(ds["subject_end"][f])) == (subject[0], subject[-1] + 1)
        cells = [(k, lay, t) for k in ("resid", "mlp", "attn") for lay in (0, 2) for t in range(len(ids))]
        want, want_corrupt = hf_trace(tiny_path, ids, subject, ds["noise"].values[f, 0, : len(subject)],
                                      fact.clean.answer_ids[0], cells, window=2)
        got = [float(ds["restored_logprob_samples"].sel(component=k, layer=lay).values[f, t, 0]) for k, lay, t in cells]
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
        assert float(ds["corrupt_logprob_samples"].values[f, 0]) == pytest.approx(want_corrupt, abs=1e-4)
        # noise one token off moves the corrupted score far beyond the tolerance
        shifted = [p + 1 for p in subject]
        _, off = hf_trace(tiny_path, ids, shifted, ds["noise"].values[f, 0, : len(subject)],
                          fact.clean.answer_ids[0], [], window=2)
        assert abs(off - want_corrupt) > 1e-2
