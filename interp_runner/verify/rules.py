"""Which comparison applies to two runs, and how far their float results may differ where it is not exact.

Runs compute the same bits only where they share the kernel path: the device (the GPU models, or the CPU model and
everything ``kernel_path.CPU_KERNEL_KEYS`` lists), the compute dtype, torch and vLLM (and, on a GPU, vLLM's
batch-invariant kernels). Those compare **exactly**. Elsewhere float arrays may differ by ``rtol`` times the
array's largest |value|, never by less than one step of the array's storage dtype there:

- CPU runs on other kernel paths (``CPU_RTOL``). Measured in float32 on tiny_random (an AVX2 AMD EPYC, oneDNN's
  GEMMs capped to SSE4.1 against its AVX2 ones): log-probabilities, probabilities and activations moved by at most
  3e-6 of their array's largest |value|, differences and ratios of probabilities (``*effect``, ``recovered``) by
  1.5e-5; a plain-torch float32 forward of tiny_random on an Intel Xeon (AVX-512, AMX) against that AMD EPYC moved
  log-probabilities by 3.3e-7 of their scale. float32 allows 1e-4. Differences of probabilities err as the
  probabilities they subtract: their scale is at least the store's largest probability. The bfloat16 and float16
  entries are the GPU's (not measured on a CPU).
- GPU runs without batch invariance (``GPU_RTOL``; a request's numbers depend on what it was batched with):
  probabilities by the larger recorded ``noise_floor`` of the two stores (the largest |in-batch - solo|
  probability one run measured), differences of probabilities by twice that, never less than ``MIN_PROB_ATOL``;
  other floats by ``GPU_RTOL`` of the compute dtype.

Integer, boolean and string arrays are always exact, except the top-k token ids of a tolerant comparison, which are
compared as sets (``arrays.compare_top_k``), and a kind's threshold flags. Arrays a kind declares derived from
others (its ``verify_rules``) take the tolerance of what they derive from (``derived``). Where generated tokens
were teacher-forced to the reference's (a rerun on another kernel path), a reference token must also stay the
greedy choice within the log-probability tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from interp_runner.engine.kernel_path import CPU_KERNEL_KEYS

CPU_RTOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2}
GPU_RTOL = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 5e-2}
STORAGE_EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7}  # one step of a reduced-precision stored value, relative
MIN_PROB_ATOL = 1e-6


def kernel_path(attrs: dict) -> dict:
    """What besides its inputs decides a run's numbers, from its manifest; None where the store does not say."""
    host, versions = attrs.get("host") or {}, attrs.get("versions") or {}
    engine = attrs.get("engine") or {}
    path = {"dtype": engine.get("dtype"), "torch": versions.get("torch"), "vllm": versions.get("vllm")}
    gpus = host.get("gpus")
    if gpus:
        path["gpus"] = ", ".join(gpus)
        return path
    cpu = host.get("cpu")
    for key in CPU_KERNEL_KEYS:
        path[f"cpu.{key}"] = cpu.get(key) if isinstance(cpu, dict) else None
    return path


def path_differences(a: dict, b: dict) -> list[str]:
    """``key: b -> a`` for each entry of kernel paths ``a`` (compared run) and ``b`` (reference) that differs or
    that either does not record."""
    out, keys = [], sorted(a.keys() | b.keys())
    for side, path in (("compared run", a), ("reference", b)):
        cpu = [k for k in path if k.startswith("cpu.")]
        if cpu and all(path[k] is None for k in cpu):  # a store made before CPU kernel paths were recorded
            out.append(f"the {side} records no CPU kernel path")
            keys = [k for k in keys if not k.startswith("cpu.")]
    for key in keys:
        x, y = a.get(key), b.get(key)
        if x is None or y is None:
            out.append(f"{key} not recorded" if x == y else f"{key}: {y!r} -> {x!r}")
        elif x != y:
            out.append(f"{key}: {y!r} -> {x!r}")
    return out


def describe_path(path: dict) -> str:
    if "gpus" in path:
        device = path["gpus"]
    else:
        isa = "/".join(path.get("cpu.isa") or ())
        device = (f"CPU {path.get('cpu.model')} ({path.get('cpu.arch')}; {isa}; ATen {path.get('cpu.aten')}; vLLM "
                  f"{path.get('cpu.vllm_kernels')} kernels; {path.get('cpu.threads')} threads"
                  + (f"; {path['cpu.env']}" if path.get("cpu.env") else "") + ")")
    return f"{device}, {path.get('dtype')}, torch {path.get('torch')}, vLLM {path.get('vllm')}"


@dataclass(frozen=True)
class Tolerance:
    exact: bool
    reason: str
    noise_floor: float | None = None  # GPU runs without batch invariance: the larger recorded noise floor
    rtol: float = 0.0
    rtol_source: str = ""  # which table and dtype ``rtol`` comes from
    teacher_forced: bool = False  # the compared run's generated tokens were forced to the reference's

    def atol(self, kind: str, scale: Callable[[], float], stored_dtype: str = "",
             prob_scale: Callable[[], float] = lambda: 0.0) -> tuple[float, str]:
        """(allowed |difference|, how it was chosen) for a float array whose largest |value| is ``scale()``; 0 when
        exact. Differences of probabilities err as the probabilities they subtract: their scale is at least the
        store's largest probability (``prob_scale()``)."""
        if self.exact:
            return 0.0, "exact"
        if self.noise_floor is not None and kind in ("probability", "probability difference"):
            factor = 2.0 if kind == "probability difference" else 1.0
            return max(factor * self.noise_floor, MIN_PROB_ATOL), f"{factor:g} x noise floor"
        storage = STORAGE_EPS.get(stored_dtype, 0.0)
        if storage > self.rtol:
            return storage * scale(), f"{stored_dtype} step x scale"
        if kind == "probability difference":
            how = f"rtol {self.rtol:g} ({self.rtol_source}) x probability scale"
            return self.rtol * max(scale(), prob_scale()), how
        return self.rtol * scale(), f"rtol {self.rtol:g} ({self.rtol_source}) x scale"

    def describe(self) -> str:
        if self.exact:
            return f"exact ({self.reason})"
        scaled = f"within {self.rtol:g} ({self.rtol_source}) x the array's largest |value|"
        if self.noise_floor is None:
            floats = (f"floats {scaled} (differences of probabilities: at least the store's largest probability), "
                      "or one storage step of float16/bfloat16 values")
        else:
            floats = (f"probabilities within max(noise floor {self.noise_floor:.3g}, {MIN_PROB_ATOL:g}), "
                      f"differences of probabilities within twice that, other floats {scaled}")
        forced = ("; generated tokens teacher-forced to the reference's: their log-probabilities compared, and each "
                  "must stay the greedy choice within that tolerance" if self.teacher_forced else "")
        return (f"tolerant ({self.reason}): {floats}; top-k token ids as sets; other integers, booleans and strings "
                f"exact{forced}")


def choose_tolerance(new, ref, exact: bool = False) -> Tolerance:
    """The comparison of the ``new`` run against the reference ``ref`` (``stores.Store``), and why."""
    if exact:
        return Tolerance(True, "--exact")
    a, b = kernel_path(new.attrs), kernel_path(ref.attrs)
    differ = path_differences(a, b)
    forced = new.teacher_forced_by(ref)
    on_gpu = new.on_gpu or ref.on_gpu
    if not differ and (not on_gpu or (new.batch_invariant and ref.batch_invariant)):
        kind = "batch-invariant runs, " if on_gpu else ""
        return Tolerance(True, f"{kind}same kernel path: {describe_path(a)}", teacher_forced=forced)
    if not on_gpu:
        reason = "CPU runs on other kernel paths: " + "; ".join(differ)
    elif new.on_gpu != ref.on_gpu:
        reason = "one run on GPU, one on CPU"
    elif new.batch_invariant and ref.batch_invariant:
        reason = "batch-invariant runs, but on other kernel paths: " + "; ".join(differ)
    else:
        reason = "GPU runs without engine.batch_invariant"
    table, name = (GPU_RTOL, "GPU") if on_gpu else (CPU_RTOL, "CPU")
    dtypes = [s.compute_dtype for s in (new, ref)]
    rtol, dtype = max((table.get(d, max(table.values())), d or "unknown dtype") for d in dtypes)
    floor = None
    if on_gpu:
        floors = [s.attrs["noise_floor"] for s in (new, ref) if isinstance(s.attrs.get("noise_floor"), (int, float))]
        floor = max(floors) if floors else None
    return Tolerance(False, reason, floor, rtol, f"{name} {dtype}", forced)
