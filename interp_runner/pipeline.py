"""One run, top to bottom: validate -> compile -> start engine -> run stages -> write store -> mark complete.

Takes the resolved config as a plain dict; knows nothing of Hydra.
"""

from __future__ import annotations

import gc
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import xarray as xr

from interp_runner import run_log

from interp_runner.store import provenance
from interp_runner.config import ConfigError
from interp_runner.engine.adapter import one_token_no_text
from interp_runner.engine.pool import EnginePool
from interp_runner.engine.settings import EngineError, on_gpu
from interp_runner.engine.rules import check_engine, check_plan_values, with_model_len
from interp_runner.kinds.figure_workers import FigureWorkers
from interp_runner.kinds import kind_for
from interp_runner.kinds.base import Kind
from interp_runner.models import seeded
from interp_runner.models.facts import ModelFacts, UnsupportedModel, embedding_rows
from interp_runner.models.hook_check import check_config_hooks, check_plan_hooks
from interp_runner.models.layouts import layout_for
from interp_runner.models.materialize import model_folder
from interp_runner.compile.plan import Plan, collector_paused
from interp_runner.progress import StageProgress, on_terminal
from interp_runner.report import write_report
from interp_runner.compile.requests import EngineRequest
from interp_runner.store.result_flags import NONFINITE_ATTR, flagged_attrs, propagate
from interp_runner.config.run import RunConfig, validate_config
from interp_runner.store.writer import STATUS_COMPLETE, mark, write_results
from interp_runner.store.claim import claim_store
from interp_runner.compile.tokens import TextTokenizer, TokenizerError


@dataclass
class Prepared:
    cfg: RunConfig
    facts: ModelFacts
    plan: Plan
    tokenizer: TextTokenizer
    kind: Kind


def load_tokenizer(folder: Path, chat_template: bool) -> TextTokenizer:
    return TextTokenizer(folder, chat_template)


def prepare(config: dict, base: Path | None = None) -> Prepared:
    """Everything that can fail on bad input, done before any engine starts."""
    cfg = validate_config(config)
    folder = model_folder(cfg.model, base)
    kind = kind_for(cfg)
    try:
        weights_seed = cfg.model.weights_seed()
        facts = ModelFacts.from_folder(folder, weights_seed)
        check_config_hooks(cfg, layout_for(facts.architecture))
        check_engine(cfg, facts)
        cfg = with_model_len(cfg, facts)
        tokenizer = load_tokenizer(folder, cfg.prompts.chat_template)
        rows = (lambda ids: embedding_rows(folder, ids)) if weights_seed is None else (
            lambda ids: seeded.embedding_rows(folder, weights_seed, ids))
        with collector_paused():
            plan = kind.compile(cfg, facts, tokenizer, base, rows)
            spec = plan.engine_spec
            check_plan_hooks(spec.steer_sites + spec.capture_sites + spec.patch_sites, layout_for(facts.architecture),
                             "model.path" if cfg.model.path else "model.name")
            check_plan_values(plan, cfg, facts)
    except (UnsupportedModel, TokenizerError) as err:
        raise ConfigError.at(getattr(err, "key", None) or ("model.path" if cfg.model.path else "model.name"),
                             str(err)) from None
    return Prepared(cfg, facts, plan, tokenizer, kind)


def _runnable(request: EngineRequest, by_rid: dict, results: dict) -> bool:
    """A request conditioned on another runs only if that one predicted its answer."""
    if request.condition is None:
        return True
    done = results.get(request.condition)
    wanted = by_rid[request.condition].prompt.answer_ids
    return done is not None and done.score is not None and bool(wanted) and done.score["top_id"] == wanted[0]


def _keeps(request: EngineRequest) -> bool:
    """Whether the request keeps values on the workers (patch sources of later stages)."""
    payload = request.payload
    return payload is not None and payload.keep is not None


MIN_UNIT, MAX_UNITS = 1024, 16


def unit_size(num_requests: int) -> int:
    """The default unit of work: at most ``MAX_UNITS`` a stage, of at least ``MIN_UNIT`` requests."""
    return max(MIN_UNIT, -(-num_requests // MAX_UNITS))


def execute(engine, plan: Plan, log: Callable[[str], None] = print, use_tqdm: bool = True,
            unit: int | None = None, journal=None) -> dict:
    """Run the plan's stages on ``engine``; results by request id (requests whose condition failed are absent).

    A stage is submitted in units of ``unit`` requests (default: ``unit_size``), so continuous batching
    sees all of a unit; its patch sources stay registered on the workers until the whole stage has finished, and
    the values stage 0 keeps on the workers (``Plan.refs``) until the plan has. With a ``journal``
    (``store.Journal``) each finished unit is recorded, and units it already holds are taken from it instead of
    being run again; every unit then starts with an empty prefix cache, so a unit computes the same whether or not
    the ones before it ran in this process. A journaled unit that keeps values on the workers runs again (for the
    values only) before the next unit that is not journaled. ``Plan.derive_vectors`` is called once stage 0 has
    finished (run or taken from the journal), and the vectors it gives are registered with the next requests that
    run."""
    if not engine.supports(plan.engine_spec):
        raise EngineError("this engine was built for other interp sites than the plan needs")
    by_rid = {r.rid: r for r in plan.requests}
    results: dict = {}
    vectors = plan.vectors  # registered with the first requests that run
    refill: list[list[EngineRequest]] = []  # journaled units whose kept values later units need

    def run_unit(part: list[EngineRequest], progress: StageProgress | None) -> dict:
        nonlocal vectors
        if journal is not None and hasattr(engine, "reset_prefix_cache"):
            engine.reset_prefix_cache()
        # LLM.generate shows its own bar; the bulk path reports to the stage's
        own_bar = progress is not None and progress.bar is None and on_terminal()
        out = engine.run(part, vectors, use_tqdm=own_bar, progress=None if progress is None else progress.advance)
        vectors = None
        return out

    try:
        for stage in range(plan.num_stages):
            requests = [r for r in plan.requests if r.stage == stage and _runnable(r, by_rid, results)]
            held = [r for r in plan.requests if r.stage == stage]
            if len(requests) < len(held):
                log(f"stage {stage}: {len(held) - len(requests)} requests left out (their clean run missed the answer)")
            keys = {k for r in requests if r.payload is not None and r.payload.patch is not None
                    for k in r.payload.patch.sources}
            sources = {k: plan.sources[k] for k in keys if k in plan.sources}
            engine.register_sources(sources)
            size = unit or unit_size(len(requests))
            units = [requests[i : i + size] for i in range(0, len(requests), size)]
            bulk = all(one_token_no_text(r) for r in requests)
            progress = StageProgress(f"stage {stage}", len(requests), log, bar=bulk and on_terminal()) \
                if use_tqdm else None
            try:
                log(f"stage {stage}: {len(requests)} requests" + (f" in {len(units)} units" if len(units) > 1 else ""))
                for k, part in enumerate(units):
                    done = journal.load(stage, k) if journal is not None else None
                    if done is not None and set(done) == {r.rid for r in part}:
                        log(f"stage {stage} unit {k}: taken from the journal")
                        results.update(done)
                        if progress is not None:
                            progress.advance(len(part))
                        if any(_keeps(r) for r in part):
                            refill.append(part)
                        continue
                    for again in refill:  # as they ran (the same batch), so the values are the same
                        log(f"stage {stage} unit {k}: a journaled unit of {len(again)} requests runs again first, "
                            "for the values it keeps on the workers")
                        run_unit(again, None)
                    refill = []
                    out = run_unit(part, progress)
                    if journal is not None:
                        journal.record(stage, k, out)
                    results.update(out)
                    if progress is not None:
                        progress.unit_finished(k, len(units))
            finally:
                if progress is not None:
                    progress.close()
                engine.release_sources(list(sources))
            if stage == 0 and plan.derive_vectors is not None:
                derived = plan.derive_vectors(results)
                log(f"stage 0: {len(derived)} vectors derived from its results")
                vectors = {**(vectors or {}), **derived}  # with the plan's own, if stage 0 ran none
    finally:
        engine.release_sources(list(plan.refs))
    added = propagate(plan, results)
    if added:
        log(f"warning: {added} requests read values or KV of requests computed through a non-finite value: "
            "flagged too")
    return results


def _companion(claim, folder: Path, write, ds: xr.Dataset, cfg: RunConfig, what: str, log) -> list[str]:
    """Let the kind ``write`` (its ``figures`` or ``exports``) into ``folder`` beside the store, staged with it until
    the store is complete (emptied first: a resumed run may find an earlier attempt's); the final paths of what it
    wrote."""
    staging = claim.target.staging(folder)
    shutil.rmtree(staging, ignore_errors=True)
    written = [str(folder / p.name) for p in write(ds, cfg, staging)]
    if written:
        log(f"{what}: {folder} ({len(written)} files)")
    return written


def _figure_workers(kind: Kind, cfg: RunConfig, plan: Plan):
    """The kind's figure workers, started now where the engine runs on a GPU (its host's cores are free while it
    runs); on a CPU the engine's threads use every core, and the kind starts its own when it draws."""
    workers = FigureWorkers.ahead(kind.figure_count(cfg, plan)) if on_gpu() else None
    return workers or nullcontext()


def default_store_path(run_dir: Path) -> Path:
    return run_dir / "results.zarr"


def run(
    config: dict,
    run_dir: Path,
    overrides: list[str] = (),
    engine_factory=None,
    log: Callable[[str], None] = print,
    engines=None,
) -> Path:
    """Run the experiment; returns the store path. Raises ConfigError (before anything is written) on bad input.

    ``engines`` (an ``EnginePool``) keeps the engine for the next run in this process; without one, the engine
    is built for this run (with ``engine_factory``, default ``VllmEngine``)."""
    started_at = provenance.now()
    timings, t_plan = {}, time.perf_counter()
    with collector_paused():
        prepared = prepare(config, base=Path.cwd())
        # no collection while the config, model facts, tokenizer and plan are made (each full pass would traverse
        # the imports' heap and the growing plan); the plan lives as long as the run: frozen before collection
        # resumes, no later pass traverses it (vLLM's start collects several times, a second or more each over a
        # large plan, before it freezes the heap itself, for good; so would exit)
        gc.freeze()
    timings["plan_s"] = round(time.perf_counter() - t_plan, 2)
    cfg, facts, plan, kind = prepared.cfg, prepared.facts, prepared.plan, prepared.kind
    spec = plan.engine_spec
    log(f"plan: {len(plan.requests)} requests in {plan.num_stages} stage(s), {len(plan.vectors)} vectors, "
        f"{len(spec.steer_sites)} steered / {len(spec.capture_sites)} captured / {len(spec.patch_sites)} patched "
        f"sites, {spec.bank_rows} patch sources")
    for skipped in plan.skipped:
        log(f"warning: patch positions skipped where the prompts differ: {skipped}")
    if cfg.dry_run:
        log(f"dry run: config valid, requests sha256 {plan.requests_sha256}")
        return None

    store_path = Path(cfg.store.path).expanduser() if cfg.store.path else default_store_path(run_dir)
    manifest = provenance.manifest(config, cfg, facts, plan, list(overrides), started_at)
    # checked and locked before any engine starts; written beside store_path, moved there once complete
    claim = claim_store(store_path, resume=cfg.resume, overwrite=cfg.store.overwrite, log=log)
    journal = claim.begin(manifest)
    staged = claim.staged
    run_log.begin(claim.target.staging(claim.target.log))  # where the CLI keeps library logs: moved with the store
    own_pool = engines is None  # an engine built for this run alone is shut down before it returns
    try:
        if own_pool:
            engines = EnginePool(engine_factory)
        engines.log = log
        builds, t0 = engines.builds, time.perf_counter()
        decodes = any(r.sampling.get("max_tokens", 1) > 1 for r in plan.requests)
        engine = engines.get(facts.path, cfg.engine.resolved(on_gpu(), decodes), spec, cfg.model.weights_seed())
        reused = engines.builds == builds
        timings["engine_s"] = round(time.perf_counter() - t0, 2)
        log(f"engine {'reused' if reused else 'started'} on {facts.path} in {timings['engine_s']:.1f} s "
            f"({engines.builds} built for {engines.runs} runs in this process)")
        with _figure_workers(kind, cfg, plan) as workers:
            t0 = time.perf_counter()
            results = execute(engine, plan, log, unit=cfg.store.unit_requests, journal=journal)
            timings["run_s"] = round(time.perf_counter() - t0, 2)
            log(f"ran in {timings['run_s']:.1f} s")
            t0 = time.perf_counter()
            ds = kind.dataset(plan, results, facts.hidden_size, prepared.tokenizer)
            ds.attrs[NONFINITE_ATTR] = flagged_attrs(plan, results)
            write_results(staged, ds)
            timings["store_s"] = round(time.perf_counter() - t0, 2)
            written = xr.open_zarr(str(staged), consolidated=False)  # figures and exports show what the store holds
            t0 = time.perf_counter()
            figures = _companion(claim, claim.target.figures, partial(kind.figures, workers=workers), written, cfg,
                                 "figures", log)
            timings["figures_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        exports = _companion(claim, claim.target.exports, kind.exports, written, cfg, "exports", log)
        timings["exports_s"] = round(time.perf_counter() - t0, 2)
        mark(
            staged,
            STATUS_COMPLETE,
            finished_at=provenance.now(),
            engine={"dtype": engine.dtype, "plugin_status": engine.status, "reused": reused,
                    "model_runner": getattr(engine, "model_runner", None),  # the runner that ran: v1 | v2
                    "intervention_checksums": getattr(engine, "checksums", []),
                    "builds_in_process": engines.builds, "runs_in_process": engines.runs,
                    **({} if reused or engines.startup is None else {"startup": engines.startup})},
            figures=figures,
            exports=exports,
            timings=timings,
        )
        write_report(staged, claim.target.staging(claim.target.report))  # of the complete store, moved with it
        run_log.end()  # the log is complete before the store lists it
        claim.publish()
    except BaseException as err:
        run_log.end()
        claim.fail(err, finished_at=provenance.now())
        raise
    finally:
        claim.release()
        if own_pool and engines is not None:
            engines.close()
    return store_path
