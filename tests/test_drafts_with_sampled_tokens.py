"""Patch drafts_with_sampled_tokens: the engine core gets a step's drafts with its sampled tokens, in one
round trip to the workers, and only for a vllm-usd engine. Fake executors; no engine (the engine tests
run the patched path: their drafts reach the scheduler through it)."""

from __future__ import annotations

from vllm_usd.vllm_adapter import patches


class FakeExecutor:
    """What the wrappers use of vLLM's MultiprocExecutor; its calls to the workers are recorded."""

    output_rank = 0

    def __init__(self, serves_vllm_usd: bool, aggregator=None) -> None:
        self._vllm_usd_serves = serves_vllm_usd
        self.kv_output_aggregator = aggregator
        self.ec_output_aggregator = None
        self.calls: list[str] = []

    def collective_rpc(self, method, args=(), unique_reply_rank=None, timeout=None):
        self.calls.append(method)
        assert unique_reply_rank == self.output_rank
        return ("output", "drafts")


def _original_sample_tokens(self, grammar_output, non_block=False):
    self.calls.append("sample_tokens")
    return "output"


def _original_take(self):
    self.calls.append("take_draft_token_ids")
    return "drafts over another call"


SAMPLE = patches._wrap_executor_sample_tokens(_original_sample_tokens)
TAKE = patches._wrap_executor_take_draft_token_ids(_original_take)


def test_a_vllm_usd_engine_gets_the_drafts_with_the_sampled_tokens():
    ex = FakeExecutor(serves_vllm_usd=True)
    for _ in range(3):
        assert SAMPLE(ex, None) == "output"
        assert TAKE(ex) == "drafts"
    assert ex.calls == [patches._SAMPLE_AND_TAKE] * 3, "one round trip a step"
    assert TAKE(ex) == "drafts over another call", "drafts already taken are not handed out twice"


def test_other_engines_and_other_paths_keep_vllms_two_calls():
    for ex, non_block in ((FakeExecutor(serves_vllm_usd=False), False), (FakeExecutor(True), True),
                          (FakeExecutor(True, aggregator=object()), False)):
        SAMPLE(ex, None, non_block)
        assert TAKE(ex) == "drafts over another call"
        assert ex.calls == ["sample_tokens", "take_draft_token_ids"]


def test_the_worker_samples_then_takes_its_drafts():
    class Worker:
        def __init__(self):
            self.calls = []

        def sample_tokens(self, grammar_output):
            self.calls.append(("sample_tokens", grammar_output))
            return "output"

        def take_draft_token_ids(self):
            self.calls.append(("take_draft_token_ids",))
            return "drafts"

    worker = Worker()
    assert patches._sample_tokens_and_take_drafts(worker, "grammar") == ("output", "drafts")
    assert worker.calls == [("sample_tokens", "grammar"), ("take_draft_token_ids",)]
