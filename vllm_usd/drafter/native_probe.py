"""A native drafter runtime proves itself on this host before a worker runs it.

llama.cpp picks its kernels by the CPU's features, and a kernel that is wrong on one CPU (AMX
matmuls that segfault, an instruction the build host had and this one lacks) cannot be caught
in-process: a segfault takes the worker, and the engine, down. So every configuration a worker
would run is first run by a child process (``probe_child.py``): it loads the drafter's GGUF with
those settings and drafts through ``LlamaCppDrafterRuntime`` (the serving code): two requests in
one batched decode, three drafts rolled back, then one token at a time. The parent compares each
row of logits with the transformers drafter's on the same tokens (float32, the drafter folder):

- top-1 agreement: at least ``TOP1_MIN`` of the rows pick the same next token;
- log-prob gap: in every row, the mean of |log p_llama - log p_ref| under p_ref is at most
  ``LOGPROB_GAP_MAX`` nats (log-probs over the drafter's vocabulary, which holds the intersection).

The real pair's SmolLM2, its Q4_1 GGUF against the float weights dequantized from it, gives 0.96
and 0.13 nats (0.20 requantized to Q8_0): llama.cpp also rounds activations and the KV cache.
Noise gives about 0.0 and several nats (``tests/test_native_probe.py`` plants it).

Settings are tried in this order, each only if the one before crashed, hung past ``timeout_s``
or disagreed:

1. the best CPU variant ggml scores for this host, with its extra buffer types (repacked or AMX
   weights);
2. the next-best variant, with its own extra buffer types: a variant without the failed one's
   kernels (AMX exists only in the Sapphire Rapids variant), keeping llama.cpp's repacked kernels;
3. the best variant without extra buffer types;
4. none: the drafter runs in transformers.

A native build has one variant, so 2 is skipped. The verdict is cached under
``$VLLM_USD_CACHE/native-probe/``, keyed by what decides it: the llama.cpp build, the CPU, the
GGUF's content and type, and the probe itself; a second start reads it (no child process).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from vllm_usd.drafter import ggml_library
from vllm_usd.drafter.llama_cpp_runtime import NativeSettings

logger = logging.getLogger("vllm.usd")

PROBE_VERSION = 3  # 2: each attempt's batch-1 step time; 3: timed as drafting runs (40 appended tokens)
TOP1_MIN = 0.7
LOGPROB_GAP_MAX = 1.0  # nats
CHILD = "vllm_usd.drafter.probe_child"
TEXTS = ("The capital of France is Paris. It is known for the Eiffel Tower and its museums.",
         "def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n")


@dataclass
class ChildResult:
    outcome: str  # "ok", "crashed (SIGSEGV)", "hung (over 60 s)", "failed (ValueError: ...)"
    events: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def run_child(request: dict[str, Any], *, timeout_s: float = 120.0, module: str = CHILD) -> ChildResult:
    """Run one request in ``python -m module``; whatever happens to the child, return how it ended."""
    try:
        proc = subprocess.run([sys.executable, "-m", module], input=json.dumps(request), capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return ChildResult(f"hung (over {timeout_s:.0f} s)", _events(exc.stdout))
    events = _events(proc.stdout)
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return ChildResult(f"crashed ({name})", events)
    if proc.returncode != 0:
        last = (proc.stderr or "").strip().splitlines()
        return ChildResult(f"failed ({last[-1] if last else f'exit code {proc.returncode}'})", events)
    return ChildResult("ok", events)


def _events(stdout: str | bytes | None) -> dict[str, Any]:
    if isinstance(stdout, bytes):
        stdout = stdout.decode(errors="replace")
    events: dict[str, Any] = {}
    for line in (stdout or "").splitlines():
        if line.startswith("{"):
            try:
                events.update(json.loads(line))
            except json.JSONDecodeError:
                pass
    return events


# -- the scripted drafting and its reference ------------------------------------------------------
def probe_calls(a: list[int], b: list[int]) -> tuple[list[tuple[list[str], list[int], list[list[int]]]],
                                                      list[list[int]]]:
    """The forwards the child runs (rows, keep, new tokens) and, per output row, the tokens it follows."""
    seqs = {"a": [], "b": []}
    calls, prefixes = [], []

    def step(rows: list[str], keep: list[int], new: list[list[int]]) -> None:
        calls.append((rows, keep, new))
        for r, k, n in zip(rows, keep, new):
            seqs[r] = seqs[r][:k] + n
            prefixes.append(list(seqs[r]))

    half_a, half_b = len(a) // 2, len(b) // 2
    step(["a", "b"], [0, 0], [a[:half_a], b[:half_b]])  # both prompts in one batch
    step(["a"], [half_a], [b[:3]])  # three drafts ...
    step(["a", "b"], [half_a, half_b], [[a[half_a]], [b[half_b]]])  # ... rolled back
    for i in range(1, min(len(a) - half_a, len(b) - half_b)):  # then one token at a time
        step(["a", "b"], [half_a + i, half_b + i], [[a[half_a + i]], [b[half_b + i]]])
    return calls, prefixes


def reference_logits(folder: str, prefixes: list[list[int]]) -> np.ndarray:
    """The transformers drafter's logits after each prefix (float32, plain attention): [rows, vocab]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    runs: list[tuple[list[int], torch.Tensor]] = []  # one forward per sequence no other extends
    for prefix in sorted(prefixes, key=len, reverse=True):
        if not any(seq[:len(prefix)] == prefix for seq, _ in runs):
            with torch.inference_mode():
                runs.append((prefix, model(torch.tensor([prefix])).logits[0].float()))  # [len, vocab]
    rows = [next(logits[len(p) - 1] for seq, logits in runs if seq[:len(p)] == p) for p in prefixes]
    return torch.stack(rows).numpy()


def agreement(native: np.ndarray, reference: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement over rows, the largest per-row mean |log p_native - log p_ref| under p_ref)."""
    width = min(native.shape[1], reference.shape[1])
    a, b = native[:, :width].astype(np.float64), reference[:, :width].astype(np.float64)
    if not np.isfinite(a).all():
        return 0.0, float("inf")
    la = a - np.logaddexp.reduce(a, axis=1, keepdims=True)
    lb = b - np.logaddexp.reduce(b, axis=1, keepdims=True)
    gap = (np.exp(lb) * np.abs(la - lb)).sum(axis=1)
    return float((a.argmax(1) == b.argmax(1)).mean()), float(gap.max())


# -- the verdict --------------------------------------------------------------------------------------
@dataclass
class NativeVerdict:
    """What the probe found: the settings to run (None: transformers), and every attempt."""

    settings: NativeSettings | None
    attempts: list[dict[str, Any]] = field(default_factory=list)
    key: str = ""
    cache_file: str = ""
    cached: bool = False
    seconds: float = 0.0
    reference: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NativeVerdict":
        settings = data.get("settings")
        return cls(**{**data, "settings": NativeSettings(**settings) if settings else None})

    @property
    def step_ms(self) -> float | None:
        """The batch-1 step time the passing settings measured in the probe."""
        return next((a.get("step_ms") for a in self.attempts if a["outcome"] == "ok"), None)

    def summary(self) -> str:
        """One line: what failed, and what runs instead."""
        failed = [f"{a['settings']} {a['outcome']}" for a in self.attempts if a["outcome"] != "ok"]
        passed = next((a for a in self.attempts if a["outcome"] == "ok"), None)
        chosen = passed["settings"] if passed else "transformers (every llama.cpp setting failed)"
        measured = (f" (top-1 agreement {passed['top1']:.2f}, log-prob gap {passed['logprob_gap']:.3f} nats)"
                    if passed and passed.get("top1") is not None else "")
        where = f"; {'cached' if self.cached else 'probed in %.1f s' % self.seconds}: {self.cache_file}"
        if failed:
            return f"vllm-usd: {'; '.join(failed)} in the probe; the drafter runs on {chosen}{measured} instead{where}"
        return f"vllm-usd: {chosen} passed the probe{measured}{where}"


def cpu_identity() -> str:
    """The CPU's model and feature flags, as the kernels see them."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
        return " ".join(info.get(k, "").strip() for k in ("model name", "flags"))
    except OSError:
        return platform.processor() or platform.machine()


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def verdict_key(gguf: str, libdir: Path, child: str) -> str:
    parts = {"probe": PROBE_VERSION, "child": child, "build": ggml_library.build_id(libdir),
             "cpu": hashlib.sha256(cpu_identity().encode()).hexdigest()[:16], "gguf": file_sha256(gguf),
             "tolerance": [TOP1_MIN, LOGPROB_GAP_MAX]}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def candidates(scores: dict[str, int]) -> list[NativeSettings]:
    """The settings to try, in order (module docstring)."""
    ranked = sorted((name for name, s in scores.items() if s > 0), key=lambda n: (-scores[n], n))
    best = ranked[0] if ranked else None
    out = [NativeSettings(best, True)]
    if len(ranked) > 1:
        out.append(NativeSettings(ranked[1], True))
    out.append(NativeSettings(best, False))
    return out


def prove_native(gguf: str, folder: str, *, vocab_size: int, tokenizer: Any, threads: int, cache_root: str,
                 timeout_s: float = 120.0, child: str = CHILD,
                 reference: Callable[[str, list[list[int]]], np.ndarray] = reference_logits) -> NativeVerdict:
    """The settings llama.cpp runs ``gguf`` with on this host, from the cache or from child processes."""
    started = time.perf_counter()
    libdir = ggml_library.library_dir()
    if libdir is None:
        raise ValueError("vllm-usd: llama-cpp-python is not installed")
    key = verdict_key(gguf, libdir, child)
    cache_file = Path(os.path.expanduser(cache_root)) / "native-probe" / f"{key}.json"
    if cache_file.is_file():
        try:
            verdict = NativeVerdict.from_dict(json.loads(cache_file.read_text()))
            verdict.cached = True
            return verdict
        except (ValueError, TypeError, KeyError):
            pass  # an unreadable entry is probed again
    verdict = NativeVerdict(None, key=key, cache_file=str(cache_file))
    scan = run_child({"call": "scan"}, timeout_s=timeout_s, module=child)
    if not scan.ok:
        verdict.attempts.append({"settings": "scanning llama.cpp's CPU backends", "outcome": scan.outcome})
        return _finish(verdict, started)
    calls, prefixes = probe_calls(*(tokenizer(t, add_special_tokens=False).input_ids[:24] for t in TEXTS))
    try:
        expected = reference(folder, prefixes)
        verdict.reference = "transformers float32"
    except Exception as exc:  # noqa: BLE001 - no float weights to compare with: crashes and hangs still count
        expected, verdict.reference = None, f"none ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    with tempfile.TemporaryDirectory(prefix="vllm-usd-probe-") as tmp:
        for settings in candidates(scan.events.get("variants", {})):
            attempt = _attempt(settings, gguf, calls, expected, vocab_size, threads, timeout_s, child,
                               os.path.join(tmp, f"{len(verdict.attempts)}.npy"))
            verdict.attempts.append(attempt)
            if attempt["outcome"] == "ok":
                verdict.settings = settings
                break
    return _finish(verdict, started)


def _attempt(settings: NativeSettings, gguf: str, calls: list, expected: np.ndarray | None, vocab_size: int,
             threads: int, timeout_s: float, child: str, out: str) -> dict[str, Any]:
    started = time.perf_counter()
    result = run_child({"call": "probe", "gguf": gguf, "settings": dataclasses.asdict(settings), "threads": threads,
                        "vocab_size": vocab_size, "calls": calls, "out": out}, timeout_s=timeout_s, module=child)
    attempt: dict[str, Any] = {"settings": settings.describe(result.events.get("buffer_types")),
                               "outcome": result.outcome, "buffer_types": result.events.get("buffer_types"),
                               "top1": None, "logprob_gap": None, "rows": len(expected) if expected is not None else 0,
                               "step_ms": result.events.get("step_ms")}
    if result.ok and expected is not None:
        top1, gap = agreement(np.load(out), expected)
        attempt.update(top1=top1, logprob_gap=gap)
        if top1 < TOP1_MIN or not gap <= LOGPROB_GAP_MAX:
            attempt["outcome"] = (f"disagreed with transformers (top-1 {top1:.2f} < {TOP1_MIN} or "
                                  f"log-prob gap {gap:.3f} > {LOGPROB_GAP_MAX} nats)")
    attempt["seconds"] = round(time.perf_counter() - started, 2)
    return attempt


def _finish(verdict: NativeVerdict, started: float) -> NativeVerdict:
    verdict.seconds = round(time.perf_counter() - started, 2)
    path = Path(verdict.cache_file)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdict.as_dict(), indent=1))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("vllm-usd: could not cache the native probe's verdict at %s (%s); the next start "
                       "probes again", path, exc)
    return verdict
