"""Interp kernels: the row-wise primitives the vLLM plugin's ops are made of.

Each primitive has a plain-torch implementation in ``reference`` (the CPU path and the oracle) and, for CUDA
tensors, a Triton kernel in ``triton_rows``. The functions here pick one by the tensors' device: Triton on CUDA
when it imports, the reference otherwise. Triton is imported on first use, so importing this package never
needs it; ``backend(device)`` says which one a device gets.
"""

from __future__ import annotations

import torch

from . import reference
from .reference import capture_rows_ref, gather_add, gather_rows

__all__ = [
    "backend",
    "capture_rows",
    "capture_rows_ref",
    "gather_add",
    "gather_rows",
    "patch_pair",
    "patch_rows",
    "steer_add",
    "triton_import_error",
]

_triton_rows = None
_triton_error: str | None = None


def _triton():
    """The Triton kernel module, or None where Triton does not import (the reason is kept)."""
    global _triton_rows, _triton_error
    if _triton_rows is None and _triton_error is None:
        try:
            from . import triton_rows
        except Exception as err:  # a missing or broken Triton: the reference serves every device
            _triton_error = f"{type(err).__name__}: {err}"
        else:
            _triton_rows = triton_rows
    return _triton_rows


def triton_import_error() -> str | None:
    """Why the Triton kernels could not be imported (None when they could, or were not tried yet)."""
    return _triton_error


def backend(device: torch.device | str) -> str:
    """"triton" or "torch": the implementation the functions here use for tensors on ``device``."""
    return "triton" if torch.device(device).type == "cuda" and _triton() is not None else "torch"


def _kernels(x: torch.Tensor):
    return _triton() if x.is_cuda else None


# a call outside CUDA graphs on at least this many elements of x runs the kernel (see ``steer_add``)
EAGER_KERNEL_ELEMENTS = 1 << 22


def steer_add(x: torch.Tensor, table: torch.Tensor, row_slot: torch.Tensor, eager: bool = False,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x[i] + table[row_slot[i]] for every row i (slot 0 holds zeros), into ``out`` (fresh when None; may be x
    itself).

    ``eager``: the call is not captured into a CUDA graph, so the host's time per call counts; the reference's two
    ATen calls (the same values, bit for bit) take less of it than a Triton launch. From ``EAGER_KERNEL_ELEMENTS``
    on the device's time weighs more: the kernel reads x once, where the reference also writes and reads back the
    gathered rows (4 bytes an element in bfloat16, ~17 MB and some 6 µs at 4M elements)."""
    kernels = _kernels(x)
    if kernels is None or (eager and x.numel() < EAGER_KERNEL_ELEMENTS):
        return reference.gather_add(x, table, row_slot, out=out)
    return kernels.steer_add(x, table, row_slot, out=out)


def patch_rows(x: torch.Tensor, bank: torch.Tensor, idx: torch.Tensor, coef: torch.Tensor, mask: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x with its masked rows patched, into ``out`` (fresh when None; may be x itself)."""
    kernels = _kernels(x)
    if kernels is not None:
        return kernels.patch_rows(x, bank, idx, coef, mask, out=out)
    new = reference.patch_rows(x, bank, idx, coef, mask)
    return new if out is None else out.copy_(new)


def patch_pair(x: torch.Tensor, extra: torch.Tensor, bank: torch.Tensor, idx: torch.Tensor, coef: torch.Tensor,
               mask: torch.Tensor, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, extra) with the masked rows' sum patched into x and zeroed in extra: fresh tensors, or x and extra
    themselves (``in_place``)."""
    kernels = _kernels(x)
    if kernels is not None:
        return kernels.patch_pair(x, extra, bank, idx, coef, mask, in_place=in_place)
    new, new_extra = reference.patch_pair(x, extra, bank, idx, coef, mask)
    return (x.copy_(new), extra.copy_(new_extra)) if in_place else (new, new_extra)


def capture_rows(x: torch.Tensor, extra: torch.Tensor | None, src_rows: torch.Tensor, dest_rows: torch.Tensor,
                 count: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[dest_rows[j]] = x[src_rows[j]] (+ extra[src_rows[j]]) for j < count[0]; returns ``out``. On CUDA the
    count is read by the kernel (graph-capturable); the reference reads it on the host."""
    kernels = _kernels(x)
    if kernels is None:
        return reference.capture_rows_ref(x, extra, src_rows, dest_rows, count, out)
    return kernels.capture_rows(x, extra, src_rows, dest_rows, count, out)
