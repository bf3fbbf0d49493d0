"""How this process's threads wait for the GPU. By default CUDA spins a waiting thread on its CPU, so a timed run's
CPU seconds hold its waits as well as its host work, and a slower GPU looks like a slower host. With blocking sync
(``use_blocking_sync``) a waiting thread sleeps: its CPU seconds are then its own host work alone, at the price of
a wake-up after each wait."""

from __future__ import annotations

import ctypes

CU_CTX_SCHED_BLOCKING_SYNC = 0x4


def use_blocking_sync(device: int = 0) -> None:
    """Make ``device``'s primary context (the one torch and vLLM use) wait by sleeping. Call it before anything in
    this process starts CUDA."""
    cuda = ctypes.CDLL("libcuda.so.1")
    handle = ctypes.c_int()
    set_flags = getattr(cuda, "cuDevicePrimaryCtxSetFlags_v2", None) or cuda.cuDevicePrimaryCtxSetFlags
    for name, call, args in (("cuInit", cuda.cuInit, (0,)),
                             ("cuDeviceGet", cuda.cuDeviceGet, (ctypes.byref(handle), device)),
                             ("cuDevicePrimaryCtxSetFlags", set_flags, (handle, CU_CTX_SCHED_BLOCKING_SYNC))):
        code = call(*args)
        if code != 0:
            raise RuntimeError(f"{name} failed: CUDA error {code}")
