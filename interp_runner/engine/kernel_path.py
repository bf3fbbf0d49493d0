"""What picks the kernels that compute a run's numbers on this machine, recorded in a store's ``host.cpu``.

vLLM's CPU build loads one of three kernel libraries by ISA (``vllm._C_AVX2``, ``vllm._C_AVX512``, ``vllm._C`` with
AVX-512 BF16), picks AMX attention and GEMM kernels for bfloat16 where the CPU has AMX, runs its GEMMs through
oneDNN (which dispatches on the ISA itself, capped by ``ONEDNN_MAX_CPU_ISA``), and leaves the rest to torch's
vectorized kernels (``torch.backends.cpu.get_cpu_capability()``, capped by ``ATEN_CPU_CAPABILITY``). Each of these,
and the thread count, can change the order of float sums: runs agree bit for bit only where all of them agree.
"""

from __future__ import annotations

import importlib.util
import os
import platform

# /proc/cpuinfo flags that select kernels (x86, then aarch64's "Features")
KERNEL_FLAGS = frozenset({
    "sse4_1", "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512dq", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16",
    "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm",
})
# environment variables that cap or change the kernels and threads
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
              "OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_SGL_KERNEL")
# the entries of ``cpu_info()`` that must agree for two CPU runs to compute the same bits
CPU_KERNEL_KEYS = ("model", "arch", "isa", "aten", "vllm_kernels", "threads", "env")


def _proc_cpuinfo() -> tuple[str, str, set[str]]:
    """(model name, vendor, flags) of the first processor in /proc/cpuinfo; empty where there is none."""
    model = vendor = ""
    flags: set[str] = set()
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return model, vendor, flags
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "model name":
            model = value
        elif key == "vendor_id":
            vendor = value
        elif key in ("flags", "Features"):
            flags = set(value.split())
    return model, vendor, flags


def vllm_cpu_kernels(vendor: str, flags: set[str]) -> str:
    """The kernel library vLLM's CPU platform loads (``CpuPlatform.import_kernels``), plus zentorch's GEMMs where
    vLLM uses them (an AMD CPU with AVX-512 and the package installed)."""
    import torch

    if platform.machine() not in ("x86_64", "AMD64"):
        return platform.machine()
    if torch.cpu._is_avx512_supported():
        kernels = "avx512_bf16" if torch.cpu._is_avx512_bf16_supported() else "avx512"
    else:
        kernels = "avx2"
    if vendor == "AuthenticAMD" and "avx512f" in flags and importlib.util.find_spec("zentorch") is not None:
        kernels += "+zentorch"
    return kernels


def cpu_info() -> dict:
    """This machine's CPU as it bears on kernel choice (``CPU_KERNEL_KEYS``), plus its vendor."""
    import torch

    model, vendor, flags = _proc_cpuinfo()
    return {
        "model": model or platform.processor() or platform.machine(),
        "vendor": vendor,
        "arch": platform.machine(),
        "isa": sorted(flags & KERNEL_FLAGS),
        "aten": torch.backends.cpu.get_cpu_capability(),
        "vllm_kernels": vllm_cpu_kernels(vendor, flags),
        "threads": torch.get_num_threads(),
        "env": {name: os.environ[name] for name in KERNEL_ENV if os.environ.get(name)},
    }
