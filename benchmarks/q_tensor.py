"""Cost of handing q to vLLM: the [rows, k, V_target] float32 tensor.

    .venv/bin/python benchmarks/q_tensor.py            # batch 64, k 3 and 4, Gemma-3's 262,144 vocab

Measures, per engine step: vllm-usd's buffer fill (intersection columns only),
and vLLM's own per-step gather in `_get_spec_decode_draft_probs`
(torch.cat of [num_draft, V] row slices), which vLLM does for any q.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_usd.vllm_adapter.q_buffer import DraftProbsBuffer


def _time(fn, repeat: int = 20) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--shared", type=int, default=46_148, help="intersection size (Gemma-3 / SmolLM2)")
    args = ap.parse_args()
    torch.manual_seed(0)
    target_ids = torch.randperm(args.vocab)[: args.shared].sort().values
    for k in (3, 4):
        buf = DraftProbsBuffer(k, args.vocab, target_ids)
        qs = [torch.rand(args.batch, args.shared).softmax(-1) for _ in range(k)]
        rows = list(range(args.batch))
        fill = _time(lambda: buf.fill(rows, qs, args.batch))
        probs = buf.fill(rows, qs, args.batch)
        gather = _time(lambda: torch.cat([probs[r, :k] for r in range(args.batch)], dim=0).contiguous())
        naive = _time(lambda: torch.zeros(args.batch, k, args.vocab).index_copy_(2, target_ids, torch.stack(qs, 1)))
        print(f"batch {args.batch}, k {k}, V {args.vocab}: buffer {buf.nbytes / 2**20:.0f} MiB; "
              f"fill {1e3 * fill:.1f} ms (a fresh zeroed tensor would take {1e3 * naive:.1f} ms); "
              f"vLLM's own gather {1e3 * gather:.1f} ms")


if __name__ == "__main__":
    main()
