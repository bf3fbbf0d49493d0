"""What an engine of interp-runner is started with: vLLM's keyword arguments for an ``EngineConfig`` and an
``EngineSpec``, and the process-wide switches vLLM reads from the environment (interp ops on, the model runner,
batch invariance, how TP workers start)."""

from __future__ import annotations

import os

from interp_runner import run_log
from interp_runner.config import ConfigError
from interp_runner.config.schema import EngineConfig
from interp_runner.models.seeded import LOAD_FORMAT as SEEDED_LOAD_FORMAT
from interp_runner.payload import EngineSpec
from interp_runner.plugin import ENABLE_ENV

WORKER_EXTENSION = "interp_runner.plugin.runtime.InterpWorkerExtension"
FORCED_TOKENS = "interp_runner.plugin.forcing:ForcedTokens"  # vLLM logits processor (teacher forcing)
CPU_KV_CACHE_BYTES = 1 << 30
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
_caller_runner_env = os.environ.get(RUNNER_ENV)  # the caller's own choice, which ``auto`` leaves in place
_batch_invariant_in_process: bool | None = None  # as set for the first engine of this process


class EngineError(RuntimeError):
    pass


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


def llm_kwargs(model_path: str, cfg: EngineConfig, spec: EngineSpec, weights_seed: int | None = None) -> dict:
    """vLLM's ``LLM`` arguments for an engine with interp ops at the sites of ``spec``, after setting the
    process-wide switches it reads. ``weights_seed``: seeded weights (``interp_runner.models.seeded``)."""
    os.environ[ENABLE_ENV] = "1"
    v2_forced = select_model_runner(cfg.model_runner)
    if cfg.tensor_parallel_size == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    elif on_gpu():
        # workers started fresh, never forked from a process whose CUDA state a run (its provenance, a previous
        # engine) may have touched: a forked worker cannot initialise CUDA again
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    set_batch_invariant(cfg.batch_invariant)
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
    return kwargs
