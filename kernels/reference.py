"""Plain-torch row primitives. Shapes: x [T, D]; table [S, D]; row_slot [>=T] int64; rows [K] int64.

Patching reads per-row buffers of at least T rows: ``idx`` (bank row), ``coef`` (a, b) float32, ``mask`` bool.
A patched row becomes ``a * value + b * bank[idx]`` computed in float32: (a, b) = (1 - alpha, alpha) patches
toward a source (alpha = 1 is an exact replacement), (1, 1) adds the bank row. Unmasked rows keep their bits.
Capture (``capture_rows_ref``) writes selected rows into a persistent buffer, up to a count held in a tensor.
"""

import torch


def gather_add(x: torch.Tensor, table: torch.Tensor, row_slot: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """x[i] + table[row_slot[i]] for every row i (slot 0 holds zeros, so unsteered rows keep their value), into
    ``out`` (fresh when None; may be x itself)."""
    steering = table.index_select(0, row_slot[: x.shape[0]])
    return x + steering if out is None else torch.add(x, steering, out=out)


def gather_rows(x: torch.Tensor, rows: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
    """A fresh copy of x[rows] (plus extra[rows]), safe from later in-place ops on x."""
    out = x.index_select(0, rows)
    if extra is not None:
        out = out + extra.index_select(0, rows)
    return out


def _patched(value: torch.Tensor, bank, idx, coef) -> torch.Tensor:
    n = value.shape[0]
    return coef[:n, :1] * value + coef[:n, 1:] * bank.index_select(0, idx[:n]).float()


def patch_rows(x, bank, idx, coef, mask) -> torch.Tensor:
    """x with its masked rows patched."""
    new = _patched(x.float(), bank, idx, coef).to(x.dtype)
    return torch.where(mask[: x.shape[0], None], new, x)


def patch_pair(x, extra, bank, idx, coef, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream kept as two halves (x + extra): a masked row gets the patched stream in x and zero in
    extra, so the later add yields exactly the patched value; other rows keep both halves bit for bit."""
    m = mask[: x.shape[0], None]
    new = _patched(x.float() + extra.float(), bank, idx, coef).to(x.dtype)
    return torch.where(m, new, x), torch.where(m, torch.zeros_like(extra), extra)


def capture_rows_ref(x, extra, src_rows, dest_rows, count, out) -> torch.Tensor:
    """Capture into a persistent buffer: out[dest_rows[j]] = x[src_rows[j]] (+ extra[src_rows[j]], summed in
    float32), cast to out's dtype, for j < count[0] (at most len(src_rows)); other rows of out are left alone.
    ``count`` is a one-element tensor read here on the host (a sync); the Triton kernel reads it on the device.
    Destination rows must be distinct. Returns ``out``."""
    n = min(int(count.reshape(-1)[0]), src_rows.shape[0])
    src = src_rows[:n]
    value = x.index_select(0, src).float()
    if extra is not None:
        value = value + extra.index_select(0, src).float()
    out.index_copy_(0, dest_rows[:n], value.to(out.dtype))
    return out
