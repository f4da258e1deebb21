"""Which drafter runtime and weight format to run, and opening it.

``usd.drafter_runtime``:
- ``"llama_cpp"``: the drafter's GGUF in llama.cpp (CPU only).
- ``"transformers"``: the drafter folder in transformers, on the worker's device.
- ``"auto"`` (default): llama.cpp on the CPU when ``llama-cpp-python`` is installed and a
  GGUF is found (``usd.drafter_gguf``, or a single ``*.gguf`` file in the drafter folder), or
  the folder converts to one (``hf_to_gguf.py``; not when ``usd.drafter_dtype`` names a
  transformers format); otherwise transformers.

A llama.cpp choice runs only as its native probe proved it on this host (``native_probe.py``):
with the settings that passed, or in transformers where none did (``proven``).

``usd.drafter_gguf_type`` (llama.cpp only): the GGUF as it is, or requantized once to a type
llama.cpp runs faster (``gguf_types.py``).

``usd.drafter_dtype`` (transformers only): ``"auto"`` (default) takes ``AUTO_DTYPE`` for the
device, or one of
``"float32"``, ``"bfloat16"``, ``"float16"``, ``"int8"`` (CPU), ``"config"``.
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from vllm_usd import envs
from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafter.llama_cpp_runtime import NativeSettings
from vllm_usd.drafter.loading import DrafterLoadError, load_drafter_model, read_drafter

logger = logging.getLogger("vllm.usd")

# The transformers runtime's default format per device type. On the CPU int8 measured faster
# (benchmarks/drafter_step.py: 21.6 vs 36.6 ms at batch 1) but costs 5-9% of the sampled
# acceptance on the real pair where bfloat16 costs none (benchmarks/format_acceptance.py), so
# bfloat16 stays the default; GPUs are not measured at all.
AUTO_DTYPE = {"cpu": "bfloat16", "cuda": "bfloat16"}
RUNTIMES = ("auto", "transformers", "llama_cpp")
DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "config")


@dataclass(frozen=True)
class DrafterChoice:
    runtime: str  # "transformers" or "llama_cpp"
    dtype: str  # the transformers weight format; "gguf" (the file as it is) or "gguf/<type>" (requantized)
    device: str
    gguf: str | None = None
    gguf_type: str = "file"  # llama.cpp: usd.drafter_gguf_type ("file": the GGUF named), resolved by open_drafter
    native: NativeSettings | None = None  # llama.cpp: the settings its probe passed (None: not probed yet)
    probe: str = ""  # the probe's one-line verdict


def _run_here(compute: Callable[[], DrafterChoice]) -> DrafterChoice:
    return compute()


def find_gguf(path: str, gguf: str | None) -> str | None:
    """The drafter's GGUF: the one named, else the only ``*.gguf`` in the drafter folder."""
    if gguf:
        if not os.path.isfile(gguf):
            raise DrafterLoadError(f"vllm-usd: usd.drafter_gguf = {gguf!r} is not a file. Point it at the drafter's GGUF.")
        return gguf
    found = sorted(glob.glob(os.path.join(path, "*.gguf"))) if os.path.isdir(path) else []
    return found[0] if len(found) == 1 else None


def check_gguf(gguf: str) -> None:
    """Refuse, in one line, a GGUF that is not whole (read in Python: no native code)."""
    from vllm_usd.drafter.gguf_types import read_gguf

    try:
        read_gguf(gguf)
    except ValueError as exc:
        raise DrafterLoadError(str(exc)) from None


def choose(path: str, *, runtime: str = "auto", dtype: str = "auto", gguf: str | None = None,
           device: str = "cpu", gguf_type: str = "auto") -> DrafterChoice:
    """Decide the runtime and format from the settings, the device and what is installed."""
    from vllm_usd.drafter.llama_cpp_runtime import llama_cpp_available

    on_cpu = torch.device(device).type == "cpu"
    if runtime in ("auto", "llama_cpp"):
        found = find_gguf(path, gguf)
        usable = on_cpu and found is not None and llama_cpp_available()
        if usable:
            check_gguf(found)
            return DrafterChoice("llama_cpp", "gguf", "cpu", found, gguf_type)
        if runtime == "auto" and dtype == "auto" and on_cpu and found is None and _convertible(path):
            return DrafterChoice("llama_cpp", "gguf", "cpu", None, gguf_type)  # converted when opened
        if runtime == "llama_cpp":
            why = ("it runs on the CPU only" if not on_cpu else
                   "no GGUF was found: set usd.drafter_gguf" if found is None else
                   "llama-cpp-python is not installed: pip install 'vllm-usd[llamacpp]'")
            raise DrafterLoadError(f"vllm-usd: usd.drafter_runtime = \"llama_cpp\" cannot run: {why}.")
    if dtype == "auto":
        dtype = AUTO_DTYPE.get(torch.device(device).type, "float32")
    if dtype == "int8" and not on_cpu:
        raise DrafterLoadError("vllm-usd: usd.drafter_dtype = \"int8\" runs on the CPU only; use \"bfloat16\" on a GPU.")
    return DrafterChoice("transformers", dtype, str(device))


def _convertible(path: str) -> bool:
    """A Hugging Face folder with weights, and llama.cpp and its converter installed."""
    from vllm_usd import envs
    from vllm_usd.drafter.hf_to_gguf import converter_dir
    from vllm_usd.drafter.llama_cpp_runtime import llama_cpp_available

    has_weights = os.path.isdir(path) and any(name.endswith((".safetensors", ".bin")) for name in os.listdir(path))
    return has_weights and llama_cpp_available() and converter_dir(envs.cache_dir()) is not None


def kv_bytes_per_token(config: Any, element_bytes: int) -> int:
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * heads * head_dim * element_bytes


@dataclass
class OpenedDrafter:
    runtime: DrafterRuntime
    tokenizer: Any
    vocab_size: int  # the drafter's logits width
    choice: DrafterChoice


def probe_verdict(choice: DrafterChoice, path: str, *, tokenizer: Any, vocab_size: int, threads: int,
                  timeout_s: float = 120.0, child: str | None = None, cpus: frozenset[int] | None = None):
    """(the GGUF to run, its type, the native probe's ``NativeVerdict`` for it, {type: batch-1 step ms}) for a
    llama.cpp ``choice``. Where ``usd.drafter_gguf_type`` is ``auto``, each candidate type is probed and
    the fastest that passed runs (``gguf_types.candidates``): as the probe's child timed them, or, given
    ``cpus`` (a worker starting its drafter), as they run in this process on those CPUs, interleaved."""
    from vllm_usd import envs
    from vllm_usd.drafter.gguf_types import candidates
    from vllm_usd.drafter.hf_to_gguf import convert_folder
    from vllm_usd.drafter.native_probe import CHILD, prove_native

    source = choice.gguf or convert_folder(path, envs.cache_dir())  # ConversionError where it cannot be
    runs = []
    for gguf, gguf_type in candidates(source, choice.gguf_type, envs.cache_dir()):
        verdict = prove_native(gguf, path, vocab_size=vocab_size, tokenizer=tokenizer, threads=threads,
                               cache_root=envs.cache_dir(), timeout_s=timeout_s, child=child or CHILD)
        runs.append((gguf, gguf_type, verdict))
    timed = {gguf_type: verdict.step_ms for _, gguf_type, verdict in runs}
    passed = [run for run in runs if run[2].settings is not None]
    if cpus is not None and len(passed) > 1:  # the child timed each alone; here they run as drafting will
        from vllm_usd.drafter.llama_cpp_runtime import fastest_here

        try:
            here = fastest_here([(gguf, verdict.settings) for gguf, _, verdict in passed], vocab_size, cpus)
            timed.update({gguf_type: ms for (_, gguf_type, _), ms in zip(passed, here)})
        except Exception as exc:  # noqa: BLE001 - the child's times stand
            logger.warning("vllm-usd: timing the drafter's weight types in this process failed (%s)", exc)
    best = min(passed, key=lambda run: timed[run[1]] if timed[run[1]] is not None else float("inf")) \
        if passed else runs[0]
    if len(runs) > 1:
        logger.info("vllm-usd: the drafter GGUF's types timed at batch 1 %s: %s; runs %s",
                    "in this worker" if cpus is not None and len(passed) > 1 else "on this host", ", ".join(f"{name} {ms:.1f} ms" if ms is not None else f"{name} failed the probe"
                              for name, ms in timed.items()), best[1])
    return best[0], best[1], best[2], timed


def proven(choice: DrafterChoice, path: str, *, tokenizer: Any, vocab_size: int, cpus: frozenset[int],
           timeout_s: float, child: str | None) -> DrafterChoice:
    """``choice`` (llama.cpp) as its probe proved it: the GGUF to run (requantized where
    usd.drafter_gguf_type says) with the settings that passed here, or the transformers runtime
    where none did. Logs the verdict in one line; never raises."""
    from vllm_usd.drafter.hf_to_gguf import ConversionError

    fallback = DrafterChoice("transformers", AUTO_DTYPE["cpu"], "cpu")
    try:
        gguf, gguf_type, verdict, _ = probe_verdict(choice, path, tokenizer=tokenizer, vocab_size=vocab_size,
                                                    threads=len(cpus), timeout_s=timeout_s, child=child, cpus=cpus)
    except ConversionError as exc:
        line = (f"vllm-usd: the drafter folder {path} was not converted for llama.cpp: {exc}; it runs on "
                f"transformers {fallback.dtype}")
        logger.warning("%s", line)
        return dataclasses.replace(fallback, probe=line)
    except Exception as exc:  # noqa: BLE001 - a probe that cannot run proves nothing: no native code serves
        line = (f"vllm-usd: the llama.cpp drafter could not be probed ({type(exc).__name__}: {exc}); "
                f"the drafter runs on transformers {fallback.dtype} instead")
        logger.warning("%s", line)
        return dataclasses.replace(fallback, probe=line)
    line = verdict.summary()
    (logger.info if verdict.attempts and verdict.attempts[0]["outcome"] == "ok" else logger.warning)("%s", line)
    if verdict.settings is None:
        return dataclasses.replace(fallback, probe=line)
    return dataclasses.replace(choice, gguf=gguf, gguf_type=gguf_type, native=verdict.settings, probe=line,
                               dtype="gguf" if gguf_type == "file" else f"gguf/{gguf_type}")


def open_drafter(path: str, choice: DrafterChoice, *, max_len: int, max_requests: int, kv_budget_bytes: int,
                 revision: str | None = None, trust_remote_code: bool = False,
                 cpus: frozenset[int] | None = None, cuda_graphs: bool = False,
                 probe_on: Callable[[Callable[[], DrafterChoice]], DrafterChoice] = _run_here,
                 probe_timeout_s: float = 120.0, probe_child: str | None = None,
                 agree: Callable[[bool], bool] = lambda failed: failed, catch_up_tokens: int = 1) -> OpenedDrafter:
    """Load the drafter as ``choice`` says and wrap it in its runtime.

    ``cpus``: the CPUs llama.cpp drafts on, a thread each (default: ``drafter_cpus()``); the
    transformers runtime uses torch's threads, which vLLM's worker sets.
    ``cuda_graphs``: on a CUDA device, replay the transformers drafter's one-token decode step and its
    catch-up of up to ``catch_up_tokens`` per row (k + 1) from CUDA graphs captured per batch bucket
    (``decode_graphs.py``); elsewhere it has no effect.
    A llama.cpp choice not yet probed is probed first (``proven``), by ``probe_on``: in this
    process, or under tensor parallelism on rank 0 with the verdict sent to every rank.
    ``agree``: whether a decode-graph capture failed on any tensor-parallel rank (``compat.tp_any``).
    """
    from vllm_usd.drafter.llama_cpp_runtime import KV_BYTES_PER_ELEMENT, LlamaCppDrafterRuntime, drafter_cpus

    config, tokenizer = read_drafter(path, revision=revision, trust_remote_code=trust_remote_code)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    cpus = cpus or drafter_cpus()
    if choice.runtime == "llama_cpp" and choice.native is None:
        unproven = choice
        choice = probe_on(lambda: proven(unproven, path, tokenizer=tokenizer, vocab_size=int(text_config.vocab_size),
                                         cpus=cpus, timeout_s=probe_timeout_s, child=probe_child))
    if choice.runtime == "llama_cpp":
        vocab_size = int(text_config.vocab_size)
        runtime: DrafterRuntime = LlamaCppDrafterRuntime(
            choice.gguf, settings=choice.native, vocab_size=vocab_size,
            kv_bytes_per_token=kv_bytes_per_token(config, KV_BYTES_PER_ELEMENT), max_len=max_len,
            max_requests=max_requests, kv_budget_bytes=kv_budget_bytes, cpus=cpus)
        return OpenedDrafter(runtime, tokenizer, vocab_size, choice)
    from vllm_usd.drafter.hf_runtime import HFDrafterRuntime

    model = load_drafter_model(path, config, dtype=choice.dtype, revision=revision,
                               trust_remote_code=trust_remote_code, device=choice.device)
    capture = None
    if cuda_graphs and torch.device(choice.device).type == "cuda":
        from vllm_usd.drafter.decode_graphs import capture_cuda_graph as capture
    elif envs.cpu_graphs() and torch.device(choice.device).type == "cpu":
        from vllm_usd.drafter.graph_double import capture_recorded as capture
    runtime = HFDrafterRuntime(model, max_len=max_len, max_requests=max_requests, kv_budget_bytes=kv_budget_bytes,
                               capture=capture, agree=agree, catch_up_tokens=catch_up_tokens)
    return OpenedDrafter(runtime, tokenizer, int(model.get_output_embeddings().weight.shape[0]), choice)
