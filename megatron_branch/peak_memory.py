"""Peak memory of a region: CUDA's allocator statistics, or live tensor bytes on CPU.

On CPU there is no allocator high-water mark, and RSS is blurred by the C allocator, so
:class:`PeakMemory` counts the bytes of every tensor storage created inside the region
(through a ``TorchDispatchMode``) and releases them when the storage is freed. It sees
every aten allocation below autograd; it slows the region down, so benchmarks time
without it and measure memory in a separate run.
"""

from __future__ import annotations

import weakref
from typing import Dict, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: Dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
                if size and key not in self.live:
                    self.live[key] = size
                    self.current += size
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._free, key)
        return out


class PeakMemory:
    """Context manager: ``peak_bytes`` allocated above the level at entry.

    Args:
        device: ``"cuda"`` uses ``torch.cuda.max_memory_allocated``; anything else counts
            live CPU tensor bytes.
    """

    def __init__(self, device: Optional[torch.device] = None):
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.peak_bytes = 0
        self._mode: Optional[_LiveBytes] = None
        self._base = 0

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _LiveBytes()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._mode.__exit__(*exc)
            self.peak_bytes = self._mode.peak
