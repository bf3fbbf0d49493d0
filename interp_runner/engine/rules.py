"""vLLM 0.26's own rules for the engine settings, checked against the model's config before any engine starts.

vLLM checks these only while it starts (a traceback, after minutes on a large model); here each one fails in
``prepare()``, dry runs included, naming the config key. Every rule cites the vLLM check it mirrors.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

import numpy as np

from interp_runner.config.errors import ConfigError
from interp_runner.config.schema import RunBase
from interp_runner.engine.settings import CPU_KV_CACHE_BYTES, on_gpu
from interp_runner.models.facts import ModelFacts
from interp_runner.contracts import DECODE, PREFILL
from interp_runner.compile.plan import Plan

CPU_BLOCK_TOKENS = 128  # vllm/platforms/cpu.py: the block size of the CPU KV cache unless one is given
GPU_BLOCK_TOKENS = 16  # the smallest block a CUDA attention backend uses
VLLM_ASSUMED_MODEL_LEN = 2048  # vllm/config/model.py: the length vLLM takes where the model's config names none
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
DTYPE_MAX = {"float32": float(np.finfo(np.float32).max), "float16": 65504.0, "bfloat16": 3.3895313892515355e38}


def check_engine(cfg: RunBase, facts: ModelFacts, gpu: bool | None = None) -> None:
    """Every engine setting vLLM would refuse for this model on this machine, reported together."""
    gpu = on_gpu() if gpu is None else gpu
    problems = (_max_model_len(cfg, facts) + _tensor_parallel(cfg, facts) + _devices(cfg, gpu)
                + _scheduler(cfg, facts, gpu) + _kv_cache(cfg, facts, gpu))
    if cfg.engine.batch_invariant and not gpu:
        problems.append(("engine.batch_invariant", "vLLM's batch-invariant mode needs a GPU (its kernels are Triton "
                                                   "kernels) and this machine has none"))
    if problems:
        raise ConfigError(problems)


def model_dtype(cfg: RunBase, facts: ModelFacts) -> str:
    """The dtype the engine computes in: ``engine.dtype``, or for "auto" the weights' (float32 weights run in
    bfloat16, vLLM's preferred dtype on CPUs and current GPUs: ``_resolve_auto_dtype``)."""
    if cfg.engine.dtype != "auto":
        return cfg.engine.dtype
    return facts.dtype if facts.dtype in ("float16", "bfloat16") else "bfloat16"


def check_plan_values(plan: Plan, cfg: RunBase, facts: ModelFacts) -> None:
    """Steering sums and patch sources become the engine's dtype on the workers: they must stay finite there."""
    dtype = model_dtype(cfg, facts)
    limit = DTYPE_MAX[dtype]
    largest, seen = 0.0, set()
    for request in plan.requests:
        payload = request.payload
        steer = payload.steer if payload is not None else ()
        if not steer or steer in seen:
            continue
        seen.add(steer)
        sums: dict[tuple, np.ndarray] = defaultdict(lambda: np.zeros(facts.hidden_size, dtype=np.float32))
        with np.errstate(over="ignore"):
            for term in steer:
                if term.vector not in plan.vectors:  # derived from earlier stages' results (``Plan.derive_vectors``)
                    continue
                for phase in (PREFILL, DECODE):
                    if term.phases & phase:
                        sums[term.site, phase] += plan.vectors[term.vector] * np.float32(term.scale)
        largest = max([largest] + [float(np.abs(v).max()) for v in sums.values()])
    if largest > limit:
        raise ConfigError.at("engine.dtype", f"steering adds up to {largest:.3g} at some site, beyond {dtype}'s range "
                                             f"(±{limit:.4g}), the dtype the engine computes in")
    sources = max((float(np.abs(v).max()) for v in plan.sources.values()), default=0.0)
    if sources > limit:
        raise ConfigError.at("engine.dtype", f"a patch source holds {sources:.3g}, beyond {dtype}'s range "
                                             f"(±{limit:.4g}), the dtype the engine computes in")


def _max_model_len(cfg: RunBase, facts: ModelFacts) -> list:
    """``_get_and_verify_max_len``: no longer than the model's config allows, unless VLLM_ALLOW_LONG_MAX_MODEL_LEN."""
    wanted, allowed = cfg.engine.max_model_len, facts.max_model_len
    if wanted is None or allowed is None or wanted <= allowed \
            or os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "0") not in ("", "0"):
        return []
    return [("engine.max_model_len", f"{wanted} is longer than the model allows: {facts.max_model_len_key} = "
                                     f"{allowed} in {facts.path}/config.json")]


def _tensor_parallel(cfg: RunBase, facts: ModelFacts) -> list:
    """``ModelConfig.verify_with_parallel_config`` and the sharded layers (``QKVParallelLinear``,
    ``MergedColumnParallelLinear``): each rank takes an equal share of heads and MLP width; KV heads are split or,
    when fewer than the ranks, replicated evenly."""
    tp = cfg.engine.tensor_parallel_size
    if tp == 1:
        return []
    shares = [(facts.num_heads, "attention heads"), (facts.intermediate_size, "MLP width (intermediate_size)")]
    uneven = [f"{n} {what}" for n, what in shares if n % tp]
    kv = facts.num_kv_heads
    if (kv >= tp and kv % tp) or (kv < tp and tp % kv):
        uneven.append(f"{kv} key/value heads")
    if not uneven:
        return []
    return [("engine.tensor_parallel_size", f"{tp} ranks cannot share the model's {' and '.join(uneven)} evenly")]


def _devices(cfg: RunBase, gpu: bool) -> list:
    """A rank per GPU; on CPUs a rank per process, each bound to cores (``OMPProcessManager``)."""
    tp = cfg.engine.tensor_parallel_size
    key = "engine.tensor_parallel_size"
    if gpu:
        import torch

        count = torch.cuda.device_count()
        return [(key, f"{tp} ranks need {tp} GPUs, this machine shows {count}")] if tp > count else []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if tp > cores:
        return [(key, f"{tp} ranks need {tp} CPU cores, this process may use {cores}")]
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind == "auto" and tp > 1 and os.environ.get("VLLM_CPU_SIM_MULTI_NUMA", "0") == "0":
        nodes = _numa_nodes()
        if tp > nodes:
            return [(key, f"on CPUs vLLM binds each rank to its own NUMA node and this machine has {nodes}: set "
                          f"VLLM_CPU_OMP_THREADS_BIND to one core list per rank (e.g. '0|1')")]
    elif bind not in ("auto", "nobind") and len(bind.split("|")) != tp:
        return [(key, f"{tp} ranks, but VLLM_CPU_OMP_THREADS_BIND={bind!r} lists cores for "
                      f"{len(bind.split('|'))}")]
    return []


def _numa_nodes() -> int:
    """The memory nodes this process may use (vLLM's ``get_visible_memory_node``)."""
    visible = os.environ.get("CPU_VISIBLE_MEMORY_NODES", "")
    try:
        with open("/proc/self/status") as f:
            line = next((x for x in f if x.startswith("Mems_allowed_list:")), "")
    except OSError:
        return 1
    nodes = set()
    for part in line.partition(":")[2].strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            nodes.update(range(int(lo), int(hi or lo) + 1))
    if visible:
        nodes &= {int(n) for n in visible.split(",") if n.strip().isdigit()}
    return max(len(nodes), 1)


def _large_gpu() -> bool:
    """Whether the first GPU has 70 GiB or more: vLLM's larger batch defaults (``EngineArgs.get_batch_defaults``)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total >= 70 * 2**30
    except Exception:  # no NVML: the smaller defaults
        return False


def _default_batched_tokens(tp: int, gpu: bool) -> int:
    """``EngineArgs.get_batch_defaults`` for the LLM class: 4096 per rank on CPUs, 8192 on GPUs (16384 on those
    with 70 GiB or more)."""
    if not gpu:
        return 4096 * tp
    return 16384 if _large_gpu() else 8192


def _default_max_num_seqs(tp: int, gpu: bool) -> int:
    """The largest ``max_num_seqs`` vLLM picks by default here (``get_batch_defaults``): 256 per rank on CPUs, 256
    on GPUs (1024 on those with 70 GiB or more)."""
    if not gpu:
        return 256 * tp
    return 1024 if _large_gpu() else 256


def _scheduler(cfg: RunBase, facts: ModelFacts, gpu: bool) -> list:
    """``SchedulerConfig.verify_max_model_len``: a step holds at least one token of each sequence it runs
    (chunked prefill, on for these models, lets a step hold less than a whole prompt)."""
    e = cfg.engine
    if e.max_num_seqs is None:  # vLLM's defaults agree with each other; a batch size set beside them may not
        seqs = _default_max_num_seqs(e.tensor_parallel_size, gpu)
        if e.max_num_batched_tokens is not None and e.max_num_batched_tokens < seqs:
            return [("engine.max_num_batched_tokens", f"{e.max_num_batched_tokens} is less than vLLM's default "
                                                      f"max_num_seqs here ({seqs}): set engine.max_num_seqs too")]
        return []
    if e.max_num_batched_tokens is not None:
        if e.max_num_batched_tokens < e.max_num_seqs:
            return [("engine.max_num_batched_tokens", f"{e.max_num_batched_tokens} is less than engine.max_num_seqs "
                                                      f"= {e.max_num_seqs}")]
        return []
    tokens = min(e.max_num_seqs * model_len(cfg, facts), _default_batched_tokens(e.tensor_parallel_size, gpu))
    if tokens < e.max_num_seqs:
        return [("engine.max_num_seqs", f"{e.max_num_seqs} is more than vLLM's default max_num_batched_tokens here "
                                        f"({tokens}): lower it or set engine.max_num_batched_tokens")]
    return []


def _kv_cache(cfg: RunBase, facts: ModelFacts, gpu: bool) -> list:
    """``check_enough_kv_cache_memory``: the KV cache of a rank holds at least one sequence of max_model_len
    tokens. On GPUs without ``kv_cache_memory_bytes`` vLLM sizes it by profiling: nothing to check here."""
    e = cfg.engine
    budget = e.kv_cache_memory_bytes if e.kv_cache_memory_bytes is not None else None if gpu else CPU_KV_CACHE_BYTES
    if budget is None:
        return []
    block = e.kv_block_size(gpu) or (GPU_BLOCK_TOKENS if gpu else CPU_BLOCK_TOKENS)
    kv_heads = max(1, facts.num_kv_heads // e.tensor_parallel_size)
    per_token = 2 * facts.num_layers * kv_heads * facts.head_dim * DTYPE_BYTES[model_dtype(cfg, facts)]
    length = model_len(cfg, facts)
    needed = math.ceil(length / block) * block * per_token
    if needed <= budget:
        return []
    key = "engine.kv_cache_memory_bytes" if e.kv_cache_memory_bytes is not None else "engine.max_model_len"
    return [(key, f"one sequence of engine.max_model_len = {length} tokens needs {needed} bytes of KV "
                  f"cache per rank ({per_token} a token), more than the {budget} there are")]


def model_len(cfg: RunBase, facts: ModelFacts) -> int:
    """The longest sequence the engine takes: ``engine.max_model_len``, or where it is null the model's own maximum
    (vLLM's assumption, 2048, where the model's config names none)."""
    return cfg.engine.max_model_len or facts.max_model_len or VLLM_ASSUMED_MODEL_LEN


def with_model_len(cfg: RunBase, facts: ModelFacts) -> RunBase:
    """``cfg`` with ``engine.max_model_len`` decided (``model_len``): what a plan checks its prompts against, the
    engine takes and the store records."""
    if cfg.engine.max_model_len is not None:
        return cfg
    return cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"max_model_len": model_len(cfg, facts)})})
