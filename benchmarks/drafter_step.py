"""The drafter's decode step alone, per runtime and weight format, against its weight-read limit. No vLLM.

    .venv/bin/python benchmarks/drafter_step.py                   # SmolLM2-135M of the demo pair
    .venv/bin/python benchmarks/drafter_step.py --drafter DIR --batches 1 8 32 --out r.json

For each format (transformers float32 / bfloat16 / int8 on the CPU, float32 / bfloat16 /
float16 on CUDA; llama.cpp on the drafter's GGUF, ``gguf``, or on the GGUF requantized to a
llama.cpp type, ``gguf:q8_0`` say, as ``usd.drafter_gguf_type`` does) and batch size, B requests hold a
64-token context; one step drafts one token for each (one forward over B new tokens
with the logits of the intersection-sized pruned head), and is rolled back so the
context stays 64 long. The figure is the median of ``--steps`` steps after a warm-up.

The limit: a batch-1 decode step must read every weight once, so it cannot beat
(bytes of weights read per forward) / (memory bandwidth). Two bandwidths are measured
here on a 1 GiB tensor: a copy (bytes read + bytes written, over the time) and a sum
(bytes read over the time, which is what reading weights does). ``read_limit_ms`` uses
the read bandwidth, measured again before each format (a row's ``bandwidth_gb_s``), and
``copy_limit_ms`` the copy's, measured once; ``weights_read_gb_s`` is the rate the step itself
read its weights at (bytes read over the step's time).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CONTEXT = 64
PRUNED_ROWS = 46_000  # about the real pair's intersection: the head the step multiplies


def _best_seconds(device: str, op, repeats: int) -> float:
    """The fastest of ``repeats`` timed runs of ``op()``, synchronised on CUDA."""
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        op()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(device: str, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    n = int(gib * (1 << 30)) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * n * 4 / _best_seconds(device, lambda: dst.copy_(src), repeats)


def read_bandwidth(device: str, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of reading a large tensor once (a sum: one add per 4 bytes read)."""
    n = int(gib * (1 << 30)) // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    return n * 4 / _best_seconds(device, src.sum, repeats)


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def head_rows(vocab: int) -> torch.Tensor:
    return torch.arange(min(PRUNED_ROWS, vocab))


def step_times(runtime, batch: int, steps: int, device: str) -> list[float]:
    return steps_in_turns({"one": runtime}, batch, steps, device)["one"]


def steps_in_turns(runtimes: dict, batch: int, steps: int, device: str) -> dict[str, list[float]]:
    """Seconds of each runtime's one-token decode steps at ``batch``, the runtimes stepping in turns
    (three warm-up steps each, not counted)."""
    ids = [f"r{i}" for i in range(batch)]
    prompt = [[(7 * i + j) % 1000 + 10 for j in range(CONTEXT)] for i in range(batch)]
    for runtime in runtimes.values():
        for r in ids:
            assert runtime.add(r)
        runtime.forward(ids, [0] * batch, prompt)
    times: dict[str, list[float]] = {name: [] for name in runtimes}
    for s in range(steps + 3):
        for name, runtime in runtimes.items():
            new = torch.tensor([(s * 13 + i) % 1000 + 10 for i in range(batch)], device=runtime.device)
            _sync(device)
            start = time.perf_counter()
            # the path drafts take (ids where they were sampled); rolls back the last step's token, decodes one
            runtime.forward_next(ids, [CONTEXT] * batch, new)
            _sync(device)
            if s >= 3:
                times[name].append(time.perf_counter() - start)
    for runtime in runtimes.values():
        for r in ids:
            runtime.free(r)
    return times


class DecodeCallTimer:
    """Times each ``llama_decode`` call a llama.cpp runtime makes, while in the ``with`` block:
    the part of a step spent inside llama.cpp (the rest is the batch set-up and the logits copy)."""

    def __init__(self, runtime) -> None:
        self._ll = getattr(runtime, "_ll", None)  # the llama_cpp module, or None for transformers
        self.seconds: list[float] = []

    def __enter__(self) -> "DecodeCallTimer":
        if self._ll is not None:
            decode = self._original = self._ll.llama_decode

            def timed(ctx, batch):
                start = time.perf_counter()
                rc = decode(ctx, batch)
                self.seconds.append(time.perf_counter() - start)
                return rc

            self._ll.llama_decode = timed
        return self

    def __exit__(self, *exc) -> None:
        if self._ll is not None:
            self._ll.llama_decode = self._original


def weight_bytes_read(runtime, fmt: str) -> int:
    """Weights one forward reads: every layer, plus the pruned head (llama.cpp: its whole model)."""
    if fmt.startswith("gguf"):
        return runtime.param_bytes
    model = runtime.model
    embed = model.get_input_embeddings().weight
    head = runtime._head_weight
    # the input embedding is gathered (a row per token), not read; a tied head is counted once, pruned
    return runtime.param_bytes - embed.numel() * embed.element_size() + head.numel() * head.element_size()


def mixed_load_memory(drafter: str, fmt: str, device: str, requests: int, seed: int = 0,
                      package_root: str | None = None) -> dict:
    """The transformers runtime's KV memory as ``requests`` requests with contexts of 8 to 900 tokens
    arrive, each prefilled and then decoding one token, all live at the end (max_len 1024, the
    default 2 GiB budget): bytes held after the first request and after the last. ``package_root``:
    the runtime of the ``vllm_usd`` there (see ``_runtime_from``)."""
    import random

    with _package(package_root) as select:
        opened = select.open_drafter(drafter, select.DrafterChoice("transformers", fmt, device), max_len=1024,
                                     max_requests=requests, kv_budget_bytes=2 << 30)
    runtime, rng = opened.runtime, random.Random(seed)
    held = []
    for i in range(requests):
        r = f"m{i}"
        runtime.add(r)
        n = rng.randint(8, 900)
        runtime.forward([r], [0], [[(7 * i + j) % 1000 + 10 for j in range(n)]])
        runtime.forward_next([r], [n], torch.tensor([11], device=runtime.device))
        held.append(runtime.kv_bytes)
    blocks = getattr(runtime, "num_blocks", None)
    used = blocks - runtime.free_blocks if blocks is not None else None
    return {"requests": requests, "kv_bytes_after_first": held[0], "kv_bytes_after_last": held[-1],
            "kv_blocks_in_use": used, "kv_blocks": blocks}


@contextlib.contextmanager
def _package(package_root: str | None):
    """``vllm_usd.drafter.select`` of the package under ``package_root`` (a checkout of another commit,
    say), imported afresh; objects built inside the block keep that package's code. None: this one."""
    if package_root:
        for name in [m for m in sys.modules if m == "vllm_usd" or m.startswith("vllm_usd.")]:
            del sys.modules[name]
        sys.path.insert(0, package_root)
    try:
        yield importlib.import_module("vllm_usd.drafter.select")
    finally:
        if package_root:
            sys.path.remove(package_root)


def _runtime_from(package_root: str, drafter: str, fmt: str, device: str, max_requests: int):
    with _package(package_root) as select:
        opened = select.open_drafter(drafter, select.DrafterChoice("transformers", fmt, device), max_len=CONTEXT + 8,
                                     max_requests=max_requests, kv_budget_bytes=1 << 31)
    opened.runtime.set_output_rows(head_rows(opened.vocab_size))
    return opened.runtime


def paired_with_baseline(baseline: str, drafter: str, formats: list[str], batches: list[int], steps: int,
                         device: str) -> list[dict]:
    """This checkout's transformers runtime against ``baseline``'s, step by step in turns in one process
    (a shared VM's speed drifts by a third within minutes; paired steps see the same drift)."""
    here = str(Path(__file__).resolve().parents[1])
    rows = []
    for fmt in formats:
        runtimes = {"baseline": _runtime_from(baseline, drafter, fmt, device, max(batches)),
                    "this": _runtime_from(here, drafter, fmt, device, max(batches))}
        for batch in batches:
            times = steps_in_turns(runtimes, batch, steps, device)
            ratio = statistics.median(a / b for a, b in zip(times["this"], times["baseline"]))
            row = {"format": fmt, "batch": batch, "baseline_ms": 1000 * statistics.median(times["baseline"]),
                   "this_ms": 1000 * statistics.median(times["this"]), "this_over_baseline": ratio}
            rows.append(row)
            print(f"{fmt:>9} b={batch:<3} baseline {row['baseline_ms']:6.1f} ms  this {row['this_ms']:6.1f} ms  "
                  f"ratio {ratio:.3f} (median of paired steps)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafter", help="drafter folder (default: the demo pair's SmolLM2-135M-Instruct)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--formats", nargs="+", help="default: every format the device runs")
    parser.add_argument("--threads", type=int, nargs="+",
                        help="thread counts to time, each in turn: llama.cpp's n_threads and torch's (default: "
                             "llama.cpp takes every CPU this process may run on, torch keeps its own)")
    parser.add_argument("--mixed", type=int, metavar="N",
                        help="also: the transformers runtime's KV memory under N requests of 8 to 900 tokens")
    parser.add_argument("--baseline", metavar="DIR",
                        help="time the transformers runtime against the one in DIR (a checkout of another commit, "
                             "e.g. `git worktree add /tmp/before REV`), step by step in turns; nothing else runs")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    from vllm_usd.drafter.select import DrafterChoice, find_gguf, open_drafter

    drafter = args.drafter
    if drafter is None:
        from vllm_usd.demo_pair import ensure_smollm2

        drafter = ensure_smollm2()
    on_cpu = torch.device(args.device).type == "cpu"
    if args.baseline:
        result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "baseline": args.baseline,
                  "drafter": drafter, "device": args.device, "context": CONTEXT, "torch": torch.__version__,
                  "rows": paired_with_baseline(args.baseline, drafter, args.formats or ["float32", "bfloat16"],
                                               args.batches, args.steps, args.device)}
        if args.mixed:
            result["mixed_load"] = {
                name: mixed_load_memory(drafter, "bfloat16", args.device, args.mixed, package_root=root)
                for name, root in (("baseline", args.baseline), ("this", str(Path(__file__).resolve().parents[1])))}
            print(f"mixed load: {result['mixed_load']}", flush=True)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1))
        return 0
    formats = args.formats or (["float32", "bfloat16", "int8", "gguf"] if on_cpu else ["float32", "bfloat16", "float16"])
    copy_bandwidth = memory_bandwidth(args.device)
    bandwidth = read_bandwidth(args.device)
    rows = []
    for fmt in formats:
        if fmt.startswith("gguf"):
            gguf = find_gguf(drafter, None)
            if gguf is None:
                print(f"skip gguf: no GGUF in {drafter}", file=sys.stderr)
                continue
            choice = DrafterChoice("llama_cpp", "gguf", "cpu", gguf, fmt.partition(":")[2] or "file")
        else:
            choice = DrafterChoice("transformers", fmt, args.device)
        for threads in args.threads or [None]:
            if threads:
                torch.set_num_threads(threads)
            opened = open_drafter(drafter, choice, max_len=CONTEXT + 8, max_requests=max(args.batches),
                                  kv_budget_bytes=1 << 31,
                                  cpus=frozenset(sorted(os.sched_getaffinity(0))[:threads]) if threads else None)
            runtime = opened.runtime
            runtime.set_output_rows(head_rows(opened.vocab_size))
            read = weight_bytes_read(runtime, fmt)
            # measured again next to each format: on a shared VM it moves by a third within minutes
            row_bandwidth = read_bandwidth(args.device)
            limit = read / row_bandwidth
            for batch in args.batches:
                with DecodeCallTimer(runtime) as decode:
                    times = step_times(runtime, batch, args.steps, args.device)
                median = statistics.median(times)
                row = {"format": fmt, "runtime": choice.runtime, "device": choice.device, "batch": batch,
                       "step_ms": 1000 * median, "step_ms_p10": 1000 * sorted(times)[len(times) // 10],
                       "weight_bytes_read": read, "read_limit_ms": 1000 * limit, "vs_limit": median / limit,
                       "bandwidth_gb_s": row_bandwidth / 1e9,  # the sum's, just before this format ran
                       "weights_read_gb_s": read / median / 1e9,  # the rate this step read its weights at
                       # llama.cpp: the median llama_decode call (one per step here), inside the step's time
                       "decode_call_ms": 1000 * statistics.median(decode.seconds) if decode.seconds else None,
                       "copy_limit_ms": 1000 * read / copy_bandwidth, "drafter_dtype": opened.choice.dtype,
                       "threads": getattr(runtime, "threads", torch.get_num_threads())}
                rows.append(row)
                print(f"{fmt:>9} {choice.runtime:>12} t={row['threads']} b={batch:<3} {row['step_ms']:7.1f} ms/step "
                      f"(limit {row['read_limit_ms']:.1f} ms, {row['vs_limit']:.2f}x; weights read at "
                      f"{row['weights_read_gb_s']:.1f} of {row['bandwidth_gb_s']:.1f} GB/s)", flush=True)
            del runtime, opened
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "drafter": drafter,
              "device": args.device, "bandwidth_gb_s": bandwidth / 1e9,  # at the start; each row has its own
              "copy_bandwidth_gb_s": copy_bandwidth / 1e9, "context": CONTEXT,
              "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "ld_preload": os.environ.get("LD_PRELOAD", ""), "rows": rows}
    if args.mixed:
        result["mixed_load"] = mixed_load_memory(drafter, "bfloat16", args.device, args.mixed)
        print(f"mixed load: {result['mixed_load']}", flush=True)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
