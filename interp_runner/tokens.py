"""The tokenizer as the compiler sees it: prompt ids, plain ids of an answer, character offsets, token texts."""

from __future__ import annotations

from pathlib import Path


class TextTokenizer:
    def __init__(self, folder: Path, chat_template: bool = False):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(str(folder))
        self.chat_template = chat_template

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
