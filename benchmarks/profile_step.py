"""cProfile one generate call on the real pair (Gemma-3 <- SmolLM2), engine in-process.

    .venv/bin/python benchmarks/profile_step.py plain 0.8 32      # the target alone, T=0.8, 32 prompts at once
    .venv/bin/python benchmarks/profile_step.py usd 0.8 32        # vllm-usd's defaults, k=2, no probes
    .venv/bin/python benchmarks/profile_step.py usd 0.0 8 --sort tottime

Prints tok/s of the profiled call (profiling slows it: compare runs of this script only)
and the top of the profile. Where the step's time goes, not how fast it is.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("system", choices=("plain", "usd"))
    parser.add_argument("temperature", type=float)
    parser.add_argument("batch", type=int)
    parser.add_argument("--sort", default="cumtime", choices=("cumtime", "tottime"))
    parser.add_argument("--lines", type=int, default=60)
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, so cProfile sees it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams

    from vllm_usd.bench import load_prompts
    from vllm_usd.bench.plan import ENGINE_SETTINGS
    from vllm_usd.config import speculative_args
    from vllm_usd.demo_pair import ensure_real_pair

    pair = ensure_real_pair()
    extra = {} if args.system == "plain" else speculative_args(drafter=pair["smollm2"], k=2, probe_interval=1 << 30)
    llm = LLM(model=pair["gemma3"], max_num_seqs=args.batch, **ENGINE_SETTINGS, **extra)
    prompts = [p["text"] for p in load_prompts()[0]][:args.batch]
    params = SamplingParams(temperature=args.temperature, max_tokens=32, min_tokens=32, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    out = llm.generate(prompts, params, use_tqdm=False)
    profile.disable()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in out)
    print(f"RESULT {args.system} T={args.temperature} batch={args.batch}: {tokens / seconds:.1f} tok/s", flush=True)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats(args.sort).print_stats(args.lines)
    print(text.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
