"""Where an engine step's time goes: the target alone against vllm-usd at a fixed k, per vLLM runner method.

Both engines are up at once and timed in alternation (as ``interleaved_check.py``). In each worker the
model runner's methods are wrapped with timers (``execute_model``: the target's forward and logits;
``_sample``: the sampler, or vLLM's rejection sampler where drafts were verified;
``propose_draft_token_ids``: vllm-usd's proposer, drafter included; ``usd.*``: the proposer's own phases, as
``usd.profile`` times them), and the per-step means are printed.

    VLLM_CPU_OMP_THREADS_BIND=0-1 .venv/bin/python benchmarks/step_profile.py --drafter /path/to/hf-folder \\
        --out /tmp/step-profile.json
    .venv/bin/python benchmarks/step_profile.py --never-draft --out /tmp/no-draft.json   # steps that draft nothing

``--never-draft``: vllm-usd's engine runs the proposer whose controller chooses length 0 every step
(``NeverDrafts``): what a step that drafts nothing costs against the target alone, per method.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RUNNER_METHODS = ("execute_model", "sample_tokens", "_update_states", "_prepare_inputs", "_model_forward", "_sample",
                  "_bookkeeping_sync", "propose_draft_token_ids", "_calc_spec_decode_metadata")


from vllm_usd import UniversalProposer  # noqa: E402


class NeverDrafts(UniversalProposer):
    """vllm-usd's proposer whose controller chooses length 0 at every step (its own work per step stays)."""

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        self.controller.length = lambda batch, catch_up=None, greedy=0: 0


def install_timers(worker) -> bool:
    """In the worker: wrap the runner's methods, its model's compute_logits and its samplers with timers."""
    runner = worker.model_runner
    totals = runner.__dict__.setdefault("_step_profile", {})

    def wrap(obj, name: str, key: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None:
            return

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = totals.setdefault(key, [0.0, 0])
                entry[0] += time.perf_counter() - start
                entry[1] += 1
        setattr(obj, name, timed)

    for name in RUNNER_METHODS:
        wrap(runner, name, name)
    wrap(runner.model, "compute_logits", "compute_logits")
    wrap(runner.sampler, "forward", "sampler")
    if getattr(runner, "rejection_sampler", None) is not None:
        wrap(runner.rejection_sampler, "forward", "rejection_sampler")
    return True


def read_timers(worker, reset: bool = False) -> dict[str, list]:
    totals = worker.model_runner.__dict__.get("_step_profile", {})
    out = {key: list(value) for key, value in totals.items()}
    if reset:
        totals.clear()
    return out


def main(argv: list[str] | None = None) -> int:
    from vllm import SamplingParams

    from benchmarks.run import pair_specs
    from vllm_usd.bench.public_prompts import CATEGORIES, load_workloads
    from vllm_usd.bench.machine import cpu_flags, cpu_model
    from vllm_usd.bench.vllm_systems import engine
    from vllm_usd.config import speculative_args
    from vllm_usd.vllm_adapter.debug import proposer_stats

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="gemma3-smollm2")
    parser.add_argument("--drafter", help="another drafter than the pair's (e.g. a Hugging Face folder)")
    parser.add_argument("-k", type=int, default=3, help="drafted every step (adaptive_length false)")
    parser.add_argument("--usd", default="{}", help="usd settings over those, JSON (e.g. '{\"adaptive_length\": true}')")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workload", default="chat", choices=CATEGORIES, help="kind of prompt (interleaved_check's)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per round")
    parser.add_argument("--batch", type=int, default=1, help="prompts sent at once (--prompts is rounded up to a multiple)")
    parser.add_argument("--never-draft", action="store_true", help="vllm-usd's engine drafts nothing (NeverDrafts)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    spec = pair_specs([args.pair])[0]
    n = -(-args.prompts // args.batch) * args.batch
    prompts = [p["text"] for p in load_workloads([args.workload], n=n)[args.workload]]
    systems = {"plain": {}, f"usd_k{args.k}": speculative_args(drafter=args.drafter or spec.drafter, k=args.k,
                                                               **{"adaptive_length": False, "profile": True,
                                                                  **json.loads(args.usd)})}
    if args.never_draft:
        systems[f"usd_k{args.k}"]["speculative_config"]["model"] = "benchmarks.step_profile.NeverDrafts"
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    seen: dict[tuple[str, str], float] = {}  # (engine, proposer phase) -> its seconds at the last read
    with contextlib.ExitStack() as stack:
        engines = {name: stack.enter_context(engine(spec.target, args.batch, extra)) for name, extra in systems.items()}
        for name, llm in engines.items():
            llm.collective_rpc(install_timers)
            llm.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=args.temperature, seed=1),
                         use_tqdm=False)
            llm.collective_rpc(read_timers, kwargs={"reset": True})
            seen.update({(name, key): seconds for key, seconds
                         in (llm.collective_rpc(proposer_stats)[0] or {}).get("timings", {}).items()})
        for r in range(args.rounds):
            for name, llm in engines.items():
                start, tokens = time.perf_counter(), 0
                for i in range(0, len(prompts), args.batch):
                    params = [SamplingParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, ignore_eos=True,
                                             temperature=args.temperature, seed=i + j) for j in range(args.batch)]
                    outputs = llm.generate(prompts[i:i + args.batch], params, use_tqdm=False)
                    tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
                wall = time.perf_counter() - start
                totals = llm.collective_rpc(read_timers, kwargs={"reset": True})[0]
                steps = max(totals.get("execute_model", [0.0, 1])[1], 1)
                per_step_ms = {key: round(seconds / steps * 1e3, 2) for key, (seconds, _) in sorted(totals.items())}
                phases = (llm.collective_rpc(proposer_stats)[0] or {}).get("timings", {})  # since start, usd.profile
                per_step_ms.update({f"usd.{key}": round((seconds - seen.get((name, key), 0.0)) / steps * 1e3, 2)
                                    for key, seconds in sorted(phases.items())})
                seen.update({(name, key): seconds for key, seconds in phases.items()})
                runs[name].append({"round": r, "tok_s": tokens / wall, "steps": steps,
                                   "ms_per_step": wall / steps * 1e3, "per_step_ms": per_step_ms})
                print(f"{name} round {r}: {tokens / wall:.2f} tok/s, {steps} steps, {wall / steps * 1e3:.1f} ms a step;",
                      ", ".join(f"{key} {ms} ms" for key, ms in per_step_ms.items()), flush=True)
    result = {"command": "python benchmarks/step_profile.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "pair": args.pair, "k": args.k, "temperature": args.temperature, "never_draft": args.never_draft,
              "workload": args.workload, "max_tokens": args.max_tokens, "batch": args.batch,
              "host": {"cpu": cpu_model(), "flags": cpu_flags()}, "runs": runs,
              "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("VLLM_CPU_", "OMP_"))}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
