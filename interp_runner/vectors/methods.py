"""Steering directions from contrastive pairs of activations: ``positive[i]`` and ``negative[i]`` are one pair's
two activations at one site. Computed in float64, returned as float32 (the engine's precision).

- ``mean_diff``: the mean over pairs of positive - negative (contrastive activation addition, Rimsky et al. 2023).
- ``pca``: the first principal component of the paired differences, centred as sklearn's ``PCA`` does (repeng's
  ``pca_diff``), of unit norm, signed so that the mean difference projects non-negatively on it (so ``+pca``
  steers the average pair the way ``+mean_diff`` does); where that projection is within ``DEGENERATE_BELOW`` of
  the activations' scale, so that positives project higher than their negatives in most pairs (repeng's rule),
  and on a tie, so that its largest-magnitude component is positive (sklearn's sign convention).

**Degenerate**: the pairs define no direction where the size of what a method reads is at most ``DEGENERATE_BELOW``
times the activations' scale (``activation_scale``: the mean norm of the pairs' activations): the norm of the mean
difference for ``mean_diff``, the spread of the differences along their first principal component (its root mean
square, ``singular value / sqrt(pairs)``) for ``pca``. Below it a "direction" is rounding noise of the kernels
(identical texts differ by about 1e-7 of their norm in float32), never a result.
"""

from __future__ import annotations

import numpy as np

METHODS = ("mean_diff", "pca")
DEGENERATE_BELOW = 1e-4  # of the activations' mean norm


class DegenerateDirection(ValueError):
    """The pairs define no direction at this site (differences within rounding noise of the activations)."""


def _differences(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    positive, negative = np.asarray(positive, np.float64), np.asarray(negative, np.float64)
    if positive.shape != negative.shape or positive.ndim != 2 or not len(positive):
        raise ValueError(f"need two [pairs, hidden] arrays of one shape, got {positive.shape} and {negative.shape}")
    return positive - negative


def activation_scale(positive: np.ndarray, negative: np.ndarray) -> float:
    """The mean norm of the pairs' activations (both sides): what a direction's size is judged against."""
    rows = np.concatenate([np.asarray(positive, np.float64), np.asarray(negative, np.float64)])
    return float(np.linalg.norm(rows, axis=-1).mean())


def _refuse_below(size: float, scale: float, what: str) -> None:
    if not size > DEGENERATE_BELOW * scale:
        raise DegenerateDirection(f"{what} is {size:.3g}, {size / scale if scale else 0:.2g} of the activations' "
                                  f"mean norm {scale:.3g} (at most {DEGENERATE_BELOW:g}: rounding noise, no direction)")


def mean_diff(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    mean = _differences(positive, negative).mean(axis=0)
    _refuse_below(float(np.linalg.norm(mean)), activation_scale(positive, negative), "the mean difference's norm")
    return mean.astype(np.float32)


def pca(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    diffs = _differences(positive, negative)
    scale = activation_scale(positive, negative)
    centred = diffs - diffs.mean(axis=0)
    _, singular, vt = np.linalg.svd(centred, full_matrices=False)
    spread = float(singular[0]) / np.sqrt(len(diffs)) if len(singular) else 0.0
    _refuse_below(spread, scale, f"the spread of the {len(diffs)} paired differences along their first component")
    direction = vt[0] / np.linalg.norm(vt[0])
    projected = diffs @ direction  # positive minus negative, projected
    mean = float(projected.mean())
    if abs(mean) > DEGENERATE_BELOW * scale:
        flip = mean < 0
    else:
        higher, lower = int((projected > 0).sum()), int((projected < 0).sum())
        flip = lower > higher or (lower == higher and direction[np.argmax(np.abs(direction))] < 0)
    return (-direction if flip else direction).astype(np.float32)


def pair_projections(positive: np.ndarray, negative: np.ndarray, vector: np.ndarray) -> np.ndarray:
    """Each pair's positive - negative projected on ``vector``'s unit direction, [pairs]."""
    unit = np.asarray(vector, np.float64)
    return _differences(positive, negative) @ (unit / np.linalg.norm(unit))


def derive(method: str, positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """``method``'s vector; ``DegenerateDirection`` where the pairs define none."""
    if method == "mean_diff":
        return mean_diff(positive, negative)
    if method == "pca":
        return pca(positive, negative)
    raise ValueError(f"unknown method {method!r} (one of {', '.join(METHODS)})")
