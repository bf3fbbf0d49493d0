"""Engine adapter: runs a compiled plan on an embedded vLLM with the interp plugin, returns results by request.

Starting it (``settings``), the bulk path (``bulk``), results (``results``) and keeping one across runs (``pool``)
live beside it; here: the engine's life, its two request paths, patch sources, and checks of the workers."""

from __future__ import annotations

import contextlib
import gc
import os
import weakref
from collections.abc import Sequence

import numpy as np

from interp_runner.compile.requests import EngineRequest
from interp_runner.config.schema import EngineConfig
from interp_runner.contracts import COLLECT
from interp_runner.engine.bulk import run_bulk
from interp_runner.engine.results import RequestResult
from interp_runner.engine.settings import EngineError, llm_kwargs, on_gpu
from interp_runner.payload import EngineSpec, plugin_fingerprint
from interp_runner.result_transfer import received, result_block

_in_process_engines: weakref.WeakSet = weakref.WeakSet()  # engines whose engine core runs in this process

# vLLM sets this to 1 at its import, but only after that import has loaded torch's Inductor config, which reads it
# once: a GPU engine then starts a pool of compile processes (one per core) to compile its sampler, mid-run
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@contextlib.contextmanager
def _parallel_groups_kept():
    """vLLM's in-process engine core shutdown without its last step, ``cleanup_dist_env_and_memory`` (which destroys
    the process's parallel groups; ``close`` releases the memory)."""
    import vllm.v1.engine.core as core_module

    original = core_module.cleanup_dist_env_and_memory
    core_module.cleanup_dist_env_and_memory = lambda *args, **kwargs: None
    try:
        yield
    finally:
        core_module.cleanup_dist_env_and_memory = original


@contextlib.contextmanager
def _collections_deferred():
    """vLLM's in-process engine core shutdown without its garbage collections (two, each over the whole heap: ~0.6 s
    each on a CPU): made while the engine is still referenced, they free nothing that ``close``'s one collection,
    once it has dropped the engine, does not."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


@contextlib.contextmanager
def model_inspection_in_process():
    """vLLM inspects a model class (multimodal, pooling, ...) in a fresh Python process, so as not to initialize CUDA
    in its own, once per model file and vLLM version (the answer is cached under VLLM_CACHE_ROOT): ~7 s a model
    family on a 2-core CPU, mostly the new process's imports. Without a GPU there is no CUDA to keep uninitialized,
    so the inspection runs in this process (same answer, cached the same way)."""
    if on_gpu():
        yield
        return
    from vllm.model_executor.models import registry
    from vllm.plugins import load_general_plugins

    original = registry._run_in_subprocess

    def in_process(inspect):
        load_general_plugins()  # as the inspecting process does first (once per process)
        return inspect()

    registry._run_in_subprocess = in_process
    try:
        yield
    finally:
        registry._run_in_subprocess = original


def _gpu_ready_for_next_engine() -> None:
    """Before an engine starts in a process that had one: a closed engine's CUDA graphs destroyed, their memory
    released, and a graph memory pool of its own for the new engine. vLLM captures every engine's graphs into one
    process-wide pool; once the closed engine's graphs are gone that pool has no user, but torch keeps it while any
    tensor allocated in it lives on, and a capture into such a pool fails inside torch's allocator."""
    import torch

    if torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
        from vllm.platforms import current_platform

        type(current_platform)._global_graph_pool = None  # the next capture makes a new pool


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


def one_token_no_text(request: EngineRequest) -> bool:
    """A request that takes the bulk path: one generated token, no top-k log-probabilities."""
    return request.sampling.get("max_tokens") == 1 and not request.sampling.get("logprobs")


class VllmEngine:
    """One vLLM engine with interp ops at the sites of ``spec``. Reusable for any plan whose sites it has."""

    def __init__(self, model_path: str, cfg: EngineConfig, spec: EngineSpec, weights_seed: int | None = None):
        """``weights_seed``: seeded weights (``interp_runner.models.seeded``) instead of the folder's files."""
        kwargs = llm_kwargs(model_path, cfg, spec, weights_seed)
        from vllm import LLM

        self.spec = spec
        self.pack_cells = cfg.packs_cells()
        # where steps overlap submission: the tokens submitted before a bulk run starts a step (default: a step's
        # worth, max_num_batched_tokens)
        self.step_tokens: int | None = None
        self.serial = 0
        self.checksums: list[dict] = []
        _gpu_ready_for_next_engine()
        before = _child_pids()
        with model_inspection_in_process():
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
            return run_bulk(self, requests, progress)
        outputs = self.llm.generate(
            [r.engine_prompt() for r in requests],
            [r.sampling_params() for r in requests],
            use_tqdm=use_tqdm,
        )
        if progress is not None:
            progress(len(requests))
        rids = [r.rid for r in requests]
        collected = self.collect(rids)
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

    def steps_overlap(self) -> bool:
        """Whether the engine core runs in this process and queues a step without waiting for it (vLLM's async
        scheduling): then submitting more requests overlaps the GPU's work."""
        inner = getattr(self.llm.llm_engine.engine_core, "engine_core", None)
        return inner is not None and getattr(inner, "batch_queue", None) is not None

    def collect(self, rids: list[str], carriers: list[str] = ()) -> dict:
        """Per-request results from the result rank, after checking that every rank applied the same; what the
        requests, and the packed requests that ``carriers`` name, held on the workers is freed. Workers in other
        processes write the arrays into a block the call makes (``result_transfer``), removed when it ends."""
        collected = {}
        packed = not self.in_process
        with result_block(packed) as block:
            for per_rank in self.llm.collective_rpc(COLLECT, args=(rids, packed, list(carriers), block)):
                if per_rank is not None:  # None: a rank other than the result rank
                    collected.update(received(per_rank, block) if packed else per_rank)
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
        import psutil

        try:
            if not self.processes:  # the workers run here: the plugin lets go of their state, which ends with them
                self.llm.collective_rpc("interp_release")
        finally:
            core = getattr(self.llm.llm_engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                # an engine core in this process ends by tearing down vLLM's process-wide parallel groups: kept
                # while other engines alive here still use them (the rest of the shutdown runs)
                shared = not self.processes and not set(_in_process_engines) <= {self}
                # on a CPU without vLLM's collections (``close`` makes one); a GPU keeps them, with the memory release
                deferred = _collections_deferred() if not on_gpu() else contextlib.nullcontext()
                with _parallel_groups_kept() if shared else contextlib.nullcontext(), deferred:
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


