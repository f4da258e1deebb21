"""vllm_adapter: the fingerprint guard, the CPU sampler fix, the runner hook, register().

Fingerprints against altered source trees: tests/test_fingerprints.py."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest
import torch

from vllm_usd.vllm_adapter import compat, fingerprints, patches


def test_the_guard_is_fingerprints_not_the_version_string(monkeypatch):
    """A version string vllm-usd never saw does not matter when the functions match, and vice versa."""
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.40.0")
    monkeypatch.setattr(patches, "_applied", set())
    monkeypatch.setitem(patches.PATCHES, "runner_hook", patches.Patch(lambda: True, patches.PATCHES["runner_hook"].needs))
    assert patches.apply(["runner_hook"]) == {"runner_hook"}
    monkeypatch.setattr(patches, "_applied", set())
    table = {v: {**fps, "GPUModelRunner.propose_draft_token_ids": "0" * 16} for v, fps in fingerprints.known().items()}
    monkeypatch.setattr(fingerprints, "known", lambda: table)
    with pytest.raises(compat.UnsupportedVllmVersion,
                       match=r"patch runner_hook \(vLLM 0\.32\.0\) not applied: vLLM's "
                             r"GPUModelRunner\.propose_draft_token_ids .* changed.*known to work \(0\.32\.0, 0\.33\.0\)"):
        patches.apply(["runner_hook"])
    assert patches.applied() == frozenset()


def test_register_never_raises_and_is_reentrant(monkeypatch, caplog):
    from vllm_usd.vllm_adapter import plugin

    def boom():
        raise RuntimeError("boom")

    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(patches, "_applied", set())  # as in a fresh process
    monkeypatch.setattr(fingerprints, "installed_root", lambda: None)  # no vLLM to be found
    plugin.register()  # warns, does nothing
    plugin.register()
    assert patches.applied() == frozenset()
    monkeypatch.undo()  # vLLM is back
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(patches, "_applied", set())
    monkeypatch.setitem(patches.PATCHES, "runner_hook", patches.Patch(boom, patches.PATCHES["runner_hook"].needs))
    monkeypatch.setitem(patches.PATCHES, "frontend_check", patches.Patch(lambda: True, ()))
    with caplog.at_level(logging.WARNING, logger="vllm.usd"):
        plugin.register()  # a failing patch is logged, not raised
    assert any("registration skipped: boom" in r.getMessage() for r in caplog.records)


def test_entry_point_is_declared():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "vllm_usd" and ep.value == "vllm_usd.vllm_adapter.plugin:register" for ep in eps)


def _registered_cpu_kernels():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the expand bug is specific to vLLM's CPU kernels")
    current_platform.register_triton_kernel_overrides()  # what vLLM's CPU worker does


def test_cpu_expand_bug_exists_and_the_fix_repairs_it():
    _registered_cpu_kernels()
    from vllm.v1.sample import rejection_sampler as rs

    assert patches.cpu_expand_is_broken(), "vLLM's CPU expand now works: the fix can be retired"
    x = torch.tensor([0.25, 0.5, 0.75])
    cu = torch.tensor([2, 3, 5], dtype=torch.int32)
    original = rs.expand_batch_to_tokens
    try:
        assert patches.install_cpu_expand_fix()
        assert patches.install_cpu_expand_fix()  # idempotent
        assert torch.equal(rs.expand_batch_to_tokens(x, cu, 5), torch.tensor([0.25, 0.25, 0.5, 0.75, 0.75]))
        ints = torch.tensor([3, -1, 7])
        assert rs.expand_batch_to_tokens(ints, cu, 5, replace_from=-1, replace_to=9).tolist() == [3, 3, 9, 7, 7]
        k = torch.tensor([5, 0, 2], dtype=torch.int32)
        assert rs.expand_batch_to_tokens(k, cu, 5).tolist() == [5, 5, 0, 2, 2]
    finally:
        rs.expand_batch_to_tokens = original
        patches._applied.discard("cpu_expand_fix")


def test_runner_hook_hands_q_to_the_runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patches.install_runner_hook()
    patches.install_runner_hook()
    wrapped = GPUModelRunner.propose_draft_token_ids
    assert hasattr(wrapped, "__vllm_usd_wrapped__")

    class FakeProposer:
        is_vllm_usd_proposer = True
        bound = None

        def bind_step(self, runner, scheduler_output):
            self.bound = (runner, scheduler_output)

        def take_last_draft_probs(self):
            return torch.ones(2, 3, 4)

    class FakeBatch:
        req_ids = ["a", "b"]

    class FakeRunner:
        drafter = FakeProposer()
        input_batch = FakeBatch()

    runner = FakeRunner()
    calls = []
    original = wrapped.__vllm_usd_wrapped__
    try:
        wrapped.__vllm_usd_wrapped__ = None
        hook = patches._wrap_propose(lambda self, so, *a, **k: calls.append(so) or [[1], [2]])
        out = hook(runner, "sched")
    finally:
        wrapped.__vllm_usd_wrapped__ = original
    assert out == [[1], [2]] and calls == ["sched"]
    assert runner.drafter.bound == (runner, "sched")
    assert runner._draft_probs.shape == (2, 3, 4) and runner._draft_prob_req_ids == ["a", "b"]

    class OtherRunner:
        drafter = object()

    other = OtherRunner()
    hook(other, "s")
    assert not hasattr(other, "_draft_probs"), "other proposers must be left alone"


def test_runner_hook_moves_q_to_the_runners_device():
    """The drafter runs on the CPU; on a GPU runner q must reach the sampler on the runner's device."""

    class FakeProposer:
        is_vllm_usd_proposer = True

        def bind_step(self, runner, scheduler_output):
            pass

        def take_last_draft_probs(self):
            return torch.ones(2, 3, 4)

    class Runner:
        drafter = FakeProposer()
        input_batch = type("B", (), {"req_ids": ["a", "b"]})()
        device = torch.device("meta")  # stands in for cuda:0 on a CPU-only machine

    runner = Runner()
    patches._wrap_propose(lambda self, so: [[1], [2]])(runner, "sched")
    assert runner._draft_probs.device.type == "meta" and runner._draft_probs.shape == (2, 3, 4)


def test_cpu_rejection_sampler_survives_a_step_without_drafts():
    """vLLM's CPU top-k path fails on a step where no request has drafts (adaptive lengths choose that often)."""
    _registered_cpu_kernels()
    from vllm.v1.sample import rejection_sampler as rs
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    empty = torch.empty(0, 32)  # [num_draft_tokens = 0, vocab]
    with pytest.raises(RuntimeError):
        apply_top_k_top_p(empty.clone(), torch.empty(0, dtype=torch.long), None)
    assert patches.install_cpu_empty_topk_fix() and patches.install_cpu_empty_topk_fix()  # idempotent
    assert rs.apply_top_k_top_p(empty, torch.empty(0, dtype=torch.long), None).shape == (0, 32)
    logits = torch.arange(8.0).repeat(2, 1)
    masked = rs.apply_top_k_top_p(logits, torch.tensor([2, 3]), None)
    assert torch.isinf(masked[0]).sum() == 6 and torch.isinf(masked[1]).sum() == 5, "non-empty input as before"


def test_recovered_noise_is_drawn_only_for_requests_with_drafts(monkeypatch):
    """cpu_drafted_rows_recovery: requests without drafts draw no noise, and drafted requests with their own
    seed get the recovered tokens vLLM's own function gives them (drawn from their generators alike)."""
    import dataclasses

    _registered_cpu_kernels()
    from vllm.v1.sample import rejection_sampler as rs

    original = getattr(rs.sample_recovered_tokens, "__vllm_usd_wrapped__", rs.sample_recovered_tokens)
    kernel = rs._sample_recovered_tokens
    noise_rows: list[int] = []

    def spy(*args, **kwargs):
        noise_rows.append(args[5].shape[0])  # inv_q: [requests drawn for, vocab]
        return kernel(*args, **kwargs)

    monkeypatch.setattr(rs, "_sample_recovered_tokens", spy)
    wrapped = patches._wrap_sample_recovered_tokens(original)

    @dataclasses.dataclass
    class Metadata:  # the one field both read
        generators: dict

    vocab = 64
    drafts = [2, 0, 3, 0, 1]  # per request
    cu = torch.tensor(drafts).cumsum(0).to(torch.int32)
    n = sum(drafts)
    torch.manual_seed(0)
    draft_ids = torch.randint(0, vocab, (n,), dtype=torch.int32)
    target_probs = torch.rand(n, vocab).softmax(-1)
    for draft_probs, fp64 in ((torch.rand(n, vocab).softmax(-1), False), (None, False), (None, True)):
        def run(fn):
            gens = {i: torch.Generator().manual_seed(100 + i) for i in range(len(drafts))}
            return fn(3, drafts, cu, draft_ids, draft_probs, target_probs, Metadata(gens), torch.device("cpu"),
                      use_fp64_gumbel=fp64)

        want, got = run(original), run(wrapped)
        assert torch.equal(got, want), (got, want, fp64)
    assert noise_rows == [5, 3] * 3, "vLLM's noise for all 5 requests, the patch's for the 3 drafted ones"
    # a step without drafts samples nothing
    none = wrapped(3, [0, 0], torch.zeros(2, dtype=torch.int32), torch.empty(0, dtype=torch.int32), None,
                   torch.empty(0, vocab), Metadata({}), torch.device("cpu"))
    assert none.shape == (0,) and noise_rows == [5, 3] * 3
    monkeypatch.undo()
    assert patches.install_cpu_drafted_rows_recovery() and patches.install_cpu_drafted_rows_recovery()
    assert rs.sample_recovered_tokens.__vllm_usd_wrapped__ is original


def test_recovered_tokens_follow_the_residual_distribution(monkeypatch):
    """cpu_drafted_rows_recovery draws its own noise for unseeded requests: a recovered token must follow
    max(p - q, 0), normalised (without q: p less the draft token). 20,000 draws over 8 tokens per case,
    a chi-square goodness-of-fit test passing at p >= ALPHA = 1e-4 (false-alarm rate 0.01% per case). A
    planted bug, noise E^2 in place of E ~ Exp(1), must fail it."""
    from scipy.stats import chisquare

    from tests.stats import ALPHA

    _registered_cpu_kernels()
    from vllm.v1.sample import rejection_sampler as rs

    original = getattr(rs.sample_recovered_tokens, "__vllm_usd_wrapped__", rs.sample_recovered_tokens)
    wrapped = patches._wrap_sample_recovered_tokens(original)
    p = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
    q = torch.tensor([0.05, 0.30, 0.10, 0.20, 0.05, 0.10, 0.15, 0.05])
    draft = 1
    cases = {"with q": (q, (p - q).clamp(min=0)), "without q": (None, p.clone().index_fill_(0, torch.tensor(draft), 0))}

    class Metadata:
        generators: dict = {}

    def pvalue(draft_probs, residual, draws=20_000, per_call=4_000):
        counts = torch.zeros(8)
        for _ in range(draws // per_call):  # per_call requests of one draft each
            ids = torch.full((per_call,), draft, dtype=torch.int32)
            qs = None if draft_probs is None else draft_probs.expand(per_call, 8).contiguous()
            got = wrapped(1, [1] * per_call, torch.arange(1, per_call + 1, dtype=torch.int32), ids, qs,
                          p.expand(per_call, 8).contiguous(), Metadata(), torch.device("cpu"))
            counts += torch.bincount(got.long(), minlength=8).float()
        expected = residual / residual.sum() * counts.sum()
        assert counts[expected == 0].sum() == 0, "drew a token with no residual mass"
        return chisquare(counts[expected > 0].numpy(), expected[expected > 0].numpy()).pvalue

    for name, (draft_probs, residual) in cases.items():
        assert pvalue(draft_probs, residual) >= ALPHA, name
    kernel = rs._sample_recovered_tokens
    monkeypatch.setattr(rs, "_sample_recovered_tokens",
                        lambda out, cu, ids, dp, tp, inv_q, **kw: kernel(out, cu, ids, dp, tp, inv_q.square(), **kw))
    assert all(pvalue(*case) < ALPHA for case in cases.values()), "the planted bug went unseen"


def _sampling_metadata(batch: int, vocab: int, greedy_rows: set[int]):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    temperature = torch.tensor([0.0 if i in greedy_rows else 0.8 for i in range(batch)])
    return SamplingMetadata(
        temperature=temperature, all_greedy=len(greedy_rows) == batch, all_random=not greedy_rows,
        top_p=None, top_k=None,
        generators={i: torch.Generator().manual_seed(7 + i) for i in range(batch) if i not in greedy_rows},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def test_a_step_without_drafts_samples_as_vllm_does_without_speculation():
    """no_draft_plain_sampling: a step in which no request has a draft goes to vLLM's plain sampler and
    samples what the rejection sampler samples there (the sampled rows seeded, so both draw alike); a
    step with a draft keeps the rejection sampler; so does a runner whose drafter is not vllm-usd's."""
    import types

    _registered_cpu_kernels()
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = getattr(GPUModelRunner._sample, "__vllm_usd_wrapped__", GPUModelRunner._sample)
    calls: list[str] = []

    class SpySampler(Sampler):
        def forward(self, *args, **kwargs):
            calls.append("plain" if not kwargs.get("predict_bonus_token") else "bonus")
            return super().forward(*args, **kwargs)

    def runner(batch: int, ours: bool):
        sampler = SpySampler()
        return types.SimpleNamespace(
            sampler=sampler, rejection_sampler=RejectionSampler(sampler), use_async_scheduling=False,
            input_batch=types.SimpleNamespace(sampling_metadata=_sampling_metadata(batch, 50, {0, 2}),
                                              update_async_output_token_ids=lambda: None),
            drafter=types.SimpleNamespace(is_vllm_usd_proposer=ours),
            _get_spec_decode_draft_probs=lambda metadata: None)

    def no_drafts(batch: int) -> SpecDecodeMetadata:
        return SpecDecodeMetadata(
            draft_token_ids=torch.empty(0, dtype=torch.int32), num_draft_tokens=[0] * batch,
            cu_num_draft_tokens=torch.zeros(batch, dtype=torch.int32),
            cu_num_sampled_tokens=torch.arange(1, batch + 1, dtype=torch.int32),
            target_logits_indices=torch.empty(0, dtype=torch.long),
            bonus_logits_indices=torch.arange(batch), logits_indices=torch.arange(batch))

    wrapped = patches._wrap_sample(original)
    torch.manual_seed(0)
    batch, vocab = 5, 50
    logits = torch.randn(batch, vocab) * 3
    want = original(runner(batch, True), logits.clone(), no_drafts(batch)).sampled_token_ids
    assert calls == ["bonus"]
    calls.clear()
    got = wrapped(runner(batch, True), logits.clone(), no_drafts(batch)).sampled_token_ids
    assert calls == ["plain"], "the step without drafts went to the rejection sampler"
    assert got.shape == want.shape == (batch, 1) and torch.equal(got.long(), want.long()), (got, want)
    assert got[0, 0] == logits[0].argmax() and got[2, 0] == logits[2].argmax()
    calls.clear()
    wrapped(runner(batch, False), logits.clone(), no_drafts(batch))
    assert calls == ["bonus"], "a runner with another drafter keeps vLLM's path"
    # one request with a draft: the rejection sampler
    drafted = SpecDecodeMetadata(
        draft_token_ids=torch.tensor([3], dtype=torch.int32), num_draft_tokens=[1] + [0] * (batch - 1),
        cu_num_draft_tokens=torch.ones(batch, dtype=torch.int32),
        cu_num_sampled_tokens=torch.arange(2, batch + 2, dtype=torch.int32),
        target_logits_indices=torch.tensor([0]), bonus_logits_indices=torch.arange(1, batch + 1),
        logits_indices=torch.arange(batch + 1))
    calls.clear()
    out = wrapped(runner(batch, True), torch.randn(batch + 1, vocab), drafted)
    assert calls == ["bonus"] and out.sampled_token_ids.shape == (batch, 2)
    assert patches.install_no_draft_plain_sampling() and patches.install_no_draft_plain_sampling()
    assert GPUModelRunner._sample.__vllm_usd_wrapped__ is original
