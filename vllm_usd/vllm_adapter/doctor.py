"""``vllm-usd doctor``: will vllm-usd work on this vLLM, and what should you know?

It reports the vLLM version found, each patch with the fingerprints of the
functions it relies on, whether vllm-usd will be active, the device the
drafter uses, and the known platform bugs that apply. With ``--drafter`` it also
shows how that drafter would run on this host: its runtime and format, and for a
llama.cpp drafter the native probe's verdict (``drafter/native_probe.py``: each
setting tried, its buffer types, the measured agreement with transformers, and
the cache entry), probing where nothing is cached yet. With ``vllm_source`` it
checks an unpacked source tree (a folder holding ``vllm/``) instead, without
importing it, so a machine that cannot run a vLLM release can still check it.
"""

from __future__ import annotations

import dataclasses

from pathlib import Path
from typing import Any

from vllm_usd import envs
from vllm_usd.vllm_adapter import fingerprints

CPU_ONLY = ("cpu_expand_fix", "cpu_empty_topk_fix")  # patches that apply on vLLM's CPU platform only

def _installed_platform() -> dict[str, Any]:
    """Platform facts that need the installed vLLM imported (never for a source tree)."""
    try:
        from vllm.platforms import current_platform

        on_cpu = bool(current_platform.is_cpu())
        target = "cpu" if on_cpu else f"{current_platform.device_type}:0"
    except Exception as exc:  # noqa: BLE001 - a broken vLLM is something to report, not to crash on
        return {"platform": f"unknown ({type(exc).__name__}: {exc})", "on_cpu": None, "target_device": "unknown"}
    return {"platform": "cpu" if on_cpu else current_platform.device_type, "on_cpu": on_cpu, "target_device": target}


def _known_bugs(on_cpu: bool | None, version: str) -> list[dict[str, Any]]:
    if not on_cpu:
        return []
    from vllm_usd.vllm_adapter import patches

    bugs = []
    try:
        from vllm.platforms import current_platform

        current_platform.register_triton_kernel_overrides()  # the CPU kernels, as vLLM's CPU worker registers them
        broken = patches.cpu_expand_is_broken()
    except Exception as exc:  # noqa: BLE001
        broken = None
        detail = f"could not run the check ({type(exc).__name__}: {exc})"
    else:
        detail = "measured: vLLM's CPU expand_batch_to_tokens " + (
            "returns wrong values for float inputs" if broken else "is correct here")
    if broken is not False:
        bugs.append({"name": "cpu_expand_bug", "applies": broken, "detail": detail,
                     "handled_by": "patch cpu_expand_fix (in vllm-usd's engines; VLLM_USD_FIX_CPU_SAMPLER=1 for all)",
                     "see": "docs/cpu-expand-bug.md"})
    if version.startswith("0.32."):
        bugs.append({"name": "cpu_seeded_chunked_prefill", "applies": True,
                     "detail": "a request with its own seed whose prefill is split into chunks stops the engine "
                               "('CPU Generator does not use offset')",
                     "handled_by": "nothing: avoid per-request seeds with chunked prefill on CPU (README, Limitations)"})
    return bugs


def diagnose(vllm_source: str | Path | None = None) -> dict[str, Any]:
    """Everything ``vllm-usd doctor`` prints, as one JSON-ready dict."""
    from vllm_usd.vllm_adapter.patches import PATCHES

    root = Path(vllm_source).resolve() if vllm_source is not None else fingerprints.installed_root()
    report: dict[str, Any] = {
        "vllm_source": str(root) if root is not None else None,
        "mode": "source tree (not imported)" if vllm_source is not None else "installed",
        "known_versions": fingerprints.known_versions(),
        "skip_fingerprints": envs.skip_fingerprints(), "disabled": envs.disabled(),
    }
    if root is None or not (root / "vllm").is_dir():
        report.update(vllm_version=None, supported=False, active=False, patches=[], known_bugs=[],
                      drafter_device=None, target_device=None,
                      reason=f"no vllm/ package under {root}" if root is not None else "vLLM is not installed")
        return report
    version = fingerprints.source_version(root)
    platform = _installed_platform() if vllm_source is None else {
        "platform": "not checked (source tree)", "on_cpu": None, "target_device": "not checked (source tree)"}
    patch_reports = []
    for name, patch in PATCHES.items():
        checks = fingerprints.check(root, patch.needs)
        applies = None if platform["on_cpu"] is None else (name not in CPU_ONLY or platform["on_cpu"])
        patch_reports.append({"name": name, "needs": list(patch.needs), "applies_here": applies,
                              "match": all(c.status == fingerprints.MATCH for c in checks),
                              "functions": [c.as_dict() for c in checks]})
    supported = all(p["match"] for p in patch_reports)
    runner_ok = next(p["match"] for p in patch_reports if p["name"] == "runner_hook")
    report.update(
        vllm_version=version, platform=platform["platform"], supported=supported,
        active=(runner_ok or report["skip_fingerprints"]) and not report["disabled"],
        patches=patch_reports,
        # the drafter runs where the target runs (drafter/select.py: llama.cpp on the CPU when installed
        # and the drafter has a GGUF, else transformers in the format measured fastest there)
        drafter_device=platform["target_device"], drafter_runtime=_default_runtime(platform["on_cpu"]),
        target_device=platform["target_device"],
        known_bugs=_known_bugs(platform["on_cpu"], version) if vllm_source is None else [],
    )
    return report


def _default_runtime(on_cpu: bool | None) -> str | None:
    """What usd.drafter_runtime = "auto" picks on this platform for a drafter folder with a GGUF."""
    if on_cpu is None:
        return None
    from vllm_usd.drafter.llama_cpp_runtime import llama_cpp_available
    from vllm_usd.drafter.select import AUTO_DTYPE

    if on_cpu and llama_cpp_available():
        return "llama.cpp for drafters with a GGUF, else transformers " + AUTO_DTYPE["cpu"]
    return "transformers " + AUTO_DTYPE["cpu" if on_cpu else "cuda"] + ("" if not on_cpu else " (llama-cpp-python not installed)")


def drafter_report(drafter: str, *, gguf: str | None = None, gguf_type: str = "auto",
                   runtime: str = "auto") -> dict[str, Any]:
    """How ``drafter`` runs on this host's CPU, as a worker would start it (the probe's cache included)."""
    from vllm_usd.drafter.llama_cpp_runtime import drafter_cpus
    from vllm_usd.drafter.loading import read_drafter
    from vllm_usd.drafter.hf_to_gguf import ConversionError
    from vllm_usd.drafter.select import choose, probe_verdict

    choice = choose(drafter, runtime=runtime, gguf=gguf, gguf_type=gguf_type, device="cpu")
    report: dict[str, Any] = {"drafter": drafter, "runtime": choice.runtime, "format": choice.dtype,
                              "gguf": choice.gguf, "probe": None}
    config, tokenizer = read_drafter(drafter)
    report["kv_bytes_per_token"] = _kv_bytes_per_token(config, choice)
    if choice.runtime != "llama_cpp":
        return report
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        run_gguf, run_type, verdict, timed = probe_verdict(choice, drafter, tokenizer=tokenizer,
                                                           vocab_size=int(text_config.vocab_size),
                                                           threads=len(drafter_cpus()))
    except ConversionError as exc:
        report.update(runtime="transformers", format="bfloat16", conversion=f"not converted for llama.cpp: {exc}",
                      kv_bytes_per_token=_kv_bytes_per_token(config, dataclasses.replace(
                          choice, runtime="transformers", dtype="bfloat16")))
        return report
    report.update(gguf=run_gguf, format="gguf" if run_type == "file" else f"gguf/{run_type}",
                  probe=verdict.as_dict(), probe_summary=verdict.summary(), types_timed=timed)
    if verdict.settings is None:
        report.update(runtime="transformers", format="bfloat16")
        report["kv_bytes_per_token"] = _kv_bytes_per_token(config, dataclasses.replace(choice, runtime="transformers",
                                                                                       dtype="bfloat16"))
    return report


def startup_report(target: str, drafter: str, k: int, max_num_seqs: int,
                   usd: dict[str, Any] | None = None) -> dict[str, Any]:
    """Start vLLM with ``target`` and ``drafter`` as the benchmarks do (float32, eager) and return what the
    proposer measured at start-up: its one line, and the controller's timings."""
    from vllm_usd.bench.vllm_systems import engine
    from vllm_usd.config import speculative_args
    from vllm_usd.vllm_adapter.debug import proposer_stats

    with engine(target, max_num_seqs, speculative_args(drafter=drafter, k=k, **(usd or {}))) as llm:
        stats = llm.collective_rpc(proposer_stats)[0] or {}
    return {"target": target, "k": k, "max_num_seqs": max_num_seqs, "line": stats.get("startup"),
            "startup_timings": (stats.get("controller") or {}).get("startup_timings")}


def _kv_bytes_per_token(config: Any, choice: Any) -> int:
    from vllm_usd.drafter.llama_cpp_runtime import KV_BYTES_PER_ELEMENT
    from vllm_usd.drafter.select import kv_bytes_per_token

    element = KV_BYTES_PER_ELEMENT if choice.runtime == "llama_cpp" else 2 if choice.dtype in ("bfloat16", "float16") else 4
    return kv_bytes_per_token(config, element)


def _memory_line(per_token: int) -> str:
    from vllm_usd.config import UsdConfig

    budget = UsdConfig(drafter="").drafter_kv_budget_gb
    return (f"  memory, allocated at start-up: KV cache {per_token / 1024:.1f} KiB per token, the most "
            f"drafter_kv_budget_gb={budget:g} holds is {int(budget * (1 << 30)) // per_token} tokens across requests "
            f"(less where max_num_seqs x the drafter's context needs less); q buffer max_num_seqs x k x target "
            f"vocabulary x 4 B (none when every request drafts greedily)")


def format_drafter(report: dict[str, Any]) -> str:
    lines = [f"drafter {report['drafter']}: {report['runtime']} ({report['format']})"
             + (f", GGUF {report['gguf']}" if report["runtime"] == "llama_cpp" else "")]
    if report.get("conversion"):
        lines.append(f"  {report['conversion']}")
    if len(report.get("types_timed") or {}) > 1:
        lines.append("  weight types timed at batch 1 here: " + ", ".join(
            f"{name} {ms:.1f} ms" if ms is not None else f"{name} failed the probe"
            for name, ms in report["types_timed"].items()))
    if report.get("kv_bytes_per_token"):
        lines.append(_memory_line(report["kv_bytes_per_token"]))
    probe = report.get("probe")
    if probe is None:
        return "\n".join(lines)
    for a in probe["attempts"]:
        measured = (f": top-1 agreement {a['top1']:.2f}, log-prob gap {a['logprob_gap']:.3f} nats over {a['rows']} rows"
                    if a.get("top1") is not None else "")
        lines.append(f"  probe: {a['settings']}: {a['outcome']}{measured}")
    lines.append(f"  reference: {probe['reference'] or 'none'}; verdict "
                 f"{'cached' if probe['cached'] else 'probed now in %.1f s' % probe['seconds']}: {probe['cache_file']}")
    return "\n".join(lines)


def format_report(report: dict[str, Any]) -> str:
    lines = [f"vLLM: {report['vllm_version'] or 'not found'} ({report['mode']}: {report['vllm_source']})"]
    if report.get("reason"):
        return "\n".join(lines + [f"vllm-usd: inactive ({report['reason']})"])
    for p in report["patches"]:
        bad = [f"{f['function']} {f['status']}" for f in p["functions"] if f["status"] != fingerprints.MATCH]
        every = set.intersection(*(set(f["matches_versions"]) for f in p["functions"]))
        state = ("REFUSED: " + "; ".join(bad) if bad else f"matches vLLM {', '.join(sorted(every))}" if every
                 else "matches, function by function: " + "; ".join(
                     f"{f['function']} as in {'/'.join(f['matches_versions'])}" for f in p["functions"]))
        where = "" if p["applies_here"] is not False else " (does not apply on this platform)"
        lines.append(f"patch {p['name']}: {state}{where}")
    known = ", ".join(report["known_versions"])
    if report["disabled"]:
        verdict = "inactive (VLLM_USD_DISABLE=1)"
    elif report["active"] and report["supported"]:
        verdict = f"active (every function matches a vLLM release it was checked against: {known})"
    elif report["active"]:
        verdict = ("active, but UNCHECKED (VLLM_USD_SKIP_FINGERPRINTS=1)" if report["skip_fingerprints"] else
                   "active, without the patches refused above")
    else:
        verdict = f"inactive: the runner hook's functions differ from vLLM {known}"
    lines.append(f"vllm-usd: {verdict}")
    lines.append(f"drafter device: {report['drafter_device']} ({report.get('drafter_runtime') or 'runtime not checked'}); "
                 f"target and rejection sampler: {report['target_device']}")
    bugs = report["known_bugs"]
    if report["mode"] != "installed":
        lines.append("known platform bugs: not checked for a source tree")
    elif not bugs:
        lines.append("known platform bugs: none that apply")
    for bug in bugs:
        lines.append(f"known bug {bug['name']}: {bug['detail']}; handled by {bug['handled_by']}")
    return "\n".join(lines)
