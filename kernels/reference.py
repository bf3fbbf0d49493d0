"""Plain-torch row primitives. Shapes: x [T, D]; table [S, D]; row_slot [>=T] int64; rows [K] int64."""

import torch


def gather_add(x: torch.Tensor, table: torch.Tensor, row_slot: torch.Tensor) -> torch.Tensor:
    """x[i] + table[row_slot[i]] for every row i (slot 0 holds zeros, so unsteered rows keep their value)."""
    return x + table.index_select(0, row_slot[: x.shape[0]])


def gather_rows(x: torch.Tensor, rows: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
    """A fresh copy of x[rows] (plus extra[rows]), safe from later in-place ops on x."""
    out = x.index_select(0, rows)
    if extra is not None:
        out = out + extra.index_select(0, rows)
    return out
