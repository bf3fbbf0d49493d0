"""One run, top to bottom: validate -> compile -> start engine -> run -> write store -> mark complete.

Takes the resolved config as a plain dict; knows nothing of Hydra.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import provenance
from .compiler import Plan, compile_plan
from .config import ConfigError, RunConfig, validate_config
from .config.schema import resolve_path
from .models.facts import ModelFacts, UnsupportedModel
from .models.materialize import model_path
from .store import STATUS_COMPLETE, STATUS_FAILED, mark, open_store, results_dataset, write_results


@dataclass
class Prepared:
    cfg: RunConfig
    facts: ModelFacts
    plan: Plan


def load_tokenizer(folder: Path, chat_template: bool) -> Callable[[str], list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if chat_template:
        return lambda text: tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    return lambda text: tokenizer(text)["input_ids"]


def prepare(config: dict, base: Path | None = None) -> Prepared:
    """Everything that can fail on bad input, done before any engine starts."""
    cfg = validate_config(config)
    if cfg.model.path:
        folder = resolve_path(cfg.model.path, base)
        if not (folder / "config.json").exists():
            raise ConfigError.at("model.path", f"{folder} is not a model folder (no config.json)")
    else:
        try:
            folder = model_path(cfg.model.name)
        except FileNotFoundError as err:
            raise ConfigError.at("model.name", str(err)) from None
    try:
        facts = ModelFacts.from_folder(folder)
    except UnsupportedModel as err:
        raise ConfigError.at("model", str(err)) from None
    plan = compile_plan(cfg, facts, load_tokenizer(folder, cfg.prompts.chat_template), base)
    return Prepared(cfg, facts, plan)


def default_store_path(run_dir: Path) -> Path:
    return run_dir / "results.zarr"


def run(
    config: dict,
    run_dir: Path,
    overrides: list[str] = (),
    engine_factory=None,
    log: Callable[[str], None] = print,
) -> Path:
    """Run the experiment; returns the store path. Raises ConfigError (before anything is written) on bad input."""
    started_at = provenance.now()
    prepared = prepare(config, base=Path.cwd())
    cfg, facts, plan = prepared.cfg, prepared.facts, prepared.plan
    log(f"plan: {len(plan.requests)} requests, {len(plan.vectors)} vectors, "
        f"{len(plan.engine_spec.steer_sites)} steered / {len(plan.engine_spec.capture_sites)} captured sites")
    if cfg.dry_run:
        log(f"dry run: config valid, requests sha256 {plan.requests_sha256}")
        return None

    store_path = Path(cfg.store.path).expanduser() if cfg.store.path else default_store_path(run_dir)
    manifest = provenance.manifest(config, cfg, facts, plan, list(overrides), started_at)
    open_store(store_path, manifest)
    try:
        if engine_factory is None:
            from .engine import VllmEngine

            engine_factory = VllmEngine
        log(f"starting engine on {facts.path}")
        engine = engine_factory(facts.path, cfg.engine, plan.engine_spec)
        results = engine.run(plan)
        ds = results_dataset(plan, results, facts.hidden_size)
        write_results(store_path, ds)
        mark(
            store_path,
            STATUS_COMPLETE,
            finished_at=provenance.now(),
            engine={"dtype": engine.dtype, "plugin_status": engine.status},
        )
    except BaseException as err:
        mark(store_path, STATUS_FAILED, finished_at=provenance.now(), error="".join(
            traceback.format_exception_only(type(err), err)).strip())
        raise
    log(f"store: {store_path}")
    return store_path
