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
        self.offset = 0
        self.wraps = 0
        self._synchronize = synchronize or (lambda: torch.cuda.current_stream().synchronize())

    @classmethod
    def for_device(cls, device: torch.device) -> PinnedRing:
        """The planner's ring: ``STAGING_BYTES`` on a CUDA device, none (plain copies) elsewhere."""
        return cls(STAGING_BYTES if device.type == "cuda" else 0, device)

    def upload(self, array: np.ndarray, into: torch.Tensor | None = None) -> torch.Tensor:
        """``array`` on the device: a new tensor, or copied into ``into`` (same number of elements)."""
        array = np.ascontiguousarray(array)
        size = -(-array.nbytes // self.ALIGN) * self.ALIGN
        if size > self.buffer.numel():  # larger than the ring (or no ring): a plain copy
            host = torch.from_numpy(array if array.flags.writeable else array.copy())
            return host.to(self.device) if into is None else into.copy_(host.view(into.shape))
        if self.offset + size > self.buffer.numel():
            self._synchronize()  # every copy out of the ring has run: its start may be rewritten
            self.offset = 0
            self.wraps += 1
        part = self.buffer[self.offset : self.offset + array.nbytes]
        self.offset += size
        host = part.view(torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype).view(array.shape)
        host.numpy()[...] = array
        if into is not None:
            return into.copy_(host.view(into.shape), non_blocking=True)
        return host.to(self.device, non_blocking=True)
