"""The per-request payload carried in ``SamplingParams.extra_args[PAYLOAD_KEY]``, and the engine-wide spec.

This module is the contract between the compiler (runner side) and the plugin (engine side); it is pure data.

Request payload (msgpack-able)::

    {"rid": "r00003",                                   # stable id of the request in the plan
     "steer": [[site, phases, vector_key, scale], ...], # phases: PREFILL | DECODE bit mask
     "capture": [[sites, prompt_positions, generated]]} # prompt_positions: int32 bytes

Vectors are registered on the workers once per engine, keyed by the sha256 of their float32 bytes.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass

import numpy as np

PAYLOAD_KEY = "interp"
ENGINE_KEY = "interp"
PREFILL = 1
DECODE = 2


def vector_key(vector: np.ndarray) -> str:
    data = np.ascontiguousarray(vector, dtype=np.float32).tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


def pack_positions(positions) -> bytes:
    return np.asarray(positions, dtype=np.int32).tobytes()


def unpack_positions(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.int32)


@dataclass(frozen=True)
class EngineSpec:
    """What the engine must be built with: the sites that carry ops (fixed for the engine's lifetime)."""

    steer_sites: tuple[int, ...]
    capture_sites: tuple[int, ...]

    def as_additional_config(self) -> dict:
        return {
            ENGINE_KEY: {
                "plugin": plugin_fingerprint(),
                "steer_sites": list(self.steer_sites),
                "capture_sites": list(self.capture_sites),
            }
        }


def plugin_fingerprint() -> str:
    """Hash of the plugin's source: part of vLLM's compile-cache key, so no stale graph is reused."""
    from interp_runner import plugin, sites
    from interp_runner.plugin import layers, ops, runtime

    import interp_runner_kernels.reference as reference

    h = hashlib.sha256()
    for module in (plugin, layers, ops, runtime, reference, sites):
        h.update(inspect.getsource(module).encode())
    return h.hexdigest()[:16]
