"""Steering directions from contrastive pairs of activations: ``positive[i]`` and ``negative[i]`` are one pair's
two activations at one site. Computed in float64, returned as float32 (the engine's precision).

- ``mean_diff``: the mean over pairs of positive - negative (contrastive activation addition, Rimsky et al. 2023).
- ``pca``: the first principal component of the paired differences, centred as sklearn's ``PCA`` does (repeng's
  ``pca_diff``), of unit norm, signed so that positives project higher than their negatives in most pairs
  (repeng's rule); on a tie, its largest-magnitude component is positive (sklearn's sign convention).
"""

from __future__ import annotations

import numpy as np

METHODS = ("mean_diff", "pca")


class DegenerateDirection(ValueError):
    """The pairs define no direction (PCA of differences that do not vary)."""


def _differences(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    positive, negative = np.asarray(positive, np.float64), np.asarray(negative, np.float64)
    if positive.shape != negative.shape or positive.ndim != 2 or not len(positive):
        raise ValueError(f"need two [pairs, hidden] arrays of one shape, got {positive.shape} and {negative.shape}")
    return positive - negative


def mean_diff(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    return _differences(positive, negative).mean(axis=0).astype(np.float32)


def pca(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    diffs = _differences(positive, negative)
    centred = diffs - diffs.mean(axis=0)
    _, singular, vt = np.linalg.svd(centred, full_matrices=False)
    if not len(singular) or singular[0] <= 0:
        raise DegenerateDirection(f"the {len(diffs)} paired differences do not vary: they have no principal component")
    direction = vt[0] / np.linalg.norm(vt[0])
    projected = diffs @ direction  # positive minus negative, projected
    higher, lower = int((projected > 0).sum()), int((projected < 0).sum())
    if lower > higher or (lower == higher and direction[np.argmax(np.abs(direction))] < 0):
        direction = -direction
    return direction.astype(np.float32)


def derive(method: str, positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    if method == "mean_diff":
        return mean_diff(positive, negative)
    if method == "pca":
        return pca(positive, negative)
    raise ValueError(f"unknown method {method!r} (one of {', '.join(METHODS)})")
