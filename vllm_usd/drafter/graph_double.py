"""A CPU stand-in for a CUDA graph that is at least as strict as one.

A CUDA graph records kernels and the addresses they read. It keeps no Python
reference to the code it captured: a tensor created before the capture and read
inside it stays valid only while something else keeps it alive, and a replay
after it was freed reads whatever the allocator put there since. Tensors made
during the capture live on in the graph's private pool.

``capture_recorded`` models exactly that on any device. Capturing runs the step
once under a ``TorchFunctionMode`` that records every torch call, keeping strong
references only to the static inputs and to what the capture itself made, and a
weak reference (with its address) to every other tensor a call read. Replaying
runs the recorded calls again, writing their results into the recorded outputs.
It raises ``GraphReadFreedMemory`` when a tensor the capture read from outside has
been freed or has moved, and ``GraphCaptureSync`` when the captured code asks for
a host value (``.item()``, ``.tolist()``, ``bool(tensor)``, ``nonzero``), which a
capturing CUDA stream refuses too. Python control flow is baked in at capture,
as in a graph.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten


class GraphReadFreedMemory(RuntimeError):
    """A replay would read a tensor that was freed (or moved) after capture."""


class GraphCaptureSync(RuntimeError):
    """The captured code read a device value on the host, which a CUDA stream refuses while capturing."""


_SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.nonzero, torch.nonzero}


class _External:
    """A tensor from outside the capture: weakly held, with the address the capture read."""

    __slots__ = ("ref", "ptr", "what")

    def __init__(self, t: torch.Tensor, what: str) -> None:
        self.ref, self.ptr, self.what = weakref.ref(t), t.data_ptr(), what

    def get(self) -> torch.Tensor:
        t = self.ref()
        if t is None:
            raise GraphReadFreedMemory(f"replay reads {self.what}, a tensor freed after capture")
        if t.data_ptr() != self.ptr:
            raise GraphReadFreedMemory(f"replay reads {self.what}, whose storage moved after capture")
        return t


class _Recorder(TorchFunctionMode):
    def __init__(self, static: tuple[torch.Tensor, ...]) -> None:
        super().__init__()
        self.ops: list[tuple[Callable, list, Any, list]] = []  # (func, argument leaves, their spec, outputs)
        self.owned: dict[int, torch.Tensor] = {id(t): t for t in static}  # static inputs + the private pool
        self._external: dict[int, _External] = {}

    def _leaf(self, x: Any, func: Callable) -> Any:
        if not isinstance(x, torch.Tensor) or self.owned.get(id(x)) is x:
            return x
        ext = self._external.get(id(x))
        if ext is None or ext.ref() is not x:
            ext = self._external[id(x)] = _External(x, f"{tuple(x.shape)} {x.dtype} (read by {_name(func)})")
        return ext

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCS:
            raise GraphCaptureSync(f"{_name(func)} during capture: a CUDA graph cannot read device values on the host")
        out = func(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        inputs = {id(x) for x in leaves if isinstance(x, torch.Tensor)}
        recorded = []  # each output the capture made (it lives in the graph's pool), else None
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and (self.owned.get(id(t)) is t or id(t) not in inputs):
                self.owned[id(t)] = t
                recorded.append(t)
            else:  # not a tensor, or one from outside returned by an in-place call: held weakly only
                recorded.append(None)
        self.ops.append((func, [self._leaf(x, func) for x in leaves], spec, recorded))
        return out


def _name(func: Callable) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def capture_recorded(step: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...],
                     pool: object) -> tuple[Callable[[], None], torch.Tensor]:
    """``decode_graphs.Capture`` without CUDA: run ``step(*inputs)`` once, recorded; the replay keeps no
    reference to ``step``."""
    recorder = _Recorder(inputs)
    with recorder:
        out = step(*inputs)
    ops = recorder.ops
    del recorder, step

    def replay() -> None:
        with _disable_current_modes():  # one opaque launch, as a graph's: no Python mode sees its operations
            _run(ops)

    return replay, out


def _run(ops: list) -> None:
    for func, leaves, spec, recorded in ops:
        args, kwargs = tree_unflatten([x.get() if isinstance(x, _External) else x for x in leaves], spec)
        for new, old in zip(tree_flatten(func(*args, **kwargs))[0], recorded):
            if old is not None and new is not old:
                old.copy_(new)
