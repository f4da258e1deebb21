"""USD with the target sharded over two tensor-parallel ranks (vLLM CPU, tiny pair).

vLLM builds one proposer per rank, keeps rank 0's drafts, but every rank runs
the rejection sampler with its own q. So every rank must draft the same ids
with the same q, or the ranks' token histories silently diverge.

- Greedy output at TP=2 with USD equals TP=1 without it, with drafts accepted.
- Under sampling, both ranks record identical per-step digests of (drafts, q)
  (``usd.debug_digests``). A planted bug (``tests.faults.RankRngProposer``: drafting
  seeded with the rank) must make them differ, here and in test_proposer_lifecycle.
- A drafting failure on one rank (``tests.faults.FailOnRankOneProposer``) drops that step's
  drafts on every rank: the digests stay equal, every rank counts the step, and the
  engine's Prometheus counter shows it.
- The sampling-distribution test at TP=2, smaller sample: N = 6,000 two-token
  completions with and without USD, chi-square homogeneity, pass at p >= ALPHA
  = 1e-4 (false-alarm rate 0.01%, tests/stats.py). Its power against a wrong q
  is shown at N = 12,000 in test_engine_distribution_pair.

The two planted faults run in the TP=2 engine of the sound proposer, after its own checks
(``tests.faults.planted``); each is judged on the digests and counts of its own steps.
"""

from __future__ import annotations

import os

import pytest

from tests.engines import engine, spec_counts, token_ids
from tests.faults import FailOnRankOneProposer, RankRngProposer, SlowTargetProposer, planted
from tests.prompts import LOWERCASE
from tests.stats import ALPHA, homogeneity_pvalue

pytestmark = pytest.mark.engine

N_SAMPLES = 6_000
PROMPT = "it was"


def _bind_env() -> dict[str, str]:
    """One half of this process's CPUs per rank (vLLM's auto binding wants a NUMA node per rank)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.fail("tensor parallelism on CPU needs at least 2 CPUs for 2 ranks")
    half = len(cpus) // 2
    groups = [cpus[:half], cpus[half:2 * half]]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, g)) for g in groups)}


@pytest.fixture(scope="module")
def pair():
    from tests.fixtures import tiny

    return tiny.build_distribution_pair()


def _run(llm) -> dict:
    from vllm import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    out = {"greedy": token_ids(llm.generate(LOWERCASE, greedy, use_tqdm=False))}
    out["greedy_counts"] = spec_counts(llm)
    mixed = [SamplingParams(temperature=0.9, top_k=20, max_tokens=32, ignore_eos=True, seed=i) if i % 2
             else SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, ignore_eos=True)
             for i in range(len(LOWERCASE))]
    out["mixed"] = token_ids(llm.generate(LOWERCASE, mixed, use_tqdm=False))
    sp = SamplingParams(temperature=1.0, max_tokens=2)
    out["samples"] = [tuple(ids) for ids in token_ids(llm.generate([PROMPT] * N_SAMPLES, sp, use_tqdm=False))]
    return out


@pytest.fixture(scope="module")
def tp1_plain(pair):
    target, _ = pair
    with engine(target, max_num_seqs=256) as llm:
        return _run(llm)


@pytest.fixture(scope="module")
def tp2_usd(pair):
    from vllm import SamplingParams

    from vllm_usd.vllm_adapter.debug import draft_digests, proposer_stats
    from vllm_usd.vllm_adapter.failures import METRIC

    target, drafter = pair
    sampled = SamplingParams(temperature=1.0, max_tokens=16)
    with engine(target, drafter=drafter, k=3, max_num_seqs=256, tensor_parallel_size=2,
                distributed_executor_backend="mp", env=_bind_env(), usd={"debug_digests": True}) as llm:
        out = _run(llm)
        out["digests"] = llm.collective_rpc(draft_digests)
        out["stats"] = llm.collective_rpc(proposer_stats)
        seen = len(out["digests"][0])
        with planted(llm, FailOnRankOneProposer):
            greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
            out["failing_greedy"] = token_ids(llm.generate(LOWERCASE, greedy, use_tqdm=False))
            llm.generate([PROMPT] * 64, sampled, use_tqdm=False)
        digests = llm.collective_rpc(draft_digests)
        out["failing_digests"] = [d[seen:] for d in digests]
        out["failing_stats"] = llm.collective_rpc(proposer_stats)
        out["failing_metrics"] = {tuple(sorted(m.labels.items())): m.value for m in llm.get_metrics()
                                  if m.name == METRIC}
        seen = len(digests[0])
        with planted(llm, RankRngProposer):
            llm.generate([PROMPT] * 64, sampled, use_tqdm=False)
        out["rank_rng_digests"] = [d[seen:] for d in llm.collective_rpc(draft_digests)]
        return out


def test_greedy_at_tp2_equals_tp1_without_usd(tp1_plain, tp2_usd):
    assert tp2_usd["greedy"] == tp1_plain["greedy"]
    counts = tp2_usd["greedy_counts"]
    assert counts["drafts"] > 0 and counts["accepted"] > 0, counts


def test_every_rank_drafts_the_same_ids_with_the_same_q(tp2_usd):
    digests = tp2_usd["digests"]
    stats = tp2_usd["stats"]
    assert len(digests) == 2 and [s["rank"] for s in stats] == [0, 1]
    # one digest per drafting step, sampled steps (with q) included
    assert [len(d) for d in digests] == [s["counters"]["steps"] for s in stats] and stats[0]["counters"]["steps"] > 0
    assert stats[0]["q_buffer_bytes"] > 0, "no sampled step was drafted"
    diverged = next((i for i, (a, b) in enumerate(zip(*digests)) if a != b), min(map(len, digests)))
    assert digests[0] == digests[1], f"ranks diverged at drafting step {diverged}"


def test_drafter_is_replicated_on_every_rank(tp2_usd):
    stats = tp2_usd["stats"]
    assert stats[0]["drafter_param_bytes"] == stats[1]["drafter_param_bytes"] > 0
    assert [s["counters"].get("failed_steps", 0) for s in stats] == [0, 0]


def test_sampling_distribution_unchanged_at_tp2(tp1_plain, tp2_usd):
    p = homogeneity_pvalue(tp1_plain["samples"], tp2_usd["samples"])
    assert p >= ALPHA, f"USD at TP=2 changed the output distribution: p = {p:.2e}"


def test_digests_catch_rank_local_randomness_at_tp2(tp2_usd):
    """Planted bug: each rank seeds drafting with its own rank. The ranks' digests must differ."""
    rank0, rank1 = tp2_usd["rank_rng_digests"]
    assert rank0 and rank1 and rank0 != rank1


def test_the_controllers_lengths_are_rank_0s_on_every_rank(pair, tp1_plain):
    """The controller (the default) with the confidence stop on: only rank 0 times its drafter at
    start-up, each rank times its own target and cycles, but every rank takes rank 0's figures (the
    timings differ between ranks), and so chooses the same lengths, drafts and q. The target looks 20 ms
    slower, at start-up and while serving (SlowTargetProposer), so that drafting pays and the ranks have
    drafts to agree on. This engine drafts on the graph path (VLLM_USD_CPU_GRAPHS: the CPU stand-in for
    CUDA graphs, so at most 16 rows): every drafter forward a graph holds is a replay on both ranks, and
    the ranks' digests are equal there too."""
    from vllm import SamplingParams

    from vllm_usd.vllm_adapter.debug import draft_digests, proposer_stats

    target, drafter = pair
    from vllm_usd.vllm_adapter.failures import LENGTH_METRIC

    usd = {"debug_digests": True, "adaptive_length": True, "confidence_stop": 0.3}  # tests/engines pins it off
    greedy = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with engine(target, drafter=drafter, k=3, max_num_seqs=16, tensor_parallel_size=2,
                distributed_executor_backend="mp", env={**_bind_env(), "VLLM_USD_CPU_GRAPHS": "1"}, usd=usd,
                proposer=SlowTargetProposer) as llm:
        for prompt in LOWERCASE[:2]:
            llm.generate([prompt], greedy, use_tqdm=False)
        out = token_ids(llm.generate(LOWERCASE, greedy, use_tqdm=False))
        llm.generate([PROMPT] * 64, SamplingParams(temperature=1.0, max_tokens=16), use_tqdm=False)
        rank0, rank1 = llm.collective_rpc(draft_digests)
        stats = llm.collective_rpc(proposer_stats)
        gauge = {(m.labels["batch"], m.labels["rank"]): m.value for m in llm.get_metrics() if m.name == LENGTH_METRIC}
    assert out == tp1_plain["greedy"]
    controllers = [s["controller"] for s in stats]
    assert controllers[0]["lengths"], controllers[0]
    for rank in ("0", "1"):  # each rank's series are this engine's (earlier engines' workers left theirs too)
        assert {batch: n for (batch, r), n in gauge.items() if r == rank} == controllers[0]["lengths"], gauge
    assert controllers[0]["startup_timings"]["drafter"] and controllers[0]["cost_scale"], controllers[0]
    assert controllers[0] == controllers[1], controllers
    lengths = [{key: n for key, n in s["counters"].items() if key.startswith("length_")} for s in stats]
    assert lengths[0] == lengths[1] and any(n for key, n in lengths[0].items() if key != "length_0"), lengths
    assert rank0 and rank0 == rank1
    forwards = [s["drafter_forwards"] for s in stats]
    assert all(s["decode_graphs"] > 0 for s in stats) and all(f["replayed"] > 0 and f["eager"] == 0
                                                             for f in forwards), forwards


def test_a_drafting_failure_on_one_rank_drops_the_step_on_every_rank(tp1_plain, tp2_usd):
    """Planted: drafting raises on rank 1 every third drafting step. Every rank must drop that step's
    drafts (rank 0's drafts verified against rank 1's missing q would split the ranks' histories):
    equal, non-empty digests, the same failed steps counted on both ranks, greedy output unchanged,
    and the failures on vLLM's Prometheus metrics."""
    from vllm_usd.vllm_adapter.failures import PEER_FAILED

    rank0, rank1 = tp2_usd["failing_digests"]
    stats, metrics = tp2_usd["failing_stats"], tp2_usd["failing_metrics"]
    assert tp2_usd["failing_greedy"] == tp1_plain["greedy"]
    assert rank0 and rank0 == rank1, f"{len(rank0)} and {len(rank1)} drafting steps"
    failed = stats[1]["failures"].get("RuntimeError", 0)
    assert failed > 0 and stats[0]["failures"] == {PEER_FAILED: failed}, [s["failures"] for s in stats]
    assert stats[0]["counters"]["failed_steps"] == stats[1]["counters"]["failed_steps"] == failed
    assert metrics[(("rank", "1"), ("reason", "RuntimeError"))] >= failed
    assert metrics[(("rank", "0"), ("reason", PEER_FAILED))] >= failed
