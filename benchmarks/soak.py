"""Served soak: vLLM's OpenAI server with USD under concurrent streaming load, with aborts.

    .venv/bin/python benchmarks/soak.py --minutes 30 --out soak.json

1. Greedy reference: the target alone, offline (``LLM``), on the greedy request set (or
   ``--reference FILE``: the same, computed earlier, a JSON list of token-id lists).
2. ``vllm-usd serve`` on 127.0.0.1 (a free port), USD on, the real pair by default
   (target Gemma-3-270m, drafter SmolLM2-135M-Instruct), with vllm-usd's worker
   extension so the proposer's state can be read through ``/collective_rpc``.
3. ``--streams`` concurrent streaming clients for ``--minutes``: greedy and sampled,
   short and long, ``--abort-rate`` of the requests dropped mid-stream.
4. Checks, each reported in the JSON and, when failed, in the exit status:
   - no 5xx responses and no transport errors;
   - ``/health`` answers 200 at the end;
   - every completed greedy request equals the offline reference token for token;
   - the drafter holds no request state once the load stops;
   - resident memory of the server's process tree is flat past warm-up: the median
     of the last quarter of samples is within ``max(64 MiB, 3%)`` of the median of the
     first quarter after warm-up (the first quarter of the run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GREEDY_PROMPTS = [
    "The capital of France is", "Water boils at a temperature of", "Once upon a time, in a small village,",
    "def add(a, b):\n    return", "The largest planet in the solar system is", "To bake bread, you need",
    "import numpy as np\n\nx = np.", "In 1969, the first person to walk on the moon was",
    "SELECT name FROM users WHERE", "Dear Sir or Madam,\n\nI am writing to", "Ingredients for pancakes:\n-",
    "for i in range(10):\n   ", "Q: What is 12 times 12?\nA:", "café, naïve, façade:", "東京は",
    "The Pythagorean theorem states that",
]
LONG_CONTEXT = ("The history of the printing press begins in the fifteenth century, when movable type "
                "changed how books were made, sold and read across Europe. ") * 6
SAMPLED_PROMPTS = ["Write a short poem about the sea.", "List three uses of copper:", "My favourite season is",
                   "Explain recursion to a child:", LONG_CONTEXT + "In summary,"]
SHORT, LONG = 16, 64


def greedy_requests() -> list[dict[str, Any]]:
    """The fixed greedy set: (prompt, max_tokens), short and long, one with a long context."""
    reqs = []
    for i, prompt in enumerate(GREEDY_PROMPTS):
        reqs.append({"prompt": prompt, "max_tokens": LONG if i % 3 == 0 else SHORT})
    reqs.append({"prompt": LONG_CONTEXT + "The first printed books were", "max_tokens": SHORT})
    return reqs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_reference(target: str, reqs: list[dict[str, Any]], max_model_len: int) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    from vllm_usd.vllm_adapter.compat import shutdown_engine

    llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=max_model_len, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in reqs]
    out = [list(o.outputs[0].token_ids) for o in llm.generate([r["prompt"] for r in reqs], params, use_tqdm=False)]
    shutdown_engine(llm)
    del llm
    return out


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


async def _one_request(client, base: str, model: str, body: dict[str, Any], abort_after: int | None,
                       stats: dict[str, Any]) -> tuple[str, list[int] | None]:
    """Streams one completion. Returns (outcome, token ids or None)."""
    ids: list[int] = []
    chunks = 0
    try:
        async with client.stream("POST", f"{base}/v1/completions", json={"model": model, **body}) as resp:
            if resp.status_code >= 500:
                stats["5xx"] += 1
                stats["errors"].append(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
                return "5xx", None
            if resp.status_code != 200:
                stats["4xx"] += 1
                stats["errors"].append(f"{resp.status_code}: {(await resp.aread())[:300]!r}")
                return "4xx", None
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                ids.extend(choice.get("token_ids") or [])
                chunks += 1
                # drop the stream mid-way: only while the server is still generating
                if abort_after is not None and chunks >= abort_after and choice.get("finish_reason") is None:
                    return "aborted", None  # leaving the block closes the stream: the server aborts
    except Exception as exc:  # noqa: BLE001 - a transport error is a finding, not a crash
        stats["transport_errors"] += 1
        cause = exc.__cause__ or exc.__context__
        stats["errors"].append(f"{type(exc).__name__}: {exc!r} (cause {cause!r}) after {chunks} chunks, "
                               f"{'greedy' if body.get('temperature') == 0.0 else 'sampled'}, "
                               f"max_tokens {body.get('max_tokens')}")
        return "transport_error", None
    return "done", ids


async def drive(base: str, model: str, reqs: list[dict[str, Any]], reference: list[list[int]], seconds: float,
                streams: int, abort_rate: float, server_pid: int, seed: int) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    stats: dict[str, Any] = {"served": 0, "aborted": 0, "greedy_checked": 0, "greedy_mismatch": 0,
                             "sampled": 0, "5xx": 0, "4xx": 0, "transport_errors": 0, "errors": [],
                             "mismatches": []}
    memory: list[tuple[float, int]] = []
    start = time.monotonic()
    deadline = start + seconds

    async def sample_memory() -> None:
        while time.monotonic() < deadline:
            memory.append((time.monotonic() - start, _tree_rss(server_pid)))
            await asyncio.sleep(2.0)

    async def worker(w: int) -> None:
        # One connection per request. A CI run (2 min, ~110 requests) saw one empty
        # httpx.ReadError while /health, every other stream and the engine were fine; the usual
        # cause of that is a kept-alive connection closed by the server as the client reuses it.
        # Fresh connections take that out, and the error now says how far its stream got.
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
            while time.monotonic() < deadline:
                abort_after = rng.randint(1, 6) if rng.random() < abort_rate else None
                if rng.random() < 0.5:
                    i = rng.randrange(len(reqs))
                    body = {**reqs[i], "temperature": 0.0, "ignore_eos": True, "stream": True,
                            "return_token_ids": True}
                    outcome, ids = await _one_request(client, base, model, body, abort_after, stats)
                    if outcome == "done":
                        stats["greedy_checked"] += 1
                        if ids != reference[i]:
                            stats["greedy_mismatch"] += 1
                            stats["mismatches"].append({"request": i, "got": ids, "want": reference[i]})
                else:
                    body = {"prompt": rng.choice(SAMPLED_PROMPTS), "max_tokens": rng.choice((SHORT, LONG)),
                            "temperature": rng.choice((0.7, 1.0)), "top_p": rng.choice((0.9, 1.0)),
                            "stream": True, "return_token_ids": True}
                    outcome, _ = await _one_request(client, base, model, body, abort_after, stats)
                    stats["sampled"] += outcome == "done"
                stats["served"] += outcome == "done"
                stats["aborted"] += outcome == "aborted"

    await asyncio.gather(sample_memory(), *(worker(w) for w in range(streams)))
    stats["memory"] = memory
    stats["errors"] = stats["errors"][:20]
    stats["mismatches"] = stats["mismatches"][:5]
    return stats


def memory_verdict(memory: list[tuple[float, int]], seconds: float) -> dict[str, Any]:
    warm = [rss for t, rss in memory if t >= seconds / 4]
    if len(warm) < 8:
        return {"ok": False, "why": f"only {len(warm)} memory samples past warm-up"}
    q = len(warm) // 4
    first, last = statistics.median(warm[:q]), statistics.median(warm[-q:])
    allowed = max(64 << 20, 0.03 * first)
    return {"ok": last - first <= allowed, "first_quarter_mib": first / 2**20, "last_quarter_mib": last / 2**20,
            "growth_mib": (last - first) / 2**20, "allowed_mib": allowed / 2**20,
            "start_mib": memory[0][1] / 2**20, "end_mib": memory[-1][1] / 2**20}


def _spec_counters(metrics_text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
                     "vllm:spec_decode_num_draft_tokens_total"):
            if line.startswith(name):
                out[name] = out.get(name, 0.0) + float(line.split()[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--abort-rate", type=float, default=0.1)
    parser.add_argument("--target", help="target model folder (default: the real pair's Gemma-3-270m)")
    parser.add_argument("--drafter", help="drafter folder (default: the real pair's SmolLM2-135M-Instruct)")
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--usd", action="append", default=[], metavar="KEY=VALUE",
                        help="a usd setting for the server (repeatable), as `vllm-usd serve --usd` takes it")
    parser.add_argument("--out", type=Path, default=Path("soak.json"))
    parser.add_argument("--reference", type=Path, help="the target alone's greedy token ids for the greedy "
                        "request set (JSON list of lists), instead of computing them here")
    args = parser.parse_args(argv)

    if args.target is None or args.drafter is None:
        from vllm_usd.demo_pair import ensure_real_pair

        pair = ensure_real_pair()
        args.target = args.target or pair["gemma3"]
        args.drafter = args.drafter or pair["smollm2"]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    reqs = greedy_requests()
    t0 = time.time()
    if args.reference is not None:
        reference = json.loads(args.reference.read_text())
        if len(reference) != len(reqs):
            raise SystemExit(f"soak: {args.reference} has {len(reference)} references for {len(reqs)} requests")
    else:
        reference = offline_reference(args.target, reqs, args.max_model_len)
    print(f"soak: offline reference for {len(reqs)} greedy requests in {time.time() - t0:.0f}s", flush=True)

    import requests

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = args.out.with_suffix(".server.log")
    log = open(log_path, "w")
    cmd = [sys.executable, "-m", "vllm_usd.cli", "serve", args.target, "--drafter", args.drafter, "-k", str(args.k),
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.streams), "--seed", "0",
           "--worker-extension-cls", "vllm_usd.vllm_adapter.debug.ProposerStatsExtension"]
    for setting in args.usd:
        cmd += ["--usd", setting]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    report: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]), "settings": vars(args) | {
        "out": str(args.out)}, "server_command": cmd}
    try:
        deadline = time.time() + 600
        while True:
            if server.poll() is not None:
                raise RuntimeError("server exited during start-up; see " + str(log_path))
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.time() > deadline:
                raise RuntimeError("server did not become healthy in 600 s")
            time.sleep(2)
        print(f"soak: server up on {base}; {args.streams} streams for {args.minutes} min", flush=True)
        seconds = args.minutes * 60
        stats = asyncio.run(drive(base, args.target, reqs, reference, seconds, args.streams, args.abort_rate,
                                  server.pid, args.seed))
        time.sleep(1.0)
        # one more request makes the engine run a step, which reports the finished and aborted ones
        requests.post(f"{base}/v1/completions", json={"model": args.target, "prompt": "Hi", "max_tokens": 1},
                      timeout=120)
        health = requests.get(f"{base}/health", timeout=10).status_code
        rpc = requests.post(f"{base}/collective_rpc", json={"method": "usd_proposer_stats"}, timeout=60)
        proposer = rpc.json()["results"][0] if rpc.status_code == 200 else {"error": rpc.text[:300]}
        counters = _spec_counters(requests.get(f"{base}/metrics", timeout=10).text)
        drafts = counters.get("vllm:spec_decode_num_drafts_total", 0.0)
        accepted = counters.get("vllm:spec_decode_num_accepted_tokens_total", 0.0)
        memory = memory_verdict(stats["memory"], seconds)
        checks = {
            "no_5xx": stats["5xx"] == 0,
            "no_transport_errors": stats["transport_errors"] == 0,
            "healthy_at_end": health == 200,
            "greedy_equal_reference": stats["greedy_checked"] > 0 and stats["greedy_mismatch"] == 0,
            "drafter_state_zero": isinstance(proposer, dict) and proposer.get("request_states") == 0
            and proposer.get("drafter_requests") == 0,
            "memory_flat": memory["ok"],
            "aborts_happened": args.abort_rate == 0 or stats["aborted"] > 0,
            "no_4xx": stats["4xx"] == 0,
        }
        report.update(stats=stats, health=health, proposer=proposer, memory_verdict=memory,
                      acceptance_length=1 + accepted / drafts if drafts else None, spec_counters=counters,
                      checks=checks, ok=all(checks.values()))
    except Exception as exc:  # noqa: BLE001
        report.update(ok=False, failure=f"{type(exc).__name__}: {exc}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
        log.close()
    args.out.write_text(json.dumps(report, indent=1, default=str))
    summary = {k: report.get(k) for k in ("ok", "checks", "acceptance_length", "memory_verdict", "failure")}
    summary["served"] = report.get("stats", {}).get("served")
    summary["aborted"] = report.get("stats", {}).get("aborted")
    print(json.dumps(summary, indent=1, default=str))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
