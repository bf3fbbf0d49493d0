"""Selectors of layers, prompts and token positions, checked against the model and the prompts: an index out of
range or given twice is a config error naming its key, never clamped or merged."""

from __future__ import annotations

import re

from interp_runner.config.errors import ConfigError

LAYER_RANGE = re.compile(r"([0-9]*):([0-9]*)")


def parse_layers(selector, num_layers: int, where: str) -> list[int]:
    """An int, a list of distinct ints, "all" or "a:b" (layers a to b - 1; either end may be left out), each layer
    within the model: nothing is clamped."""
    if isinstance(selector, str):
        if selector == "all":
            return list(range(num_layers))
        match = LAYER_RANGE.fullmatch(selector)
        if match is None:
            raise ConfigError.at(where, f"{selector!r} is not a layer selector (an int, a list, 'all' or 'a:b')")
        start, stop = int(match[1] or 0), int(match[2] or num_layers)
        if start >= num_layers or stop > num_layers:
            raise ConfigError.at(where, f"{selector!r} out of range, model has {num_layers} layers "
                                        f"('a:b' selects layers a to b - 1)")
        if start >= stop:
            raise ConfigError.at(where, f"{selector!r} selects no layer, model has {num_layers} layers")
        return list(range(start, stop))
    return _listed(selector, num_layers, where, "layers",
                   lambda layer: f"{layer} out of range, model has {num_layers} layers")


def parse_prompts(selector, num_prompts: int, where: str) -> list[int]:
    if selector == "all":
        return list(range(num_prompts))
    return _listed(selector, num_prompts, where, "prompts",
                   lambda index: f"prompt {index} out of range, there are {num_prompts} prompts")


def _listed(selector, count: int, where: str, noun: str, out_of_range) -> list[int]:
    """An int or a list of ints, each in [0, count) and given once; the key of the first that is not."""
    indices = [selector] if isinstance(selector, int) else list(selector)
    if len(set(indices)) != len(indices):
        raise ConfigError.at(where, f"{noun} repeat: {indices}")
    for i, index in enumerate(indices):
        if not 0 <= index < count:
            raise ConfigError.at(where if isinstance(selector, int) else f"{where}[{i}]", out_of_range(index))
    return indices


def distinct_positions(selector: list[int], prompt, where: str) -> list[int]:
    """Listed token positions of a prompt (negative: from its end), each within the prompt and given once."""
    n = len(prompt.token_ids)
    first: dict[int, int] = {}  # position -> the index in the list that gave it
    for i, pos in enumerate(selector):
        name = f"prompt {prompt.index} ({prompt.id!r}, {n} tokens)"
        if not -n <= pos < n:
            raise ConfigError.at(f"{where}[{i}]", f"position {pos} is beyond {name}")
        if pos % n in first:
            raise ConfigError.at(f"{where}[{i}]", f"position {pos} repeats position {selector[first[pos % n]]} of {name}")
        first[pos % n] = i
    return sorted(first)
