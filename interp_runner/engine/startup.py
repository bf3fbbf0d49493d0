"""The engine start broken into phases, as vLLM itself measures and logs them.

vLLM times each phase of its start (weights, torch.compile, profiling run, CUDA-graph capture) and logs the
result; ``StartupPhases`` listens to those records (by their message template, not their formatted text) in the
process the engine runs in, and says where the start went and whether the compile cache was hit. Phases of
workers in other processes (tensor parallelism) are not seen: their total still is.
"""

from __future__ import annotations

import logging
import time

# vLLM 0.26's message templates -> (phase, index of the seconds in the record's args)
PHASE_TEMPLATES = {
    "Loading weights took %.2f seconds": ("load", 0),
    "Model loading took %s GiB memory and %.6f seconds": ("load", 1),
    "torch.compile took %.2f s in total": ("compile", 0),
    "Initial profiling/warmup run took %.2f s": ("profile", 0),
    "Graph capturing finished in %.0f secs, took %.2f GiB": ("graphs", 0),
}
# the engine core's own total of profiling, KV cache and warm-up (compile and graph capture included)
INIT_TEMPLATES = (
    "init engine (profile, create kv cache, warmup model) took %.2f s",
    "init engine (profile, create kv cache, warmup model) took %.2f s (compilation: %.2f s)",
    "init engine (profile, create kv cache, warmup model) took %.2f s (compilation: %.2f s — language_model: %.2f s, "
    "encoder: %.2f s)",
)
CACHE_HIT_TEMPLATES = (
    "Directly load AOT compilation from path %s",
    "Directly load the compiled graph(s) for compile range %s from the cache, took %.3f s",
)
CACHE_MISS_TEMPLATES = (
    "saved AOT compiled function to %s",
    "Compiling a graph for compile range %s takes %.2f s",
)
# vLLM 0.26's CPU build fails to load its own AOT artifacts and compiles again (Inductor's caches make it quicker)
CACHE_LOAD_FAILED = "Compiling model again due to a load failure from %s, reason: %s"
# records that open a phase a user waits through: announced as they come
ANNOUNCE = {
    "Warming up model for the compilation...": "warming the model up (compiling it first unless eager)",
    "Loading weights took %.2f seconds": "weights loaded",
    "Model loading took %s GiB memory and %.6f seconds": "weights loaded",
    "torch.compile took %.2f s in total": "compiled",
    "Initial profiling/warmup run took %.2f s": "profiled",
}


class StartupPhases(logging.Handler):
    """Collects the phase timings vLLM logs while an engine starts (use as a context manager)."""

    def __init__(self, announce=None):
        super().__init__(level=logging.DEBUG)
        self.announce = announce
        self.phases: dict[str, float] = {}
        self.compile_cache: str | None = None
        self.core_init: float | None = None
        self.total = 0.0
        self._logger = logging.getLogger("vllm")

    def emit(self, record: logging.LogRecord) -> None:
        template = record.msg if isinstance(record.msg, str) else ""
        found = PHASE_TEMPLATES.get(template)
        if found is not None:
            phase, index = found
            try:
                self.phases[phase] = self.phases.get(phase, 0.0) + float(record.args[index])
            except (IndexError, TypeError, ValueError):
                pass
        if template in INIT_TEMPLATES:
            self.core_init = float(record.args[0])
        if template == CACHE_LOAD_FAILED:
            self.compile_cache = "load failed"
        elif template in CACHE_HIT_TEMPLATES and self.compile_cache is None:
            self.compile_cache = "hit"
        elif template in CACHE_MISS_TEMPLATES and self.compile_cache is None:
            self.compile_cache = "miss"
        if self.announce is not None and template in ANNOUNCE:
            self.announce(f"engine start: {ANNOUNCE[template]} ({time.perf_counter() - self._t0:.0f} s)")

    def __enter__(self) -> StartupPhases:
        try:  # vLLM configures its loggers when first imported, dropping handlers already there
            import vllm.logger  # noqa: F401
        except ImportError:
            pass
        self._t0 = time.perf_counter()
        # INFO records reach this handler even where vLLM's own handler prints only warnings
        self._level = self._logger.level
        if self._logger.getEffectiveLevel() > logging.INFO:
            self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
        self.total = time.perf_counter() - self._t0

    def summary(self, compiled: bool) -> dict:
        """Seconds per phase (``other``: the rest of the start: processes, KV cache, sampler warm-up)."""
        phases = {k: round(v, 2) for k, v in self.phases.items()}
        out = {"total_s": round(self.total, 2), **{f"{k}_s": v for k, v in phases.items()}}
        out["other_s"] = round(max(self.total - sum(phases.values()), 0.0), 2)
        if self.core_init is not None:  # of which: the engine core's init, less what is listed above
            out["core_init_s"] = round(self.core_init, 2)
        out["compiled"] = compiled
        out["compile_cache"] = (self.compile_cache or "unknown") if compiled else "not compiled"
        return out


def describe(summary: dict) -> str:
    parts = [f"{k.removesuffix('_s')} {v:.1f} s" for k, v in summary.items() if k.endswith("_s") and k != "total_s"]
    cache = f", compile cache {summary['compile_cache']}" if summary.get("compiled") else ", eager"
    return f"{summary['total_s']:.1f} s ({', '.join(parts)}{cache})"
