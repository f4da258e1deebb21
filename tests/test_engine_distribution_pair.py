"""USD inside vLLM on the distribution pair (drafter agrees with the target often).

Greedy equality with real acceptance, the sampling-distribution test with its
planted-bug variants, mixed batches and seeded reproducibility.

Statistical test: N = 12,000 completions of 2 tokens from one prompt with and
without USD, joint distribution of the two tokens, chi-square test of
homogeneity (rare cells pooled). Pass at p >= ALPHA = 1e-4 (false-alarm rate
0.01% per setting, whatever N; tests/stats.py says why); each planted bug must
give p < 1e-6. N is sized by that power: in a run at 30,000 per side
(2026-12-04), 5 random subsamples of 10,000 per side gave every planted bug
p <= 1e-10 (q on the wrong ids: 5.6e-14 with fixed k, 4.9e-12 ragged, 2.4e-11
on llama.cpp, 1.1e-10 on the graph path; the other bugs 0), and 5,000 did not
(up to 9.6e-5 and 8.8e-4).

The prompt starts without a space, where the two tokenizers split words
differently and the drafter disagrees with the target more often: rejections
are where a wrong q shows. Handing *no* q for a sampled draft is not a bug:
vLLM then treats the draft as a point mass, which is lossless for any draft
that does not depend on the target's randomness; it only lowers acceptance
(checked below).

The planted bugs that change only what a step does run in the engine of the sound
proposer they are compared with (``tests.faults.planted``), after its own checks.
"""

from __future__ import annotations

import pytest

from tests.engines import engine, proposer_stats, spec_counts, token_ids
from tests.faults import (CrashWithExtraBuffersProbeProposer, NoCpuFixProposer, OmitQProposer, ScrambleQProposer,
                          StringWithQProposer, planted)
from tests.prompts import LOWERCASE
from tests.stats import ALPHA, homogeneity_pvalue

pytestmark = pytest.mark.engine

N_SAMPLES = 12_000
PROMPT = "it was"
SETTINGS = {"t1": dict(temperature=1.0), "t07p09": dict(temperature=0.7, top_p=0.9)}


@pytest.fixture(scope="module")
def pair():
    from tests.fixtures import tiny

    return tiny.build_distribution_pair()


def _greedy(llm, max_tokens: int = 64):
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return token_ids(llm.generate(LOWERCASE, sp, use_tqdm=False))


def _samples(llm, setting: str, n: int = N_SAMPLES) -> list[tuple[int, ...]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=2, **SETTINGS[setting])
    return [tuple(ids) for ids in token_ids(llm.generate([PROMPT] * n, sp, use_tqdm=False))]


def _samples_beside_greedy(llm, setting: str, n: int = N_SAMPLES) -> list[tuple[int, ...]]:
    """The sampled requests of batches that are half greedy: in draft_mode auto, the greedy rows draft
    text (no q) and the sampled rows TLI with q, in the same steps and the same q buffer."""
    from vllm import SamplingParams

    sampled = SamplingParams(max_tokens=2, **SETTINGS[setting])
    greedy = SamplingParams(temperature=0.0, max_tokens=2)
    outs = llm.generate([PROMPT] * (2 * n), [greedy if i % 2 else sampled for i in range(2 * n)], use_tqdm=False)
    return [tuple(ids) for ids in token_ids(outs[0::2])]


def _mixed(llm):
    from vllm import SamplingParams

    params = []
    for i, _ in enumerate(LOWERCASE):
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0.9, top_k=20, max_tokens=48, seed=1000 + i, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, ignore_eos=True))
    return token_ids(llm.generate(LOWERCASE, params, use_tqdm=False))


@pytest.fixture(scope="module")
def baseline(pair):
    target, _ = pair
    with engine(target, max_num_seqs=256) as llm:
        return {"greedy": _greedy(llm), "mixed": _mixed(llm),
                **{s: _samples(llm, s) for s in SETTINGS}}


@pytest.fixture(scope="module")
def usd_k3(pair):
    from vllm import SamplingParams

    target, drafter = pair
    with engine(target, drafter=drafter, k=3, max_num_seqs=256) as llm:
        greedy = _greedy(llm)
        after_greedy = spec_counts(llm)
        out = {"greedy": greedy, "greedy_counts": after_greedy, "mixed": _mixed(llm), "mixed_again": _mixed(llm)}
        before = spec_counts(llm)
        out["t1"] = _samples(llm, "t1")
        out["t1_counts"] = _delta(spec_counts(llm), before)
        out["t07p09"] = _samples(llm, "t07p09")
        out["t1_beside_greedy"] = _samples_beside_greedy(llm, "t1")
        out["stats_busy"] = proposer_stats(llm)
        # a one-token request makes vLLM run a step, which reports the finished ones
        llm.generate(["x"], SamplingParams(max_tokens=1), use_tqdm=False)
        out["stats_idle"] = proposer_stats(llm)
        for fault, setting in PLANTED:
            with planted(llm, fault):
                out[fault.__name__] = _samples(llm, setting)
        before = spec_counts(llm)
        with planted(llm, OmitQProposer):
            out["omit_q"] = _samples(llm, "t1")
        out["omit_q_counts"] = _delta(spec_counts(llm), before)
        return out


PLANTED = [(ScrambleQProposer, "t1"), (NoCpuFixProposer, "t07p09")]


def _assert_caught(expected: list, got: list, what: str) -> None:
    """The sampling test rejects a planted bug: p < 1e-6."""
    p = homogeneity_pvalue(expected, got)
    print(f"planted bug, {what}: p = {p:.2e}")
    assert p < 1e-6, f"planted bug not detected ({what}): p = {p:.2e}"


def _delta(after: dict, before: dict) -> dict:
    d = {key: after[key] - before[key] for key in ("drafts", "draft_tokens", "accepted")}
    d["acceptance_length"] = 1 + d["accepted"] / d["drafts"] if d["drafts"] else 1.0
    return d


def test_greedy_equal_k3_with_acceptance(baseline, usd_k3):
    assert usd_k3["greedy"] == baseline["greedy"]
    counts = usd_k3["greedy_counts"]
    assert counts["drafts"] > 0 and counts["accepted"] > 0
    # the drafter is the target's own network on another tokenizer: most drafts pass
    assert counts["acceptance_length"] > 2.0, counts


def test_greedy_equal_k5(pair, baseline):
    target, drafter = pair
    with engine(target, drafter=drafter, k=5) as llm:
        assert _greedy(llm) == baseline["greedy"]
        assert spec_counts(llm)["accepted"] > 0


def test_greedy_equal_reversed_pair_k1(pair):
    """SentencePiece-style target, byte-level BPE drafter, one draft a step (k = 3 and 5 run above)."""
    drafter, target = pair
    with engine(target) as llm:
        ref = _greedy(llm)
    with engine(target, drafter=drafter, k=1) as llm:
        assert _greedy(llm) == ref
        assert spec_counts(llm)["accepted"] > 0


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampling_distribution_unchanged(baseline, usd_k3, setting):
    p = homogeneity_pvalue(baseline[setting], usd_k3[setting])
    assert p >= ALPHA, f"USD changed the output distribution ({setting}): p = {p:.2e}"
    assert usd_k3["t1_counts"]["accepted"] > 0


def test_sampling_distribution_unchanged_beside_greedy_string_rows(baseline, usd_k3):
    """Same test (N = 12,000 sampled requests, pass at p >= ALPHA), each batch half greedy requests that
    draft text: their rows' stale q and missing drafts must not reach the sampled rows."""
    p = homogeneity_pvalue(baseline["t1"], usd_k3["t1_beside_greedy"])
    print(f"t1 beside greedy string rows: p = {p:.2e}")
    assert p >= ALPHA, f"mixed string/TLI batches changed the output distribution: p = {p:.2e}"
    assert usd_k3["stats_busy"]["counters"]["string_rows"] > 0


def test_drafter_state_is_freed_with_the_requests(usd_k3):
    busy, idle = usd_k3["stats_busy"], usd_k3["stats_idle"]
    assert busy["counters"]["steps"] > 0 and busy["counters"].get("failed_steps", 0) == 0
    assert idle["request_states"] == 0 and idle["drafter_requests"] == 0, idle


def test_mixed_batch(baseline, usd_k3):
    greedy_rows = range(0, len(LOWERCASE), 3)
    seeded_rows = range(1, len(LOWERCASE), 3)
    for i in greedy_rows:
        assert usd_k3["mixed"][i] == baseline["mixed"][i]
    for i in seeded_rows:
        assert usd_k3["mixed"][i] == usd_k3["mixed_again"][i], "seeded request did not reproduce"


@pytest.mark.parametrize("fault,setting", PLANTED, ids=["scramble_q", "no_cpu_fix"])
def test_planted_bug_is_caught(baseline, usd_k3, fault, setting):
    """The same test must reject USD with q on the wrong ids, or without the CPU sampler fix."""
    _assert_caught(baseline[setting], usd_k3[fault.__name__], fault.__name__)


def test_no_q_is_lossless_but_accepts_less(baseline, usd_k3):
    """Sampled drafts without q: point masses to vLLM. Same distribution, lower acceptance."""
    counts = usd_k3["omit_q_counts"]
    p = homogeneity_pvalue(baseline["t1"], usd_k3["omit_q"])
    assert p >= ALPHA, f"p = {p:.2e}"
    assert counts["acceptance_length"] < usd_k3["t1_counts"]["acceptance_length"], (counts, usd_k3["t1_counts"])


# -- ragged drafts: the confidence stop on ---------------------------------------------------------
# Each row's drafts end after the first the drafter gave under 30%: lengths 1..3 vary by row and
# step (k each step, so that every step drafts; the controller's own choices change lengths only,
# as the stop does).
ADAPTIVE = {"confidence_stop": 0.3}


@pytest.fixture(scope="module")
def usd_adaptive(pair):
    target, drafter = pair
    with engine(target, drafter=drafter, k=3, max_num_seqs=32, usd=ADAPTIVE) as llm:
        out = {"greedy": _greedy(llm), "greedy_counts": spec_counts(llm), "greedy_stats": proposer_stats(llm),
               "mixed": _mixed(llm)}
        for setting in SETTINGS:
            out[setting] = _samples(llm, setting)
        out["stats"] = proposer_stats(llm)
        with planted(llm, ScrambleQProposer):
            out["planted_scramble_q"] = _samples(llm, "t1")
        return out


def _lengths(stats: dict) -> dict[int, int]:
    return {int(key[len("length_"):]): n for key, n in stats["counters"].items() if key.startswith("length_")}


def test_adaptive_greedy_equal(baseline, usd_adaptive):
    assert usd_adaptive["greedy"] == baseline["greedy"]
    for i in range(0, len(LOWERCASE), 3):
        assert usd_adaptive["mixed"][i] == baseline["mixed"][i]
    counts, lengths = usd_adaptive["greedy_counts"], _lengths(usd_adaptive["greedy_stats"])
    assert counts["drafts"] > 0 and counts["accepted"] > 0, counts
    assert counts["draft_tokens"] < 3 * counts["drafts"], f"no draft was cut: {counts}"


def test_adaptive_counters_count_only_what_was_drafted(usd_adaptive):
    """vLLM's spec_decode counters see a row without drafts as no draft, and ragged drafts by their length."""
    counts, stats = usd_adaptive["greedy_counts"], usd_adaptive["greedy_stats"]
    lengths = _lengths(stats)
    handed_over = sum(n * c for n, c in lengths.items())
    assert 0 < counts["drafts"] <= stats["counters"]["drafted_rows"] == sum(c for n, c in lengths.items() if n)
    assert counts["draft_tokens"] <= handed_over
    if any(lengths.get(n) for n in (1, 2)):
        assert counts["draft_tokens"] < 3 * counts["drafts"], counts


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_adaptive_sampling_distribution_unchanged(baseline, usd_adaptive, setting):
    p = homogeneity_pvalue(baseline[setting], usd_adaptive[setting])
    assert p >= ALPHA, f"USD with ragged drafts changed the output distribution ({setting}): p = {p:.2e}"
    assert usd_adaptive["stats"]["counters"].get("confidence_cut_rows", 0) > 0, "the stop cut no sampled row's drafts"


def test_adaptive_planted_bug_is_caught(baseline, usd_adaptive):
    """Ragged drafts (the confidence stop) must not hide a wrong q: q on the wrong ids is still rejected."""
    _assert_caught(baseline["t1"], usd_adaptive["planted_scramble_q"], "ScrambleQProposer, ragged drafts")


@pytest.mark.parametrize("dtype", ["int8", "float32"])
def test_each_drafter_format_is_lossless(pair, baseline, dtype):
    """The drafter in int8 (and float32, beside the default bfloat16): greedy equal to the target alone,
    and the same sampling-distribution test (N = 12,000, pass at p >= ALPHA): q is the format's own."""
    target, drafter = pair
    with engine(target, drafter=drafter, k=3, max_num_seqs=256, usd={"drafter_dtype": dtype, "profile": True}) as llm:
        greedy = _greedy(llm)
        accepted = spec_counts(llm)["accepted"]
        samples = _samples(llm, "t1")
        stats = proposer_stats(llm)
    assert stats["drafter_dtype"] == dtype and stats["drafter_runtime"] == "transformers", stats
    assert greedy == baseline["greedy"] and accepted > 0
    p = homogeneity_pvalue(baseline["t1"], samples)
    print(f"drafter {dtype}: p = {p:.2e}")
    assert p >= ALPHA, f"USD with a {dtype} drafter changed the output distribution: p = {p:.2e}"


# -- the llama.cpp runtime, with each setting the native probe can leave it -------------------------
@pytest.fixture(scope="module")
def drafter_gguf(pair, tmp_path_factory):
    """The drafter as an F32 GGUF: llama.cpp computes what transformers does, up to float rounding."""
    from tests.fixtures.gguf_llama import write_llama_gguf

    return write_llama_gguf(pair[1], tmp_path_factory.mktemp("gguf") / "drafter-f32.gguf")


def _llama_cpp_usd(drafter_gguf: str) -> dict:
    return {"drafter_runtime": "llama_cpp", "drafter_gguf": drafter_gguf, "drafter_gguf_type": "file"}  # F32 as is


def _llama_cpp_run(llm) -> dict:
    return {"greedy": _greedy(llm), "accepted": spec_counts(llm)["accepted"], "t1": _samples(llm, "t1"),
            "stats": proposer_stats(llm)}


@pytest.fixture(scope="module")
def usd_llama_cpp(pair, drafter_gguf):
    """The llama.cpp drafter with the best kernels and their extra buffer types, then a wrong q planted."""
    target, drafter = pair
    with engine(target, drafter=drafter, k=3, max_num_seqs=256, usd=_llama_cpp_usd(drafter_gguf)) as llm:
        out = _llama_cpp_run(llm)
        with planted(llm, ScrambleQProposer):
            out["planted_scramble_q"] = _samples(llm, "t1")
        return out


@pytest.mark.parametrize("probe_crash", [False, True], ids=["best_kernels", "planted_crash_no_extra_buffers"])
def test_each_llama_cpp_setting_is_lossless(pair, baseline, drafter_gguf, probe_crash, request):
    """The drafter in llama.cpp as the native probe left it: the best kernels with their extra buffer types,
    or (a planted segfault with them) without. Greedy equal with drafts accepted, and the same
    sampling-distribution test (N = 12,000, pass at p >= ALPHA): q comes from the logits llama.cpp gave."""
    if probe_crash:
        target, drafter = pair
        with engine(target, drafter=drafter, k=3, max_num_seqs=256, usd=_llama_cpp_usd(drafter_gguf),
                    proposer=CrashWithExtraBuffersProbeProposer) as llm:
            run = _llama_cpp_run(llm)
    else:
        run = request.getfixturevalue("usd_llama_cpp")
    stats = run["stats"]
    assert stats["drafter_runtime"] == "llama_cpp" and stats["native_settings"]["extra_buffer_types"] is not probe_crash
    assert run["greedy"] == baseline["greedy"] and run["accepted"] > 0
    p = homogeneity_pvalue(baseline["t1"], run["t1"])
    print(f"llama.cpp drafter ({stats['drafter_probe']}): p = {p:.2e}")
    assert p >= ALPHA, f"USD with a llama.cpp drafter changed the output distribution: p = {p:.2e}"


def test_llama_cpp_planted_bug_is_caught(baseline, usd_llama_cpp):
    """The same test rejects q on the wrong ids with the llama.cpp runtime."""
    assert usd_llama_cpp["stats"]["drafter_runtime"] == "llama_cpp"
    _assert_caught(baseline["t1"], usd_llama_cpp["planted_scramble_q"], "ScrambleQProposer, llama.cpp drafter")


# -- usd.draft_mode = "string" on sampled requests --------------------------------------------------
@pytest.fixture(scope="module")
def usd_string(pair):
    target, drafter = pair
    with engine(target, drafter=drafter, k=3, max_num_seqs=256, usd={"draft_mode": "string"}) as llm:
        out = {"greedy": _greedy(llm), **{s: _samples(llm, s) for s in SETTINGS}, "counts": spec_counts(llm),
               "stats": proposer_stats(llm)}
        with planted(llm, StringWithQProposer):
            out["planted_string_with_q"] = _samples(llm, "t1")
        return out


def test_string_drafts_on_sampled_requests_are_lossless(baseline, usd_string):
    """String drafts carry no q, so vLLM verifies them as point masses: greedy equal, and the same
    sampling-distribution test (N = 12,000 per setting, pass at p >= ALPHA) on both settings."""
    stats, counts = usd_string["stats"], usd_string["counts"]
    assert usd_string["greedy"] == baseline["greedy"]
    assert stats["counters"]["string_rows"] > 0 and counts["accepted"] > 0, (stats["counters"], counts)
    for setting in SETTINGS:
        p = homogeneity_pvalue(baseline[setting], usd_string[setting])
        print(f"string drafts, {setting}: p = {p:.2e}")
        assert p >= ALPHA, f"string drafts changed the output distribution ({setting}): p = {p:.2e}"


def test_string_planted_bug_is_caught(baseline, usd_string):
    """The same test rejects string drafts handed with a q they were not drawn from."""
    _assert_caught(baseline["t1"], usd_string["planted_string_with_q"], "StringWithQProposer")


# -- the graph path: decode steps replayed from graphs captured at start-up ---------------------------
# VLLM_USD_CPU_GRAPHS=1: the CPU stand-in for CUDA graphs (drafter/graph_double.py), as strict as one,
# captured for every (tokens per row: 1 and k + 1, batch bucket, table width) when the drafter takes its
# memory: draft positions and the catch-ups after verification replay; only prompts run eagerly. Each capture keeps
# what it made (no shared pool), so the engine drafts for at most 16 rows. The same test (N_SAMPLES per
# side, pass at p >= ALPHA), and the planted bug must give p < 1e-6 there too.


@pytest.fixture(scope="module")
def usd_graphs(pair):
    target, drafter = pair
    with engine(target, drafter=drafter, k=3, max_num_seqs=16, usd={"draft_mode": "tli"},
                env={"VLLM_USD_CPU_GRAPHS": "1"}) as llm:
        out = {"greedy": _greedy(llm), "t1": _samples(llm, "t1"), "counts": spec_counts(llm),
               "stats": proposer_stats(llm)}
        with planted(llm, ScrambleQProposer):
            out["planted_scramble_q"] = _samples(llm, "t1")
        return out


def test_the_graph_path_is_lossless_and_decodes_by_replay_only(baseline, usd_graphs):
    stats, counts = usd_graphs["stats"], usd_graphs["counts"]
    forwards = stats["drafter_forwards"]  # draft positions and catch-ups after verification alike
    assert stats["decode_graphs"] > 0 and forwards["replayed"] > 0, forwards
    assert forwards["eager"] == 0, f"a drafter forward a graph holds ran eagerly beside the graphs: {forwards}"
    assert usd_graphs["greedy"] == baseline["greedy"] and counts["accepted"] > 0, counts
    p = homogeneity_pvalue(baseline["t1"], usd_graphs["t1"])
    print(f"graph path: p = {p:.2e}")
    assert p >= ALPHA, f"the graph path changed the output distribution: p = {p:.2e}"


def test_graph_path_planted_bug_is_caught(baseline, usd_graphs):
    _assert_caught(baseline["t1"], usd_graphs["planted_scramble_q"], "ScrambleQProposer, graph path")
