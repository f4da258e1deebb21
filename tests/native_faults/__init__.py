"""Planted native faults for the native probe (vllm_usd/drafter/native_probe.py).

Each submodule is a probe child (``python -m tests.native_faults.<fault>``, named by a proposer's
``probe_child`` or by ``prove_native(child=...)``) that behaves as ``vllm_usd.drafter.probe_child``
except where its fault says. A segfault here is a real one (a read of address 0), as llama.cpp's
AMX kernels gave on one of this project's machines.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from typing import Callable

from vllm_usd.drafter import probe_child


def segfault() -> None:
    ctypes.string_at(0)


def hang() -> None:
    time.sleep(3600)


def best_variant() -> str | None:
    from vllm_usd.drafter import ggml_library

    scores = ggml_library.variant_scores(ggml_library.library_dir())
    return max(sorted(scores), key=scores.get) if scores else None


def run(before: Callable[[dict], None] = lambda request: None,
        after: Callable[[dict], None] = lambda request: None) -> None:
    """Read the request; ``before`` may crash or hang on it; serve it as the real child; then ``after``."""
    request = json.loads(sys.stdin.read())
    before(request)
    probe_child.serve(request)
    after(request)
