"""Triton kernels for the row primitives of ``reference.py`` (same semantics, CUDA tensors).

Every kernel runs one program per (row, block of columns): the row's index, coefficients and mask are scalars
loaded once, and a block of up to ``MAX_BLOCK_D`` columns moves with vector loads and stores. Arithmetic is in
float32 with one rounding to the output dtype, as torch does for bf16/fp16; the patch kernels are compiled
without multiply-add fusion, so ``a * value + b * bank`` rounds like torch's separate multiply and add. Row
offsets are int64, so buffers of more than 2**31 elements are addressed correctly.

The launchers only read tensor metadata (shapes, strides, dtypes, pointers): no host sync, no allocation of
data-dependent size, no branch on tensor values. The launch grid depends on shapes only, so every launcher can
be captured in a CUDA graph and replayed with new buffer contents (row slots, masks, counts, destination rows).
Inputs must have unit stride along the last dimension; row strides are free. The steering table and the patch bank
may hold another float dtype than x (the plugin's are in the model's dtype, and x is the stream vLLM keeps in float32
between two fused adds): they are read as float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_D = 4096


def _launch_shape(d: int, element_size: int) -> tuple[int, int, int]:
    """(BLOCK_D, column blocks, num_warps): a power-of-two block covering D (masked tail), at most MAX_BLOCK_D
    columns; about 16 bytes per thread and per tensor row, 1 to 8 warps."""
    block = min(triton.next_power_of_2(d), MAX_BLOCK_D)
    warps = max(1, min(8, block * element_size // 512))
    return block, triton.cdiv(d, block), warps


def _check_rows(name: str, t: torch.Tensor, d: int, dtype: torch.dtype | None = None) -> None:
    if t.dim() != 2 or t.shape[1] != d:
        raise ValueError(f"{name}: expected [rows, {d}], got {tuple(t.shape)}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: the last dimension must have unit stride, got strides {t.stride()}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")


def _check_values(name: str, t: torch.Tensor, d: int) -> None:
    """A table of values added or written into x's rows: any float dtype (read as float32)."""
    _check_rows(name, t, d)
    if not t.is_floating_point():
        raise ValueError(f"{name}: expected a float dtype, got {t.dtype}")


def _check_out(name: str, out: torch.Tensor, x: torch.Tensor) -> None:
    """``out`` takes x's shape and dtype (x itself, or a tensor that does not overlap it)."""
    _check_rows(name, out, x.shape[1], x.dtype)
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"{name}: expected {x.shape[0]} rows, got {out.shape[0]}")


def _check_per_row(name: str, t: torch.Tensor, rows: int) -> None:
    if t.shape[0] < rows:
        raise ValueError(f"{name}: needs at least {rows} rows, got {t.shape[0]}")


def _check_coef(coef: torch.Tensor, rows: int) -> None:
    if coef.dim() != 2 or coef.shape[1] != 2 or coef.dtype != torch.float32:
        raise ValueError(f"coef: expected float32 [>=T, 2], got {coef.dtype} {tuple(coef.shape)}")
    _check_per_row("coef", coef, rows)


def _mask_bytes(mask: torch.Tensor, rows: int) -> torch.Tensor:
    _check_per_row("mask", mask, rows)
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: expected bool, got {mask.dtype}")
    return mask.view(torch.uint8)  # same bytes, a plain integer pointer for the kernel


@triton.jit
def _steer_add_kernel(x_ptr, table_ptr, slot_ptr, out_ptr, D, stride_x, stride_t, stride_o,
                      BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    slot = tl.load(slot_ptr + row).to(tl.int64)
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok).to(tl.float32)
    t = tl.load(table_ptr + slot * stride_t + cols, mask=ok).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (x + t).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _patch_rows_kernel(x_ptr, bank_ptr, idx_ptr, coef_ptr, mask_ptr, out_ptr, D, stride_x, stride_b, stride_c,
                       stride_c1, stride_o, IN_PLACE: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    hit = tl.load(mask_ptr + row)
    if hit != 0:
        a = tl.load(coef_ptr + row * stride_c)
        b = tl.load(coef_ptr + row * stride_c + stride_c1)
        src = tl.load(idx_ptr + row).to(tl.int64)
        value = tl.load(x_ptr + row * stride_x + cols, mask=ok).to(tl.float32)
        banked = tl.load(bank_ptr + src * stride_b + cols, mask=ok).to(tl.float32)
        new = a * value + b * banked
        tl.store(out_ptr + row * stride_o + cols, new.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        if not IN_PLACE:  # in place, an unmasked row costs only its mask byte
            kept = tl.load(x_ptr + row * stride_x + cols, mask=ok)
            tl.store(out_ptr + row * stride_o + cols, kept, mask=ok)


@triton.jit
def _patch_pair_kernel(x_ptr, extra_ptr, bank_ptr, idx_ptr, coef_ptr, mask_ptr, out_ptr, extra_out_ptr, D,
                       stride_x, stride_e, stride_b, stride_c, stride_c1, stride_o, stride_eo,
                       IN_PLACE: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < D
    hit = tl.load(mask_ptr + row)
    if hit != 0:
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok)
        extra = tl.load(extra_ptr + row * stride_e + cols, mask=ok)
        a = tl.load(coef_ptr + row * stride_c)
        b = tl.load(coef_ptr + row * stride_c + stride_c1)
        src = tl.load(idx_ptr + row).to(tl.int64)
        banked = tl.load(bank_ptr + src * stride_b + cols, mask=ok).to(tl.float32)
        value = x.to(tl.float32) + extra.to(tl.float32)
        new = a * value + b * banked
        tl.store(out_ptr + row * stride_o + cols, new.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(extra_out_ptr + row * stride_eo + cols, tl.zeros([BLOCK_D], extra_out_ptr.dtype.element_ty),
                 mask=ok)
    else:
        if not IN_PLACE:  # in place, an unmasked row costs only its mask byte
            kept = tl.load(x_ptr + row * stride_x + cols, mask=ok)
            kept_extra = tl.load(extra_ptr + row * stride_e + cols, mask=ok)
            tl.store(out_ptr + row * stride_o + cols, kept, mask=ok)
            tl.store(extra_out_ptr + row * stride_eo + cols, kept_extra, mask=ok)


@triton.jit
def _capture_rows_kernel(x_ptr, extra_ptr, src_ptr, dest_ptr, count_ptr, out_ptr, D, stride_x, stride_e,
                         stride_o, HAS_EXTRA: tl.constexpr, BLOCK_D: tl.constexpr):
    j = tl.program_id(0).to(tl.int64)
    n = tl.load(count_ptr).to(tl.int64)
    if j < n:  # programs past the count do nothing: a step that captures nothing costs one empty launch
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        ok = cols < D
        src = tl.load(src_ptr + j).to(tl.int64)
        dest = tl.load(dest_ptr + j).to(tl.int64)
        value = tl.load(x_ptr + src * stride_x + cols, mask=ok).to(tl.float32)
        if HAS_EXTRA:
            value += tl.load(extra_ptr + src * stride_e + cols, mask=ok).to(tl.float32)
        tl.store(out_ptr + dest * stride_o + cols, value.to(out_ptr.dtype.element_ty), mask=ok)


def steer_add(x: torch.Tensor, table: torch.Tensor, row_slot: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """x[i] + table[row_slot[i]] for every row i (added in float32, rounded once), into ``out`` (fresh when None;
    may be x itself: each element is read before it is written, by the same program)."""
    t, d = x.shape
    _check_rows("x", x, d)
    _check_values("table", table, d)
    _check_per_row("row_slot", row_slot, t)
    if out is None:
        out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    else:
        _check_out("out", out, x)
    if t == 0:
        return out
    block, col_blocks, warps = _launch_shape(d, x.element_size())
    _steer_add_kernel[(t, col_blocks)](x, table, row_slot, out, d, x.stride(0), table.stride(0), out.stride(0),
                                       BLOCK_D=block, num_warps=warps)
    return out


def patch_rows(x: torch.Tensor, bank: torch.Tensor, idx: torch.Tensor, coef: torch.Tensor, mask: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x with its masked rows patched (a * x[i] + b * bank[idx[i]] in float32), into ``out`` (fresh when None).
    ``out`` may be x itself (in place: unmasked rows are then not touched at all), otherwise it must not overlap
    x."""
    t, d = x.shape
    _check_rows("x", x, d)
    _check_values("bank", bank, d)
    _check_per_row("idx", idx, t)
    _check_coef(coef, t)
    mask_u8 = _mask_bytes(mask, t)
    if out is None:
        out = torch.empty((t, d), dtype=x.dtype, device=x.device)
    else:
        _check_out("out", out, x)
    in_place = out.data_ptr() == x.data_ptr() and out.stride() == x.stride()
    if t == 0:
        return out
    block, col_blocks, warps = _launch_shape(d, x.element_size())
    _patch_rows_kernel[(t, col_blocks)](x, bank, idx, coef, mask_u8, out, d, x.stride(0), bank.stride(0),
                                        coef.stride(0), coef.stride(1), out.stride(0), IN_PLACE=in_place,
                                        BLOCK_D=block, num_warps=warps, enable_fp_fusion=False)
    return out


def patch_pair(x: torch.Tensor, extra: torch.Tensor, bank: torch.Tensor, idx: torch.Tensor, coef: torch.Tensor,
               mask: torch.Tensor, in_place: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream kept as two halves (x + extra), in one pass into two fresh tensors, or into x and extra
    themselves (``in_place``: unmasked rows are then not touched at all): a masked row gets the patched value of
    x + extra (float32) in the first and zeros in the second; other rows keep both halves bit for bit."""
    t, d = x.shape
    _check_rows("x", x, d)
    _check_rows("extra", extra, d)
    if extra.shape[0] != t:
        raise ValueError(f"extra: expected {t} rows, got {extra.shape[0]}")
    _check_values("bank", bank, d)
    _check_per_row("idx", idx, t)
    _check_coef(coef, t)
    mask_u8 = _mask_bytes(mask, t)
    if in_place:
        out, extra_out = x, extra
    else:
        out = torch.empty((t, d), dtype=x.dtype, device=x.device)
        extra_out = torch.empty((t, d), dtype=extra.dtype, device=extra.device)
    if t == 0:
        return out, extra_out
    block, col_blocks, warps = _launch_shape(d, max(x.element_size(), extra.element_size()))
    _patch_pair_kernel[(t, col_blocks)](x, extra, bank, idx, coef, mask_u8, out, extra_out, d, x.stride(0),
                                        extra.stride(0), bank.stride(0), coef.stride(0), coef.stride(1),
                                        out.stride(0), extra_out.stride(0), IN_PLACE=in_place, BLOCK_D=block,
                                        num_warps=warps, enable_fp_fusion=False)
    return out, extra_out


def capture_rows(x: torch.Tensor, extra: torch.Tensor | None, src_rows: torch.Tensor, dest_rows: torch.Tensor,
                 count: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[dest_rows[j]] = x[src_rows[j]] (+ extra[src_rows[j]], summed in float32), cast to out's dtype, for
    j < count[0]. ``count`` is a one-element integer tensor on the device, read by the kernel; the grid has
    len(src_rows) programs (a static maximum) and those past the count return at once. Destination rows must be
    distinct; other rows of ``out`` are left alone. Returns ``out``."""
    d = x.shape[1]
    _check_rows("x", x, d)
    _check_rows("out", out, d)
    if extra is not None:
        _check_rows("extra", extra, d)
    k = src_rows.shape[0]
    _check_per_row("dest_rows", dest_rows, k)
    if count.numel() < 1 or count.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"count: expected a one-element int32/int64 tensor, got {count.dtype} {tuple(count.shape)}")
    if k == 0:
        return out
    block, col_blocks, warps = _launch_shape(d, max(x.element_size(), out.element_size()))
    _capture_rows_kernel[(k, col_blocks)](x, x if extra is None else extra, src_rows, dest_rows, count, out, d,
                                          x.stride(0), x.stride(0) if extra is None else extra.stride(0),
                                          out.stride(0), HAS_EXTRA=extra is not None, BLOCK_D=block,
                                          num_warps=warps)
    return out
