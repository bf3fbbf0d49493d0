"""Engine adapter: runs a compiled plan on an embedded vLLM with the interp plugin, returns results by request."""

from __future__ import annotations

import copy
import os
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from interp_runner import run_log
from interp_runner.config import ConfigError
from interp_runner.config.schema import EngineConfig
from interp_runner.engine.startup import StartupPhases, describe
from interp_runner.models.seeded import LOAD_FORMAT as SEEDED_LOAD_FORMAT
from interp_runner.compile.packing import PackedRequest, group_cells
from interp_runner.payload import EngineSpec, plugin_fingerprint, unpack_results
from interp_runner.plugin import ENABLE_ENV
from interp_runner.compile.requests import EngineRequest, transported

WORKER_EXTENSION = "interp_runner.plugin.runtime.InterpWorkerExtension"
FORCED_TOKENS = "interp_runner.plugin.forcing:ForcedTokens"  # vLLM logits processor (teacher forcing)
CPU_KV_CACHE_BYTES = 1 << 30
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_caller_runner_env = os.environ.get(RUNNER_ENV)  # the caller's own choice, which ``auto`` leaves in place
_in_process_engines: weakref.WeakSet = weakref.WeakSet()  # engines whose engine core runs in this process
_batch_invariant_in_process: bool | None = None  # as set for the first engine of this process

# vLLM sets this to 1 at its import, but only after that import has loaded torch's Inductor config, which reads it
# once: a GPU engine then starts a pool of compile processes (one per core) to compile its sampler, mid-run
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


class EngineError(RuntimeError):
    pass


def _child_pids() -> set[int]:
    """This process's vLLM processes (engine cores, workers: vLLM names them ``VLLM::...``); not, say, the
    multiprocessing resource tracker, which lives as long as this process."""
    import psutil

    pids = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.name().startswith("VLLM"):
                pids.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return pids


@dataclass
class RequestResult:
    rid: str
    prompt_index: int
    token_ids: list[int]
    text: str
    logprobs: list[float]  # of each sampled token
    top_logprobs: list[list[tuple[int, float]]] | None = None
    captures: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # site -> (positions, values)
    score: dict | None = None  # token_ids, logprobs (exact, any rank), top_id, top_logprob
    void: str | None = None  # why its patches could not be applied: it must not count as patched
    # computed through a non-finite value (the final norm's input, or the logits it was scored from): its numbers are
    # artifacts, never results
    nonfinite: bool = False
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


def on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def set_batch_invariant(enabled: bool) -> None:
    """Set vLLM's batch-invariant mode for this process (the config decides, not the caller's environment).

    vLLM reads ``VLLM_BATCH_INVARIANT`` at import and engine start and then caches it, and the mode patches torch
    ops process-wide: it cannot change between the engines of one process. Its kernels are Triton kernels: vLLM's
    CPU build installs them all the same and fails in the first forward, so a CPU engine refuses the option."""
    global _batch_invariant_in_process
    if enabled and not on_gpu():
        raise ConfigError.at(
            "engine.batch_invariant",
            "vLLM's batch-invariant mode needs a GPU (its kernels are Triton kernels) and this machine has none; "
            "CPU runs of a config reproduce bit for bit without it",
        )
    if _batch_invariant_in_process is not None and _batch_invariant_in_process != enabled:
        raise EngineError(
            f"engine.batch_invariant={str(enabled).lower()}, but this process already started an engine with "
            f"{str(_batch_invariant_in_process).lower()}: vLLM cannot switch the mode within a process"
        )
    os.environ[BATCH_INVARIANT_ENV] = "1" if enabled else "0"
    _batch_invariant_in_process = enabled


def select_model_runner(choice: str) -> bool:
    """Set vLLM's model runner for the next engine of this process (``engine.model_runner``): ``v1`` / ``v2``
    force it, ``auto`` leaves vLLM's own pick (and the caller's ``VLLM_USE_V2_MODEL_RUNNER``). Returns whether V2
    is forced: its sampler then forces tokens itself, as V2 refuses custom logits processors."""
    if choice == "auto":
        if _caller_runner_env is None:
            os.environ.pop(RUNNER_ENV, None)
        else:
            os.environ[RUNNER_ENV] = _caller_runner_env
    else:
        os.environ[RUNNER_ENV] = "1" if choice == "v2" else "0"
    import vllm.envs as envs

    wanted = envs.environment_variables[RUNNER_ENV]()
    if envs._is_envs_cache_enabled() and envs.VLLM_USE_V2_MODEL_RUNNER != wanted:
        # an earlier engine of this process froze vLLM's environment: read it again for this one
        envs.__getattr__.cache_clear()
    return wanted is True


def one_token_no_text(request: EngineRequest) -> bool:
    """A request that takes the bulk path: one generated token, no top-k log-probabilities."""
    return request.sampling.get("max_tokens") == 1 and not request.sampling.get("logprobs")


class VllmEngine:
    """One vLLM engine with interp ops at the sites of ``spec``. Reusable for any plan whose sites it has."""

    def __init__(self, model_path: str, cfg: EngineConfig, spec: EngineSpec, weights_seed: int | None = None):
        """``weights_seed``: seeded weights (``interp_runner.models.seeded``) instead of the folder's files."""
        os.environ[ENABLE_ENV] = "1"
        v2_forced = select_model_runner(cfg.model_runner)
        if cfg.tensor_parallel_size == 1:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        elif on_gpu():
            # workers started fresh, never forked from a process whose CUDA state a run (its provenance, a previous
            # engine) may have touched: a forked worker cannot initialise CUDA again
            os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        set_batch_invariant(cfg.batch_invariant)
        from vllm import LLM

        kwargs = dict(
            model=model_path,
            dtype=cfg.dtype,
            enforce_eager=cfg.eager(on_gpu()),
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            seed=cfg.seed,
            worker_extension_cls=WORKER_EXTENSION,
            additional_config=spec.as_additional_config(),
            # teacher forcing: V1's logits processor (with it, vLLM's own pick is V1), or V2's sampler
            logits_processors=[FORCED_TOKENS] if spec.force_tokens and not v2_forced else None,
            # one KV-cache group even where sliding-window layers sit beside global ones (Gemma 2 / 3): the
            # plugin's KV reads (kept KV, packed cells) address one block table; windows still apply per layer
            disable_hybrid_kv_cache_manager=True,
        )
        if weights_seed is not None:
            kwargs.update(load_format=SEEDED_LOAD_FORMAT, model_loader_extra_config={"seed": weights_seed})
        if run_log.installed() and not run_log.verbose():
            kwargs["use_tqdm_on_load"] = False  # the console shows the runner's lines (``interp_runner.run_log``)
        if cfg.block_size is not None:
            kwargs["block_size"] = cfg.block_size
        if cfg.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        if cfg.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
        elif not on_gpu():
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        else:
            kwargs["gpu_memory_utilization"] = cfg.gpu_memory_utilization
        self.spec = spec
        self.pack_cells = cfg.packs_cells()
        # where steps overlap submission: the tokens submitted before a bulk run starts a step (default: a step's
        # worth, max_num_batched_tokens)
        self.step_tokens: int | None = None
        self._serial = 0
        self.checksums: list[dict] = []
        before = _child_pids()
        self.llm = LLM(**kwargs)
        # the engine core and tensor-parallel workers this engine started: ``close`` waits for them to end
        self.processes = _child_pids() - before
        if not self.processes:
            _in_process_engines.add(self)
        # the worker runs in this process (results come back as they are, not packed)
        self.in_process = cfg.tensor_parallel_size == 1 and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.status = self._check_plugin()
        self.model_runner = self.status["model_runner"]  # the runner vLLM picked, as the workers report it
        self.dtype = str(self.llm.llm_engine.model_config.dtype).removeprefix("torch.")

    def _check_plugin(self) -> dict:
        """vLLM swallows plugin load errors: make sure every worker really runs our ops before trusting it."""
        statuses = self.llm.collective_rpc("interp_status")
        expected = plugin_fingerprint()
        num_layers = self.llm.llm_engine.model_config.hf_text_config.num_hidden_layers
        for rank, status in enumerate(statuses):
            if not status.get("loaded"):
                raise EngineError(f"interp plugin is not active on worker {rank}: {status}")
            if not status["runner_planned"]:
                raise EngineError(f"worker {rank} uses a model runner the interp planner does not drive")
            if status["model_runner"] != statuses[0]["model_runner"]:
                raise EngineError(f"worker {rank} runs model runner {status['model_runner']}, worker 0 "
                                  f"{statuses[0]['model_runner']}")
            if status["plugin"] != expected:
                raise EngineError(f"worker {rank} runs plugin {status['plugin']}, this code is {expected}")
            if len(status["instrumented_layers"]) != num_layers:
                raise EngineError(
                    f"worker {rank} instrumented {len(status['instrumented_layers'])} of {num_layers} layers"
                )
        return statuses[0]

    def supports(self, spec: EngineSpec) -> bool:
        return self.spec.covers(spec)

    def register_sources(self, sources: dict[str, np.ndarray]) -> None:
        """Patch sources into the workers' bank, kept until released."""
        if sources:
            blobs = {k: np.asarray(v, dtype=np.float32).tobytes() for k, v in sources.items()}
            self.llm.collective_rpc("interp_register_sources", args=(blobs,))

    def release_sources(self, keys: Sequence[str]) -> None:
        if keys:
            self.llm.collective_rpc("interp_release_sources", args=(list(keys),))

    def run(self, requests: Sequence[EngineRequest], vectors: dict[str, np.ndarray] | None = None,
            use_tqdm: bool = True, progress=None) -> dict[str, RequestResult]:
        """Submit the requests together; results by request id. ``progress(n)`` hears of each ``n`` requests
        that finish, as they do (``LLM.generate`` shows its own bar instead, with ``use_tqdm``)."""
        if vectors:
            self.llm.collective_rpc(
                "interp_register_vectors", args=({k: v.astype(np.float32).tobytes() for k, v in vectors.items()},)
            )
        if not requests:
            return {}
        if all(one_token_no_text(r) for r in requests):
            return self._run_bulk(requests, progress)
        outputs = self.llm.generate(
            [r.engine_prompt() for r in requests],
            [r.sampling_params() for r in requests],
            use_tqdm=use_tqdm,
        )
        if progress is not None:
            progress(len(requests))
        rids = [r.rid for r in requests]
        collected = self._collect(rids)
        results = {}
        for request, output in zip(requests, outputs):
            completion = output.outputs[0]
            chosen, top = [], []
            for token, entry in zip(completion.token_ids, completion.logprobs or []):
                chosen.append(float(entry[token].logprob))
                top.append(sorted(((t, float(lp.logprob)) for t, lp in entry.items()), key=lambda x: -x[1]))
            worker = collected.get(request.rid, {})
            results[request.rid] = RequestResult(
                rid=request.rid,
                prompt_index=request.prompt.index,
                token_ids=list(completion.token_ids),
                text=completion.text,
                logprobs=chosen,
                top_logprobs=top if request.sampling.get("logprobs") else None,
                captures=worker.get("captures", {}),
                score=worker.get("score"),
                void=worker.get("void"),
                nonfinite=bool(worker.get("nonfinite", False)),
                cached_tokens=int(output.num_cached_tokens or 0),
            )
        return results

    def _run_bulk(self, requests: Sequence[EngineRequest], progress=None) -> dict[str, RequestResult]:
        """One-token requests straight into the engine core: no input rendering, no output processing.

        ``LLM.generate`` spends a large share of a short request's cost in its front end (prompt rendering and
        parameter processing per request; detokenization and ``RequestOutput`` objects on the way out). Here the
        sampling parameters are processed once per distinct setting and shallow-copied per request with its own
        payload; the core's outputs are read directly. Same scheduler, model runner and sampling as ``generate``.
        With ``pack_cells``, cells that share a prompt prefix go in shared engine requests (``packing``)."""
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.v1.engine import EngineCoreRequest

        engine = self.llm.llm_engine
        core = engine.engine_core
        config = engine.vllm_config
        groups, single = [], list(requests)
        if self.pack_cells:
            # room for the one token the engine generates
            limit = min(config.model_config.max_model_len - 1, config.scheduler_config.max_num_batched_tokens)
            groups, single = group_cells(requests, config.cache_config.block_size, limit)

        def submissions():
            for r in single:
                yield r.rid, list(r.prompt.token_ids), transported(r.sampling), r
            for group in groups:  # each packed request made as it is submitted
                p = group.request()
                yield p.rid, p.token_ids, p.sampling, p

        # where the engine queues a step and returns (async scheduling, in this process), a step starts as soon as
        # a step's worth of tokens is in: the GPU computes it while the next ones are made and submitted
        step_tokens = (self.step_tokens or config.scheduler_config.max_num_batched_tokens) \
            if self._steps_overlap() else None
        processed: dict[str, object] = {}
        pending: dict[str, EngineRequest | PackedRequest] = {}
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[float]] = {}
        cached: dict[str, int] = {}
        done: set[str] = set()

        def take(outputs) -> None:
            for out in outputs.outputs:
                if out.request_id not in pending:
                    continue
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.new_logprobs is not None:
                    logprobs.setdefault(out.request_id, []).extend(
                        float(x) for x in np.asarray(out.new_logprobs.logprobs)[:, 0])
                if out.prefill_stats is not None:
                    cached[out.request_id] = int(out.prefill_stats.num_cached_tokens)
                if out.finished:
                    done.add(out.request_id)
                    if progress is not None:
                        request = pending[out.request_id]
                        progress(len(request.members) if isinstance(request, PackedRequest) else 1)

        arrival = time.time()
        submitted = 0
        try:
            for rid, token_ids, sampling, request in submissions():
                settings = {k: v for k, v in sampling.items() if k != "extra_args"}
                key = repr(sorted(settings.items()))
                params = processed.get(key)
                if params is None:
                    params = engine.input_processor.process_inputs(
                        rid, tokens_input(token_ids), SamplingParams(**settings),
                        supported_tasks=engine.get_supported_tasks(),
                    ).sampling_params
                    processed[key] = params
                params = copy.copy(params)
                params.extra_args = sampling.get("extra_args")
                self._serial += 1
                internal = f"{rid}-{self._serial:08x}"
                pending[internal] = request
                core.add_request(EngineCoreRequest(
                    request_id=internal, prompt_token_ids=token_ids, mm_features=None,
                    sampling_params=params, pooling_params=None, arrival_time=arrival, lora_request=None,
                    cache_salt=None, data_parallel_rank=None, external_req_id=rid,
                ))
                submitted += len(token_ids)
                if step_tokens is not None and submitted >= step_tokens:
                    take(core.get_output())
                    submitted = 0
            while len(done) < len(pending):
                take(core.get_output())
        except BaseException:
            core.abort_requests([k for k in pending if k not in done])
            raise
        collected = self._collect([r.rid for r in requests],
                                  [r.rid for r in pending.values() if isinstance(r, PackedRequest)])
        decode = self.llm.get_tokenizer().decode
        texts: dict[tuple, str] = {}  # one token each: few distinct ones

        def result(request: EngineRequest, ids: list[int], chosen: list[float], cached_tokens: int,
                   worker: dict) -> RequestResult:
            key = tuple(ids)
            text = texts.get(key)
            if text is None:
                text = texts[key] = decode(ids, skip_special_tokens=True)
            return RequestResult(
                rid=request.rid, prompt_index=request.prompt.index, token_ids=ids, text=text, logprobs=chosen,
                captures=worker.get("captures", {}), score=worker.get("score"), void=worker.get("void"),
                nonfinite=bool(worker.get("nonfinite", False)), cached_tokens=cached_tokens,
            )

        results = {}
        for internal, request in pending.items():
            if isinstance(request, EngineRequest):
                results[request.rid] = result(request, tokens.get(internal, []), logprobs.get(internal, []),
                                              cached.get(internal, 0), collected.get(request.rid, {}))
                continue
            # a packed cell's token is its greedy choice: the top token its score read
            cached_tokens = min(cached.get(internal, 0), request.prefix)
            for member in request.members:
                worker = collected.get(member.rid, {})
                score = worker.get("score")
                ids, chosen = ([score["top_id"]], [score["top_logprob"]]) if score else ([], [])
                results[member.rid] = result(member, ids, chosen, cached_tokens, worker)
        return results

    def _steps_overlap(self) -> bool:
        """Whether the engine core runs in this process and queues a step without waiting for it (vLLM's async
        scheduling): then submitting more requests overlaps the GPU's work."""
        inner = getattr(self.llm.llm_engine.engine_core, "engine_core", None)
        return inner is not None and getattr(inner, "batch_queue", None) is not None

    def _collect(self, rids: list[str], carriers: list[str] = ()) -> dict:
        """Per-request results from the result rank, after checking that every rank applied the same; what the
        requests, and the packed requests that ``carriers`` name, held on the workers is freed."""
        collected = {}
        for per_rank in self.llm.collective_rpc("interp_collect", args=(rids, not self.in_process, list(carriers))):
            collected.update(per_rank if self.in_process else unpack_results(per_rank))
        self.check_ranks()
        return collected

    def check_ranks(self) -> list[dict]:
        """Every worker's running checksum of the interventions it applied; a rank that differs fails the run."""
        self.checksums = list(self.llm.collective_rpc("interp_checksum"))
        if len({(c["digest"], c["steps"]) for c in self.checksums}) > 1:
            listed = ", ".join(f"rank {i}: {c['digest']} ({c['steps']} steps)" for i, c in enumerate(self.checksums))
            raise EngineError(f"tensor-parallel ranks applied different interventions ({listed}): "
                              "results of this engine cannot be trusted")
        return self.checksums

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def close(self, timeout: float = 60.0) -> None:
        """Shut the engine down and wait until the processes it started have ended, so that their GPU memory is free
        for whatever starts next (vLLM checks the free memory when an engine starts). vLLM's own shutdown kills a
        slow engine core after a few seconds and returns while its workers are still tearing down."""
        import gc

        import psutil

        core = getattr(self.llm.llm_engine, "engine_core", None)
        # an engine core in this process is shut down (its GPU memory freed) only when it is the last one: the
        # shutdown tears down vLLM's process-wide parallel groups, which other engines alive here still use
        last_here = not self.processes and set(_in_process_engines) <= {self}
        if (self.processes or last_here) and core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        _in_process_engines.discard(self)
        del self.llm
        gc.collect()
        procs = []
        for pid in self.processes:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=timeout)
        if alive:
            raise EngineError(f"engine processes {[p.pid for p in alive]} still run {timeout:.0f} s after shutdown")
        if on_gpu():
            import torch

            torch.cuda.empty_cache()  # an engine in this process: its cached blocks back to the driver


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
