"""A compiled experiment: its engine requests in stages and what its kind needs to turn their results into a store.
Below every experiment kind; no engine needed.

A plan runs in stages: stage 0 holds the requests that need nothing computed before them; a later stage may patch
in values an earlier one computed and the workers kept (``refs`` says which request, site and position each source
reference stands for; a ``kv_key`` stands for a request's prompt KV, with site and position -1), or steer with
vectors derived from the earlier stages' results (``derive_vectors``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from interp_runner.config.errors import ConfigError
from interp_runner.config.schema import RunBase
from interp_runner.models.facts import Routing
from interp_runner.payload import EngineSpec
from interp_runner.compile.requests import EngineRequest


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while a plan is built: its requests hold no reference cycles, and each
    of the collector's passes would traverse the plan's growing heap again (more than half of a 200k-request plan's
    compile time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class CaptureLayout:
    """Where one capture entry's values go in the store."""

    name: str
    hooks: tuple[str, ...]
    layers: tuple[int, ...]
    dtype: str
    prompt_indices: tuple[int, ...]
    # an entry of router logits (``router_logits``): the model's routing, from which the chosen experts and their
    # weights are derived into the store (``store.result_arrays.routing_arrays``); None: hidden-size activations
    routing: Routing | None = None


@dataclass(frozen=True)
class Plan:
    requests: tuple[EngineRequest, ...]
    vectors: dict[str, np.ndarray]  # registered on the workers with the first requests that run
    engine_spec: EngineSpec
    captures: tuple[CaptureLayout, ...]
    kind: str  # the experiment kind that compiled it (``interp_runner.kinds``)
    requests_sha256: str = field(default="")
    sources: dict[str, np.ndarray] = field(default_factory=dict)  # patch sources known before the run
    refs: dict[str, tuple[str, int, int]] = field(default_factory=dict)  # ref key -> (rid, site, position)
    skipped: tuple[dict, ...] = ()  # patch positions left out by prompt alignment
    layout: object | None = None  # what the kind needs to read the results back (its own record)
    # results so far by request id -> vectors by key, registered once stage 0 has finished, before stage 1 runs
    derive_vectors: Callable[[dict], dict[str, np.ndarray]] | None = None

    @property
    def num_stages(self) -> int:
        return 1 + max((r.stage for r in self.requests), default=0)


def bank_rows_for(cfg: RunBase, needed: int) -> int:
    """The patch bank's rows: ``engine.patch_bank_rows``, or what the plan keeps when that is not set."""
    if cfg.engine.patch_bank_rows is None:
        return needed
    if cfg.engine.patch_bank_rows < needed:
        raise ConfigError.at("engine.patch_bank_rows",
                             f"{cfg.engine.patch_bank_rows} is too small: the plan keeps {needed} patch sources")
    return cfg.engine.patch_bank_rows
