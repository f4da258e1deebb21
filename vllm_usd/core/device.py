"""Host values onto the device without a sync, and a count of the syncs a piece of code makes.

On CUDA, ``torch.tensor(values, device="cuda")`` copies from pageable memory and
waits for the copy; ``to_device`` stages through pinned memory and copies
asynchronously, as vLLM's own input preparation does. A read back to the host
(``tolist``, ``item``, ``bool(tensor)`` ...) always waits for the device: those are
the syncs a hot path must count. ``SyncCounter`` counts them on any device, so
the CPU tests hold the drafting step to the number CUDA would see
(``scripts/gpu_check.py`` checks the same with ``torch.cuda.set_sync_debug_mode``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` (nested lists, or a host tensor) as a tensor on ``device``; on CUDA an asynchronous copy
    from pinned memory."""
    host = values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host if device.type == "cpu" else host.to(device)


#: tensor methods that read a device value on the host, and so wait for the device
HOST_READS = frozenset({
    torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__,
    torch.Tensor.__index__, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.nonzero, torch.nonzero,
})


class SyncCounter(TorchFunctionMode):
    """Counts host reads of tensors while active: ``with SyncCounter() as syncs: ...; syncs.count``.

    On the CPU nothing waits, but the same call on CUDA would: this is the count CUDA's sync debug
    mode reports for device tensors. ``names`` lists them in order, for the failure message.
    """

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    @property
    def count(self) -> int:
        return len(self.names)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))
