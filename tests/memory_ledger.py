"""A CPU model of the device memory a caching allocator reserves, for the drafter's memory tests.

On a GPU, PyTorch's caching allocator keeps every block it ever took: what it
has reserved is the high-water mark of live tensor memory (less what it could
reuse). vLLM sizes its KV cache from what is left after the proposer's
``load_model``, so any later rise of that mark is memory nobody planned for.

``MemoryLedger`` counts the same on any device. While it is active, every tensor
an operation returns on storage none of its inputs had (a fresh allocation, not
a view or an in-place result) is traced to its storage; a new storage adds its
bytes to the live total until it is freed (a finalizer on the storage itself, so a view
keeps it counted). ``peak`` is the high-water mark of live bytes. ``start_serving()``
ends start-up: from then on, ``grown`` is how far the mark rose above start-up's,
the bytes a caching allocator would have had to reserve afresh, and ``retained``
what is live beyond start-up's end (once every request has ended: a leak). It is stricter
than the allocator in one way (fragmentation aside, the allocator could reuse
nothing less) and blind in one: memory a kernel takes inside one operation.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode


class MemoryLedger(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live = 0  # bytes of storages made under the ledger and still alive
        self.peak = 0
        self.startup_peak: int | None = None
        self.startup_live = 0
        self._storages: dict[int, int] = {}  # data_ptr -> bytes, for the live ones
        self.rises: list[tuple[int, str]] = []  # after start-up: each operation that raised the mark, and by how much

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # lift_fresh hands on a tensor made from host data (torch.tensor(list)): a fresh allocation too
        inputs = set() if func is torch.ops.aten.lift_fresh.default else {
            x.untyped_storage().data_ptr() for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self._count(t, func)
        return out

    def _count(self, t: torch.Tensor, func) -> None:
        storage = t.untyped_storage()
        ptr, size = storage.data_ptr(), storage.nbytes()
        if size == 0 or ptr in self._storages:
            return
        self._storages[ptr] = size
        self.live += size
        if self.live > self.peak:
            if self.startup_peak is not None:
                import traceback

                where = [f"{f.name}:{f.lineno}" for f in traceback.extract_stack()[-9:-3]]
                self.rises.append((self.live - self.peak, f"{func}: +{self.live - self.peak} B, {tuple(t.shape)} "
                                                          f"({' < '.join(reversed(where))})"))
            self.peak = self.live
        weakref.finalize(storage, self._freed, ptr)

    def _freed(self, ptr: int) -> None:
        self.live -= self._storages.pop(ptr, 0)

    def start_serving(self) -> None:
        """Start-up ends: what it reserved is its high-water mark; serving's is measured from here."""
        self.startup_peak = self.peak
        self.startup_live = self.live

    @property
    def retained(self) -> int:
        """Bytes live now beyond what was live when serving began (after every request ended: a leak)."""
        return self.live - self.startup_live

    def largest_rises(self, n: int = 12) -> str:
        """The ``n`` operations that raised the mark most after start-up, one a line (for a failure message)."""
        return "\n".join(line for _, line in sorted(self.rises, key=lambda r: -r[0])[:n])

    @property
    def grown(self) -> int:
        """Bytes serving's high-water mark rose above start-up's (0: nothing reserved after start-up)."""
        if self.startup_peak is None:
            raise RuntimeError("start_serving() was not called")
        return max(0, self.peak - self.startup_peak)
