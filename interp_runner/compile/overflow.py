"""Float32 overflow that a config makes certain: a residual stream whose sum of squares passes float32's range makes
the model's norms overflow. The compiler refuses such steering before the engine starts; the store's non-finite flags
(``interp_runner.store.result_flags``) catch what it cannot foresee."""

from __future__ import annotations

import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)  # the norms sum squares in float32, whatever the model's dtype


def squares(scale: float, vector: np.ndarray | None = None) -> float:
    """The sum of squares of ``scale`` x ``vector`` (of ``scale`` alone without one), exact in float64: beyond
    ``FLOAT32_MAX``, a residual stream holding it makes the model's norms overflow (their output zeros, every logit
    the same)."""
    if vector is None:
        return float(scale) ** 2
    return float(np.sum(np.square(np.asarray(vector, dtype=np.float64) * float(scale))))


def overflow_reason(total: float) -> str:
    return (f"its sum of squares is {total:.3g}, beyond float32's range (about 3.4e38): the model's norms would "
            "overflow (their output zeros, every logit the same) and no result would be a number")
