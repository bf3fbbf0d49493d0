"""Helpers of the payload (``interp_runner.contracts``): keys, digests, packed columns, and the engine-wide spec.

The records themselves (``RequestPayload`` and its parts, ``PluginSpec``) are ``interp_runner.contracts``'s; this
module holds what both sides compute from them. Pure data, free of torch and vLLM.

Steering vectors are registered on the workers once per engine, keyed by the sha256 of their float32 bytes;
patch sources likewise, in a bank of rows that stays on the workers while requests use them. A source key may be
a reference ``ref:<run digest>:<site>:<position>`` (``ref_key``) to a value an earlier request computes: that
request's ``keep`` has the workers copy it into the bank on the device, in the step that computes it, where it
stays until the runner releases the key.
``kv`` ranges (end -1: open) feed the prefix-cache block hashes, so KV is shared only between requests whose
interventions up to the end of a block are the same; blocks reaching past ``kv_private`` are never shared.
``start`` says that below its ``layer`` the request computes what its ``run`` computes at the same positions
(a causal-trace cell restores nothing below its lowest restored layer): where the engine runs cells packed, their
segments enter the model at ``layer`` with the residual stream the run keeps there (``keep`` at ``pre_attn`` of
that layer), and skip the layers below. ``reuse`` says the same of its positions before its ``position``, at every
layer: packed, a cell computes none of them; the KV its run keeps (``keep`` with ``kv``) is copied into their slots.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np

from interp_runner.contracts import PluginSites, PluginSpec, spec_config

REF_PREFIX = "ref:"


KV_PREFIX = "kv:"


def kv_key(run_digest: str) -> str:
    """The key of the prompt KV that the run ``run_digest`` keeps on the workers (released like a source)."""
    return f"{KV_PREFIX}{run_digest}"


def vector_key(vector: np.ndarray) -> str:
    data = np.ascontiguousarray(vector, dtype=np.float32).tobytes()
    return hashlib.sha256(data).hexdigest()[:32]


def ref_key(run_digest: str, site: int, position: int) -> str:
    """The source key of the value that the run ``run_digest`` (its tokens and steering) computes at ``site`` and
    ``position``."""
    return f"{REF_PREFIX}{run_digest}:{site}:{position}"


def digest(obj) -> str:
    """A short content hash of a JSON-able value."""
    return hashlib.sha256(json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()).hexdigest()[:24]


def pack_positions(positions) -> bytes:
    return np.asarray(positions, dtype=np.int32).tobytes()


def unpack_positions(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.int32)


class EngineSpec(PluginSites, frozen=True, kw_only=True):
    """What the engine must be built with: the plugin's sites and rows (fixed for the engine's lifetime), and
    whether some request forces tokens (the sampler's processor is loaded)."""

    force_tokens: bool = False  # some request's payload has ``force``

    def as_additional_config(self, results_with_outputs: bool = False) -> dict:
        sites = {f: getattr(self, f) for f in PluginSites.__struct_fields__}
        return spec_config(PluginSpec(**sites, plugin=plugin_fingerprint(), results_with_outputs=results_with_outputs))

    def union(self, other: EngineSpec) -> EngineSpec:
        """A spec with the sites of both and the larger bank."""
        return EngineSpec(
            tuple(sorted(set(self.steer_sites) | set(other.steer_sites))),
            tuple(sorted(set(self.capture_sites) | set(other.capture_sites))),
            tuple(sorted(set(self.patch_sites) | set(other.patch_sites))),
            max(self.bank_rows, other.bank_rows),
            max(self.kv_rows, other.kv_rows),
            max(self.kv_runs, other.kv_runs),
            force_tokens=self.force_tokens or other.force_tokens,
        )

    def covers(self, other: EngineSpec) -> bool:
        return (
            set(other.steer_sites) <= set(self.steer_sites)
            and set(other.capture_sites) <= set(self.capture_sites)
            and set(other.patch_sites) <= set(self.patch_sites)
            and other.bank_rows <= self.bank_rows
            and other.kv_rows <= self.kv_rows
            and other.kv_runs <= self.kv_runs
            and (self.force_tokens or not other.force_tokens)
        )


def plugin_fingerprint() -> str:
    """Hash of the plugin's source: part of vLLM's compile-cache key, so no stale graph is reused. The files are
    read, not imported (this module stays free of torch and vLLM): every module of ``interp_runner.plugin``,
    ``interp_runner.sites`` and the kernels package, each under its name, in sorted order."""
    package = Path(__file__).resolve().parent
    kernels = importlib.util.find_spec("interp_runner_kernels")  # located, not imported
    files = [(f"plugin/{p.relative_to(package / 'plugin').as_posix()}", p) for p in (package / "plugin").rglob("*.py")]
    files.append(("sites.py", package / "sites.py"))
    if kernels is None or not kernels.submodule_search_locations:
        raise ImportError("the interp_runner_kernels package is not installed")
    root = Path(next(iter(kernels.submodule_search_locations)))
    files += [(f"kernels/{p.name}", p) for p in root.glob("*.py")]
    h = hashlib.sha256()
    for name, path in sorted(files):
        data = path.read_bytes()
        h.update(f"{name}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:16]
