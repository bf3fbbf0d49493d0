"""Host arrays to the device without waiting for the GPU."""

from __future__ import annotations

import numpy as np
import torch

STAGING_BYTES = 16 << 20  # the pinned ring of a CUDA engine's planner


class PinnedRing:
    """Host arrays to the device without a wait: each is written into the next free part of one pinned buffer and
    copied from there asynchronously. The buffer is rewritten from its start only after the stream has finished
    every copy queued so far (one wait per ``nbytes`` uploaded). With ``nbytes`` 0 (CPU engines) arrays are copied
    directly."""

    ALIGN = 64

    def __init__(self, nbytes: int, device: torch.device, synchronize=None):
        self.device = device
        # on the host even where the engine sets a default device for model construction
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device="cpu",
                                  pin_memory=nbytes > 0 and device.type == "cuda")
        self.nbytes = nbytes
        self.offset = 0
        self.wraps = 0
        self._synchronize = synchronize or (lambda: torch.cuda.current_stream().synchronize())
        self._typed: dict[np.dtype, tuple[np.ndarray, torch.Tensor]] = {}  # the whole buffer as each dtype

    @classmethod
    def for_device(cls, device: torch.device) -> PinnedRing:
        """The planner's ring: ``STAGING_BYTES`` on a CUDA device, none (plain copies) elsewhere."""
        return cls(STAGING_BYTES if device.type == "cuda" else 0, device)

    def _views(self, dtype: np.dtype) -> tuple[np.ndarray, torch.Tensor]:
        views = self._typed.get(dtype)
        if views is None:
            torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
            whole = self.buffer[: self.nbytes - self.nbytes % dtype.itemsize]
            views = self._typed[dtype] = (whole.numpy().view(dtype), whole.view(torch_dtype))
        return views

    def upload(self, array: np.ndarray, into: torch.Tensor | None = None) -> torch.Tensor:
        """``array`` on the device: a new tensor, or copied into ``into`` (same number of elements)."""
        array = np.ascontiguousarray(array)
        nbytes = array.nbytes
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        if size > self.nbytes:  # larger than the ring (or no ring): a plain copy
            host = torch.from_numpy(array if array.flags.writeable else array.copy())
            return host.to(self.device) if into is None else into.copy_(host.view(into.shape))
        if self.offset + size > self.nbytes:
            self._synchronize()  # every copy out of the ring has run: its start may be rewritten
            self.offset = 0
            self.wraps += 1
        # the array's bytes at the offset (aligned: a whole number of its elements), through views made once
        as_numpy, as_torch = self._views(array.dtype)
        start = self.offset // array.itemsize
        end = start + array.size
        self.offset += size
        as_numpy[start:end] = array.reshape(-1)
        host = as_torch[start:end]
        if into is not None:
            return into.copy_(host if into.dim() == 1 else host.view(into.shape), non_blocking=True)
        return (host if array.ndim == 1 else host.view(array.shape)).to(self.device, non_blocking=True)


class RowSlots:
    """A slot per batch row on the device (``values``) and the slots it holds (``held``; False: all zero). A step whose
    slots equal the held ones uploads nothing; the buffer's view for each row count is made once."""

    def __init__(self, max_rows: int, device, staging: PinnedRing):
        self.values = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.held: np.ndarray | bool = False
        self._staging = staging
        self._heads: dict[int, torch.Tensor] = {}

    @staticmethod
    def per_row(per_request, counts: np.ndarray, num_rows: int) -> np.ndarray:
        """Each request's value on each of its ``counts`` rows, then slot 0 on the padding rows up to ``num_rows``."""
        slots = np.repeat(np.asarray(per_request, dtype=np.int64), counts)
        if num_rows > len(slots):
            slots = np.concatenate((slots, np.zeros(num_rows - len(slots), dtype=np.int64)))
        return slots

    def write(self, slots: np.ndarray) -> None:
        """``slots`` (one per row of the step) into the buffer, unless it holds them already."""
        held = self.held
        if not (isinstance(held, np.ndarray) and held.tobytes() == slots.tobytes()):
            head = self._heads.get(len(slots))
            if head is None:
                head = self._heads[len(slots)] = self.values[: len(slots)]
            self._staging.upload(slots, into=head)
        self.held = slots

    def clear(self) -> None:
        """No row holds a slot."""
        if self.held is not False:
            self.values.zero_()
            self.held = False
