"""Where a step's time goes when vllm-usd drafts nothing: the tiny target alone against the same
target with vllm-usd's defaults, each profiled in-process (cProfile), per engine step.

    .venv/bin/python benchmarks/no_draft_overhead.py --batch 8 --out benchmarks/results/no-draft.json

On the tiny pair the policy drafts nothing (its measured costs let no length pay), so the
difference between the two profiles is what a configured but idle proposer costs: vLLM's
speculative-decoding path and the proposer's per-step bookkeeping. Each engine runs in its own
process, one after the other; profiling slows Python-heavy code, so compare the two profiles
with each other, not with unprofiled tok/s (``interleaved_check.py`` measures those).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GENERATE_CALLS = 20
MAX_TOKENS = 64


def profile_one(system: str, batch: int, dump: Path) -> None:
    """Warm one engine up (the usd engine measures its costs then), profile ``GENERATE_CALLS`` calls."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, so cProfile sees it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from tests.fixtures import tiny
    from vllm_usd.bench import load_prompts
    from vllm_usd.bench.plan import ENGINE_SETTINGS
    from vllm_usd.config import speculative_args

    target, drafter = tiny.build_distribution_pair()
    extra = {} if system == "plain" else speculative_args(drafter=drafter, k=3)
    llm = LLM(model=target, max_num_seqs=batch, **ENGINE_SETTINGS, **extra)
    prompts = [p["text"] for p in load_prompts()[0]][:batch]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, ignore_eos=True)
    for _ in range(4):
        llm.generate(prompts, params, use_tqdm=False)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(GENERATE_CALLS):
        llm.generate(prompts, params, use_tqdm=False)
    profile.disable()
    seconds = time.perf_counter() - start
    profile.dump_stats(str(dump))
    dump.with_suffix(".json").write_text(json.dumps({"ms_per_step": 1e3 * seconds / (GENERATE_CALLS * MAX_TOKENS)}))


def _cumulative(path: Path) -> dict[str, tuple[int, float]]:
    """Function -> (calls, cumulative seconds)."""
    out = {}
    for (file, line, name), (_, calls, _, cumulative, _) in pstats.Stats(str(path)).stats.items():
        out[f"{file.split('site-packages/')[-1]}:{line}:{name}"] = (calls, cumulative)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lines", type=int, default=30)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--system", choices=("plain", "usd"), help=argparse.SUPPRESS)  # one engine's child run
    parser.add_argument("--dump", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.system:
        profile_one(args.system, args.batch, args.dump)
        return 0
    steps = GENERATE_CALLS * MAX_TOKENS
    with tempfile.TemporaryDirectory() as tmp:
        dumps = {s: Path(tmp) / f"{s}.pstats" for s in ("plain", "usd")}
        for system, dump in dumps.items():
            subprocess.run([sys.executable, __file__, "--system", system, "--batch", str(args.batch),
                            "--dump", str(dump)], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        step_ms = {s: json.loads(d.with_suffix(".json").read_text())["ms_per_step"] for s, d in dumps.items()}
        plain, usd = _cumulative(dumps["plain"]), _cumulative(dumps["usd"])
    rows = sorted(((name, 1e3 * (usd.get(name, (0, 0.0))[1] - plain.get(name, (0, 0.0))[1]) / steps,
                    plain.get(name, (0, 0.0))[0], usd.get(name, (0, 0.0))[0]) for name in set(plain) | set(usd)),
                  key=lambda r: -r[1])[:args.lines]
    print(f"profiled ms per step at batch {args.batch}: target alone {step_ms['plain']:.3f}, "
          f"vllm-usd drafting nothing {step_ms['usd']:.3f}")
    print("extra cumulative ms per step (usd - plain), calls plain / usd, function:")
    for name, extra_ms, calls_plain, calls_usd in rows:
        print(f"{extra_ms:7.3f}  {calls_plain:6d} {calls_usd:6d}  {name}")
    if args.out:
        args.out.write_text(json.dumps({
            "command": " ".join(["python", *sys.argv]), "batch": args.batch, "steps": steps,
            "profiled_ms_per_step": step_ms,
            "extra_cumulative_ms_per_step": [{"function": n, "ms": round(m, 4), "calls_plain": a, "calls_usd": b}
                                             for n, m, a, b in rows],
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
