"""The tokenizer as the compiler sees it: prompt ids, plain ids of an answer, character offsets, token texts."""

from __future__ import annotations

import functools
import os
from pathlib import Path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


class TokenizerError(ValueError):
    """The model folder's tokenizer cannot serve the config; ``key``: the config key at fault, if not the model."""

    def __init__(self, reason: str, key: str | None = None):
        super().__init__(reason)
        self.key = key


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npy")


def folder_signature(folder: Path) -> tuple:
    """Name, inode, size and modification time of each file in ``folder`` that a tokenizer may read (all but
    weights): a tokenizer loaded from it stays valid while this is unchanged."""
    with os.scandir(folder) as entries:
        files = [(e.name, e.inode(), e.stat()) for e in entries
                 if e.is_file() and not e.name.endswith(WEIGHT_SUFFIXES)]
    return tuple(sorted((name, inode, st.st_size, st.st_mtime_ns) for name, inode, st in files))


@functools.lru_cache(maxsize=8)
def _load_hf(folder: str, signature: tuple):
    """transformers' tokenizer of ``folder`` as it was at ``signature``, loaded once per process (a sweep's jobs, a
    server's requests and a test session's configs read the same folder over and over; encoding leaves it as it was)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


class TextTokenizer:
    def __init__(self, folder: Path, chat_template: bool = False):
        if not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
            raise TokenizerError(f"{folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")
        try:
            self.hf = _load_hf(str(Path(folder).resolve()), folder_signature(Path(folder)))
        except Exception as err:  # transformers raises many kinds for a missing or damaged tokenizer
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise TokenizerError(f"no usable tokenizer in {folder}: {reason}") from None
        self.chat_template = chat_template
        if chat_template:
            if not getattr(self.hf, "chat_template", None):
                raise TokenizerError(f"the tokenizer in {folder} has no chat template", key="prompts.chat_template")
            try:
                self("x")
            except Exception as err:  # a template that does not render fails for every prompt
                raise TokenizerError(f"the chat template in {folder} does not render: {err}",
                                     key="prompts.chat_template") from None

    def __call__(self, text: str) -> list[int]:
        """The prompt's token ids as the engine sees them."""
        if self.chat_template:
            return self.hf.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        return self.hf(text)["input_ids"]

    def plain(self, text: str) -> list[int]:
        """Ids of a continuation (an answer): no special tokens."""
        return self.hf(text, add_special_tokens=False)["input_ids"]

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """Character range of each prompt token (prompts without chat template)."""
        if self.chat_template:
            raise ValueError("token spans need prompts without chat_template")
        return [tuple(o) for o in self.hf(text, return_offsets_mapping=True)["offset_mapping"]]

    def token_texts(self, ids) -> list[str]:
        return [self.hf.decode([int(i)]) for i in ids]
