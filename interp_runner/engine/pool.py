"""One engine kept across the runs of a process (Hydra multirun jobs, a test session), rebuilt when it cannot serve."""

from __future__ import annotations

from interp_runner.config.schema import EngineConfig
from interp_runner.engine.adapter import VllmEngine
from interp_runner.engine.settings import on_gpu
from interp_runner.engine.startup import StartupPhases, describe
from interp_runner.payload import EngineSpec


class EnginePool:
    """Keeps one engine across runs in a process (Hydra multirun jobs): reused while the model folder and engine
    settings are the same, rebuilt when they change or the plan needs sites it lacks (then with the sites of
    both). A reused engine starts each run with an empty prefix cache, as a fresh one would."""

    def __init__(self, factory=None, log=None):
        self.factory = factory or VllmEngine
        self.log = log
        self.startup: dict | None = None  # the last build's phases (``engine.startup``)
        self.engine = None
        self.key = None
        self.builds = 0
        self.runs = 0

    def get(self, model_path: str, cfg: EngineConfig, spec: EngineSpec, weights_seed: int | None = None):
        key = (str(model_path), cfg, weights_seed)
        self.runs += 1
        if self.engine is not None and self.key == key:
            if self.engine.supports(spec):
                if hasattr(self.engine, "reset_prefix_cache"):
                    self.engine.reset_prefix_cache()
                return self.engine
            spec = self.engine.spec.union(spec)
        self.close()
        with StartupPhases(announce=self.log) as phases:
            seeded = {} if weights_seed is None else {"weights_seed": weights_seed}
            self.engine = self.factory(model_path, cfg, spec, **seeded)
        self.startup = phases.summary(compiled=not cfg.eager(on_gpu()))
        if self.log is not None:
            self.log(f"engine start: {describe(self.startup)}")
        self.key = key
        self.builds += 1
        return self.engine

    def close(self) -> None:
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()
        self.engine, self.key = None, None
