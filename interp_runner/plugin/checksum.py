"""The rank checksum: what a worker applied, folded into one running digest that the runner compares across ranks."""

from __future__ import annotations

import hashlib

import numpy as np


class RankChecksum:
    """Every component folds what it applies (registered vectors and sources, steering slots, patch entries, capture
    and keep rows, packed sequences, per step) under a tag; ranks that applied the same get the same digest. An
    engine of one rank has nothing to compare: it folds nothing (hashing a trace's step layouts costs its host
    milliseconds a run) and counts its steps alone."""

    __slots__ = ("_digest", "steps", "fold")

    def __init__(self, ranks: int) -> None:
        self._digest = hashlib.blake2b(digest_size=16)
        self.steps = 0  # steps that applied anything
        self.fold = self._fold if ranks > 1 else _ignore

    def _fold(self, tag: bytes, *arrays) -> None:
        update = self._digest.update
        update(tag)
        for a in arrays:
            update(np.ascontiguousarray(a).tobytes())

    def as_dict(self) -> dict:
        return {"digest": self._digest.hexdigest(), "steps": self.steps}


def _ignore(tag: bytes, *arrays) -> None:
    """``fold`` where there is one rank."""
