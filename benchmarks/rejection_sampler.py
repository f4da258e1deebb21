"""vLLM's rejection sampler on the CPU alone, as vLLM ships it and with vllm-usd's CPU patches. No engine.

    .venv/bin/python benchmarks/rejection_sampler.py --out r.json
    .venv/bin/python benchmarks/rejection_sampler.py --batches 1 8 --drafts 3 --vocab 262144 --threads 1

One verified step of a sampled batch (T = 0.8, no top-k/top-p, no seeds): B requests with ``--drafts``
drafts each, target logits and dense draft probabilities over ``--vocab`` entries (Gemma-3's 262,144 by
default), through ``RejectionSampler.forward``; beside it vLLM's plain sampler on B rows (a step without
speculation). vLLM's own and the patched rejection sampler are timed in alternation, ``--steps`` calls
each per round; the figure is the median over rounds. ``--threads 1``: the target's one core under
vLLM's default binding on a 2-CPU host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _inputs(batch: int, drafts: int, vocab: int):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    sampling = SamplingMetadata(
        temperature=torch.full((batch,), 0.8), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    spec = SpecDecodeMetadata.make_dummy([list(range(5, 5 + drafts))] * batch, torch.device("cpu"))
    rows = drafts + 1  # each request's logits rows: its drafts, then the bonus position
    spec.target_logits_indices = torch.tensor([b * rows + j for b in range(batch) for j in range(drafts)],
                                              dtype=torch.int32)
    spec.bonus_logits_indices = torch.tensor([b * rows + drafts for b in range(batch)], dtype=torch.int32)
    logits = torch.randn(batch * rows, vocab)  # [num_tokens + batch_size, vocab_size]
    draft_probs = torch.rand(batch * drafts, vocab)  # [num_tokens, vocab_size]
    draft_probs /= draft_probs.sum(-1, keepdim=True)
    return spec, sampling, logits, draft_probs


def _time(call, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        call()
    return (time.perf_counter() - start) / steps * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--drafts", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.sampler import Sampler

    from vllm_usd.bench.machine import cpu_flags, cpu_model, versions
    from vllm_usd.vllm_adapter import patches

    current_platform.register_triton_kernel_overrides()  # what vLLM's CPU worker does
    patches.apply(["cpu_expand_fix", "cpu_empty_topk_fix"])  # correctness fixes, in both columns
    vllms = rs.sample_recovered_tokens
    patches.apply(["cpu_drafted_rows_recovery"])
    patched = rs.sample_recovered_tokens
    sampler = Sampler()
    rejection = rs.RejectionSampler(sampler)
    rows = []
    for batch in args.batches:
        spec, sampling, logits, draft_probs = _inputs(batch, args.drafts, args.vocab)
        calls = {"plain_sampler": lambda: sampler(logits[:batch].clone(), sampling)}
        for name, recovered in (("vllm", vllms), ("vllm_usd", patched)):
            def verify(recovered=recovered):
                rs.sample_recovered_tokens = recovered
                return rejection(spec, draft_probs, logits.clone(), sampling)
            calls[name] = verify
        ms: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.rounds):
            for name, call in calls.items():
                call()  # warm
                ms[name].append(_time(call, args.steps))
        row = {"batch": batch, "drafts": args.drafts, "ms": {n: statistics.median(v) for n, v in ms.items()},
               "ms_per_round": ms}
        row["vllm_usd_over_vllm"] = row["ms"]["vllm_usd"] / row["ms"]["vllm"]
        rows.append(row)
        print(f"batch {batch}, {args.drafts} drafts: rejection sampler {row['ms']['vllm']:.2f} ms (vLLM's) -> "
              f"{row['ms']['vllm_usd']:.2f} ms (patched), {row['vllm_usd_over_vllm']:.2f}x; "
              f"plain sampler {row['ms']['plain_sampler']:.2f} ms")
    rs.sample_recovered_tokens = patched
    result = {"command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
              "vocab": args.vocab, "threads": args.threads, "rounds": args.rounds, "steps": args.steps,
              "host": {"cpu": cpu_model(), "flags": cpu_flags()}, "versions": versions(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
