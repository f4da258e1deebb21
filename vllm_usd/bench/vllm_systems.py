"""The vLLM systems: start an engine with or without speculation, and time one setting."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from vllm_usd.bench.metrics import step_split
from vllm_usd.bench.plan import ENGINE_SETTINGS
from vllm_usd.vllm_adapter.compat import shutdown_engine

DRAIN_SECONDS = 5.0  # the longest a failed start's log is waited for to reach its file


def engine_args(system: str, drafter: str, k: int, usd_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's engine arguments for one system; ``usd_settings`` go over the vllm-usd systems' own."""
    from vllm_usd.config import speculative_args

    if system == "plain":
        return {}
    if system == "native":
        return {"speculative_config": {"method": "draft_model", "model": drafter, "num_speculative_tokens": k,
                                       "use_heterogeneous_vocab": True}}
    sampling = "greedy" if system == "usd_greedy" else "auto"
    mode = {"usd_string": "string", "usd_adaptive": "auto"}.get(system, "tli")  # usd_adaptive: the defaults
    settings = {"draft_sampling": sampling, "draft_mode": mode, "profile": True,
                "adaptive_length": system == "usd_adaptive", **(usd_settings or {})}
    return speculative_args(drafter=drafter, k=k, **settings)


class EngineStartError(RuntimeError):
    """vLLM did not start; the message is the root cause from the engine's own log."""


_CAUSE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)$")


def root_cause(log: str) -> str | None:
    """The last error line in an engine log that is not vLLM's generic start-up failure."""
    causes = []
    for line in log.splitlines():
        m = _CAUSE.search(line)
        if m and "Engine core initialization failed" not in m.group(2):
            causes.append(f"{m.group(1)}: {m.group(2).strip()}")
    inner = [c for c in causes if "Worker failed with error" not in c]
    return (inner or causes or [None])[-1]


@contextlib.contextmanager
def stderr_copied_to(path: Path) -> Iterator[Callable[[], None]]:
    """Send fd 2 (ours and the engine processes' started meanwhile) to ``path`` as well as the terminal.
    Yields ``drain``: called after the block, it waits (at most ``DRAIN_SECONDS``) until what was written
    has reached ``path``: tee ends once every process holding its pipe has closed it (a started engine's
    processes keep it open, so only a failed start is waited for)."""
    sys.stderr.flush()
    saved = os.dup(2)
    tee = subprocess.Popen(["tee", "-a", str(path)], stdin=subprocess.PIPE, stdout=saved)
    os.dup2(tee.stdin.fileno(), 2)

    def drain() -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            tee.wait(DRAIN_SECONDS)

    try:
        yield drain
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        tee.stdin.close()  # tee ends once the engine processes close their copies


@contextlib.contextmanager
def engine(target: str, max_num_seqs: int, extra: dict[str, Any]) -> Iterator[Any]:
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(proposer_stats)
    with tempfile.TemporaryDirectory() as tmp:
        log, drain = Path(tmp) / "engine-start.log", lambda: None  # drain: stderr_copied_to's, once it ran
        try:
            with stderr_copied_to(log) as drain:
                llm = LLM(model=target, max_num_seqs=max_num_seqs, **ENGINE_SETTINGS, **extra)
        except Exception as exc:
            drain()
            cause = root_cause(log.read_text(errors="replace")) if log.exists() else None
            raise EngineStartError(cause or f"{type(exc).__name__}: {exc}") from exc
    try:
        yield llm
    finally:
        shutdown_engine(llm)
        del llm
        gc.collect()


def spec_counters(llm: Any) -> dict[str, Any]:
    """vLLM's cumulative spec-decode counters: drafts, draft tokens, accepted, accepted per position."""
    out: dict[str, Any] = {"drafts": 0.0, "draft_tokens": 0.0, "accepted": 0.0, "per_pos": []}
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out["drafts"] = m.value
        elif m.name == "vllm:spec_decode_num_draft_tokens":
            out["draft_tokens"] = m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            out["accepted"] = m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["per_pos"] = list(m.values)
    return out


def proposer_timings(llm: Any) -> dict[str, float]:
    """The proposer's phase timings, and its ``emitting_rows`` counter (rows that emitted tokens)."""
    from vllm_usd.vllm_adapter.debug import proposer_stats

    stats = llm.collective_rpc(proposer_stats)[0]
    if not stats:
        return {}
    return {**stats["timings"], "emitting_rows": float(stats["counters"].get("emitting_rows", 0))}


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    per_pos = before["per_pos"] or [0.0] * len(after["per_pos"])
    out["per_pos"] = [a - b for a, b in zip(after["per_pos"], per_pos)]
    return out


def run_setting(llm: Any, prompts: list[str], batch: int, temperature: float, max_tokens: int, repeats: int,
                 usd: bool, want_logprobs: bool) -> dict[str, Any]:
    from vllm import SamplingParams

    # EOS masked until max_tokens, as transformers' min_new_tokens does: every system writes the same
    # text (ignore_eos alone would let the target emit EOS and go on past it)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                            logprobs=0 if want_logprobs else None)
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    llm.generate(groups[0][: max(1, min(batch, 2))], params, use_tqdm=False)  # warm-up
    before = spec_counters(llm)
    t_before = proposer_timings(llm) if usd else {}
    runs: list[float] = []
    outputs: list[Any] = []
    total_tokens = 0
    for _ in range(repeats):
        tokens = 0
        start = time.perf_counter()
        outputs = []
        for group in groups:
            outputs += llm.generate(group, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        total_tokens += tokens
        runs.append(tokens / seconds)
    counts = counter_delta(spec_counters(llm), before)
    row: dict[str, Any] = {"tok_s_runs": runs, "tok_s": statistics.median(runs)}
    drafts = counts["drafts"]
    row["acceptance_length"] = 1 + counts["accepted"] / drafts if drafts else None
    row["per_position_acceptance"] = [p / drafts for p in counts["per_pos"]] if drafts else None
    row["draft_tokens_per_step"] = counts["draft_tokens"] / drafts if drafts else None
    if usd:
        t_after = proposer_timings(llm)
        delta = {k: t_after.get(k, 0.0) - t_before.get(k, 0.0) for k in t_after}
        row_steps = delta.pop("emitting_rows", 0.0)
        row["step_split"] = step_split(delta)
        # tokens per decoding step of each request, drafted or not, as transformers' acceptance counts
        # them: each request's prefill step (one token, nothing to verify) is left out of both counts
        requests = len(prompts) * repeats
        row["tokens_per_step"] = (total_tokens - requests) / (row_steps - requests) if row_steps > requests else None
    row["greedy_outputs"] = [list(o.outputs[0].token_ids) for o in outputs] if temperature == 0 else None
    if want_logprobs:
        row["mean_logprob_per_seq"] = [
            statistics.fmean(next(iter(step.values())).logprob for step in o.outputs[0].logprobs)
            for o in outputs if o.outputs[0].logprobs]
    return row
