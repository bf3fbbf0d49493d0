"""Prompts as the kinds compile them: the prompt list of a config, the token an answer is scored by, request ids,
and the checks every prompt must pass against the model (vocabulary, length, a chat template where characters
are looked up). Below every experiment kind; no engine needed."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from interp_runner.config.errors import ConfigError
from interp_runner.config.schema import PromptRow, RunBase, resolve_path
from interp_runner.compile.inputs import read_rows
from interp_runner.compile.requests import Prompt


def load_prompts(cfg: RunBase, tokenize: Callable[[str], Sequence[int]], base: Path | None) -> list[Prompt]:
    if cfg.prompts.file is not None:
        items = read_rows(resolve_path(cfg.prompts.file, base), "prompts.file", PromptRow)
        where = "prompts.file"
    else:
        items = [PromptRow(text=p) if isinstance(p, str) else p for p in cfg.prompts.items]
        where = "prompts.items"
    if not items:
        raise ConfigError.at("prompts", "empty prompt list")
    index_of: dict[str, int] = {}
    return [prompt_of_row(i, item, where, "p", index_of, tokenize, cfg.scoring.first_token)
            for i, item in enumerate(items)]


def prompt_of_row(i: int, row, where: str, id_prefix: str, index_of: dict[str, int],
                  tokenize: Callable[[str], Sequence[int]], first_token: bool) -> Prompt:
    """Prompt ``i`` of the rows at ``where`` (``text``, optional ``id``, ``answer``, ``foil``): its id (default
    ``id_prefix`` + i) unique among ``index_of``, which it joins; its text tokenized; its answer and foil each scored
    by one token."""
    pid = row.id or f"{id_prefix}{i}"
    if pid in index_of:
        raise ConfigError.at(f"{where}[{i}].id", f"id {pid!r} is prompt {index_of[pid]}'s already")
    index_of[pid] = i
    token_ids = tuple(int(t) for t in tokenize(row.text))
    if not token_ids:
        raise ConfigError.at(f"{where}[{i}]", f"{row.text!r} tokenizes to nothing")
    scored = tuple(answer_token(tokenize, text, f"{where}[{i}].{key}", first_token)
                   for key, text in (("answer", row.answer), ("foil", row.foil)) if text is not None)
    return Prompt(index=i, id=pid, text=row.text, token_ids=token_ids, answer_ids=scored)


def answer_token(tokenizer, text: str, where: str, first_token: bool) -> int:
    """The single token an answer is scored by."""
    ids = tokenizer.plain(text)
    if not ids:
        raise ConfigError.at(where, f"{text!r} tokenizes to nothing")
    if len(ids) > 1 and not first_token:
        raise ConfigError.at(
            where, f"{text!r} is {len(ids)} tokens {list(ids)}; scoring needs one (or scoring.first_token: true)"
        )
    return int(ids[0])


def prompt_rid(index: int) -> str:
    return f"r{index:05d}"


def check_vocabulary(prompts: Sequence[Prompt], vocab_size: int, where: str) -> None:
    """Every token id within the model's embedding table (a tokenizer that is not the weights' fails in vLLM)."""
    for p in prompts:
        beyond = [t for t in p.token_ids + p.answer_ids if not 0 <= t < vocab_size]
        if beyond:
            raise ConfigError.at(f"{where}[{p.index}]", f"token id {beyond[0]} is beyond the model's vocabulary "
                                                        f"({vocab_size} tokens): its tokenizer is not its weights'")


def check_length(cfg: RunBase, prompts: Sequence[Prompt], max_tokens: int) -> None:
    max_len = max(len(p.token_ids) for p in prompts) + max_tokens
    if max_len > cfg.engine.max_model_len:
        raise ConfigError.at(
            "engine.max_model_len",
            f"{cfg.engine.max_model_len} is too small: longest prompt + sampling.max_tokens = {max_len}",
        )


def require_plain_prompts(cfg: RunBase, where: str, why: str) -> None:
    """Character spans (span positions, causal-trace subjects) need prompts that are the text as written: ``why``
    the key ``where`` cannot be used with ``prompts.chat_template``."""
    if cfg.prompts.chat_template:
        raise ConfigError.at(where, why)
