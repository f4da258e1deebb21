"""The native probe's child process: every first run of llama.cpp's code on this host happens here.

``python -m vllm_usd.drafter.probe_child`` reads one JSON request on stdin and writes JSON lines
on stdout, one per stage, so that the parent knows how far a child got when it crashed or hung:

- ``{"call": "scan"}``: ggml's score of each CPU backend variant (``{"variants": {...}}``);
- ``{"call": "requantize", "gguf", "gguf_type", "out"}``: the GGUF requantized to ``out``;
- ``{"call": "probe", "gguf", "settings", "threads", "vocab_size", "calls", "out"}``: loads the
  GGUF as a worker would (``{"buffer_types": [...]}``), runs the scripted forwards on
  ``LlamaCppDrafterRuntime``, saves their logits to ``out`` (``[rows, vocab]``, ``.npy``) and times
  a one-token forward at batch 1 (``step_ms``).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def scan(request: dict[str, Any]) -> None:
    from vllm_usd.drafter import ggml_library

    libdir = ggml_library.library_dir()
    _say(variants=ggml_library.variant_scores(libdir) if libdir is not None else {})


def requantize(request: dict[str, Any]) -> None:
    from pathlib import Path

    from vllm_usd.drafter import ggml_library
    from vllm_usd.drafter.gguf_types import requantize_here

    scores = ggml_library.variant_scores(ggml_library.library_dir())
    ggml_library.load_cpu_backend(max(sorted(scores), key=scores.get) if scores else None)
    requantize_here(request["gguf"], request["gguf_type"], Path(request["out"]))
    _say(written=request["out"])


def probe(request: dict[str, Any]) -> None:
    import numpy as np
    import torch

    from vllm_usd.drafter.llama_cpp_runtime import LlamaCppDrafterRuntime, NativeSettings, drafter_cpus, step_ms

    settings = NativeSettings(**request["settings"])
    runtime = LlamaCppDrafterRuntime(request["gguf"], settings=settings, vocab_size=request["vocab_size"],
                                     kv_bytes_per_token=1, max_len=1024, max_requests=3, kv_budget_bytes=1 << 30,
                                     cpus=frozenset(sorted(drafter_cpus())[:request["threads"]]))
    from vllm_usd.drafter import ggml_library

    _say(buffer_types=ggml_library.extra_buffer_types() if settings.extra_buffer_types else [])
    rows = []
    for req_id in ("a", "b"):
        runtime.add(req_id)
    for req_ids, keep, new in request["calls"]:
        rows.append(runtime.forward(req_ids, keep, new))  # [len(req_ids), vocab_size]
    np.save(request["out"], torch.cat(rows).numpy())
    _say(saved=request["out"], step_ms=step_ms(runtime))


def serve(request: dict[str, Any]) -> None:
    {"scan": scan, "requantize": requantize, "probe": probe}[request["call"]](request)


def main() -> None:
    serve(json.loads(sys.stdin.read()))


if __name__ == "__main__":
    main()
