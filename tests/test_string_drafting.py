"""String-level drafting (usd.draft_mode): the strategy on a scripted drafter, and the proposer's
routing of greedy and sampled rows, against a fake runner. No engine."""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import pytest
import torch

from tests.fakes import FakeRunner, sampling, vllm_config
from vllm_usd import UniversalProposer
from vllm_usd.core.pair import DraftPair
from vllm_usd.core.retokenize import TargetRetokenizer
from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.drafting import DraftRows, PhaseTimer
from vllm_usd.drafting.string_level import StringDrafting


# -- the strategy, on a drafter that writes a given script ---------------------------------
class ScriptedRuntime(DrafterRuntime):
    """Each request drafts its script, one drafter token per forward; records every forward's rows."""

    def __init__(self, scripts: dict[str, list[int]], vocab: int) -> None:
        self._tokens = {}
        self.scripts = scripts
        self.num_outputs = vocab
        self.max_len = 1 << 20
        self.calls: list[list[str]] = []

    def set_output_rows(self, rows: torch.Tensor) -> None:
        raise AssertionError("string drafting reads the whole head")

    def _claim(self, req_id: str) -> bool:
        return True

    def _release(self, req_id: str) -> None:
        pass

    kv_bytes = 0
    param_bytes = 0

    def forward(self, req_ids: Sequence[str], keep: Sequence[int], new_tokens: Sequence[Sequence[int]]) -> torch.Tensor:
        self.calls.append(list(req_ids))
        out = torch.zeros(len(req_ids), self.num_outputs)
        for i, (r, n, new) in enumerate(zip(req_ids, keep, new_tokens)):
            self._tokens[r] = self._tokens[r][:n] + list(new)
            drafted = len(self._tokens[r]) - self.start[r]
            out[i, self.scripts[r][min(drafted, len(self.scripts[r]) - 1)]] = 1.0
        return out


@pytest.fixture(scope="module")
def bpe_target_sp_drafter(tiny_tokenizers):
    target, drafter = tiny_tokenizers["bpe"], tiny_tokenizers["sp"]
    pair = DraftPair.build(target, drafter)
    return target, drafter, pair, TargetRetokenizer(target, pair.mapping.target_table)


def _draft(setup, prompts: dict[str, str], scripts: dict[str, list[int]], lengths: list[int], budget: int = 7):
    target, drafter, pair, retok = setup
    runtime = ScriptedRuntime(scripts, pair.mapping.draft_vocab_size)
    rows = DraftRows()
    runtime.start = {}
    for i, (r, text) in enumerate(prompts.items()):
        ids = target(text).input_ids
        tr = pair.translator()
        tr.start(ids)
        runtime.add(r)
        runtime.start[r] = len(tr.draft_ids)
        rows.rows.append(i)
        rows.req_ids.append(r)
        rows.states.append(type("S", (), {"translator": tr})())
        rows.sequences.append(list(tr.draft_ids))
        rows.unchanged.append(0)
        rows.positions.append(len(ids))
        rows.target_tails.append(ids[-16:])
    counters: dict[str, int] = defaultdict(int)
    strategy = StringDrafting(pair.mapping, retok, runtime, budget=budget, timer=PhaseTimer(False), counters=counters)
    return strategy.draft(rows, lengths), runtime, counters


def _drafter_ids(drafter, text: str) -> list[int]:
    """The drafter's ids for ``text`` in mid-sequence (no prefix space added), joined back to ``text``."""
    from vllm_usd.core.token_bytes import build_token_table
    from vllm_usd.core.translate import FragmentEncoder

    table = build_token_table(drafter)
    ids = FragmentEncoder(drafter, table).encode(text.encode())
    assert table.bytes_of(ids) == text.encode()
    return ids


def test_drafted_text_becomes_the_targets_own_tokens_but_the_last(bpe_target_sp_drafter):
    target, drafter, *_ = bpe_target_sp_drafter
    continuation = " keeper of the lighthouse"
    script = _drafter_ids(drafter, continuation)
    out, runtime, counters = _draft(bpe_target_sp_drafter, {"a": "the"}, {"a": script}, [3], budget=len(script))
    want = target("the" + continuation).input_ids[len(target("the").input_ids):]
    assert out[0] == want[:3], (out, want)
    assert counters["string_rows"] == 1 and counters["string_proposed"] == 3


def test_a_row_stops_once_it_has_its_length_and_others_go_on(bpe_target_sp_drafter):
    target, drafter, *_ = bpe_target_sp_drafter
    long_text = _drafter_ids(drafter, " keeper of the lighthouse walked down")
    out, runtime, counters = _draft(bpe_target_sp_drafter, {"short": "the", "long": "the"},
                                    {"short": long_text, "long": long_text}, [1, 4], budget=len(long_text))
    assert len(out[0]) == 1 and len(out[1]) == 4
    # the forwards per row are counted: the long row ran more of them than the short one
    per_row = {r: sum(r in call for call in runtime.calls) for r in ("short", "long")}
    assert per_row["long"] > per_row["short"] >= 1, per_row
    assert counters["string_row_forwards"] == sum(per_row.values())
    assert runtime.calls[0] == ["short", "long"], "one batched forward to start"
    assert all(call == ["long"] for call in runtime.calls[2:]), "the short row leaves the batch"
    assert len(runtime.calls) < len(long_text), "the long row stops at its length, before the budget"


def test_the_budget_caps_drafter_forwards(bpe_target_sp_drafter):
    _, drafter, *_ = bpe_target_sp_drafter
    script = _drafter_ids(drafter, " a b c d e f g h i j")
    out, runtime, _ = _draft(bpe_target_sp_drafter, {"a": "the"}, {"a": script}, [16], budget=3)
    assert len(runtime.calls) == 3 and len(out[0]) <= 2, "3 drafter tokens: at most 2 determined target tokens"


def test_a_shared_end_token_ends_the_text_and_keeps_its_last_token(bpe_target_sp_drafter):
    target, drafter, pair, _ = bpe_target_sp_drafter
    script = _drafter_ids(drafter, " keeper") + [drafter.eos_token_id]
    out, runtime, _ = _draft(bpe_target_sp_drafter, {"a": "the"}, {"a": script}, [5])
    assert pair.mapping.draft_to_target[drafter.eos_token_id] == target.eos_token_id
    assert out[0] == target("the keeper").input_ids[len(target("the").input_ids):] + [target.eos_token_id]


def test_an_unshared_special_token_ends_the_text_without_it(bpe_target_sp_drafter):
    target, drafter, pair, _ = bpe_target_sp_drafter
    unk = drafter.unk_token_id
    assert pair.mapping.draft_to_target[unk] < 0
    script = _drafter_ids(drafter, " keeper of") + [unk]
    out, runtime, _ = _draft(bpe_target_sp_drafter, {"a": "the"}, {"a": script}, [5])
    assert out[0] == target("the keeper of").input_ids[len(target("the").input_ids):], out


def test_text_that_merges_into_the_committed_token_proposes_nothing(bpe_target_sp_drafter):
    """Committed "...the", drafted "re...": the target tokenizer would have written one token for
    "there", so no target token can follow the committed ones."""
    target, drafter, *_ = bpe_target_sp_drafter
    head, full = target(" the").input_ids, target(" there").input_ids
    assert len(head) == 1 and len(full) == 1, "the fixture has both words as single tokens"
    script = _drafter_ids(drafter, "re is a boat")
    out, _, counters = _draft(bpe_target_sp_drafter, {"a": " the"}, {"a": script}, [3])
    assert out == [[]] and counters["string_rewrites"] == 1


# -- the proposer: which rows draft text -------------------------------------------------------
def _pair():
    from tests.fixtures import tiny

    return tiny.build_distribution_pair()


def _proposer(**usd):
    target, drafter = _pair()
    return UniversalProposer(vllm_config(target, {"drafter": drafter, "adaptive_length": False, **usd}, k=3))


def _prompt(text):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_pair()[0])(text).input_ids


def _runner():
    runner = FakeRunner()
    runner.add("g1", _prompt(" the keeper"), sampling(0.0))
    runner.add("s", _prompt(" the keeper"), sampling(0.8, top_p=0.9))
    runner.add("g2", _prompt(" it was"), sampling(0.0))
    return runner


def test_auto_drafts_text_for_greedy_rows_and_tli_with_q_for_sampled_rows():
    p = _proposer()
    drafts = _runner().step(p, {})
    assert p.counters["string_rows"] == 2, dict(p.counters)
    q = p.take_last_draft_probs()
    assert q is not None
    for j, tok in enumerate(drafts["s"]):
        assert abs(float(q[1, j].sum()) - 1) < 1e-4 and q[1, j, tok] > 0, "the sampled row's q"
    assert len(drafts["s"]) == 3 and all(len(d) <= 3 for d in drafts.values())
    assert drafts["g1"] or drafts["g2"], "greedy rows got string drafts"


def test_greedy_string_drafts_spell_the_drafters_own_greedy_text():
    """The reference: the drafter's greedy continuation from transformers, re-encoded whole by the target tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target_path, drafter_path = _pair()
    p = _proposer(draft_mode="string")
    drafts = _runner().step(p, {})
    model = AutoModelForCausalLM.from_pretrained(drafter_path, torch_dtype=torch.float32)
    target = AutoTokenizer.from_pretrained(target_path)
    table = p.mapping.draft_table
    checked = 0
    for req, text in (("g1", " the keeper"), ("g2", " it was"), ("s", " the keeper")):
        context = torch.tensor([p.requests.get(req).translator.draft_ids])
        out = model.generate(context, max_new_tokens=7, do_sample=False)[0, context.shape[1]:].tolist()
        written = table.bytes_of(out).decode("utf-8", errors="ignore")
        prompt = _prompt(text)
        want = target(text + written).input_ids[len(prompt):]
        assert drafts[req] == want[:len(drafts[req])], (req, drafts[req], want)
        checked += len(drafts[req])
    assert checked >= 3


def test_string_mode_hands_no_q_even_for_sampled_rows():
    p = _proposer(draft_mode="string")
    drafts = _runner().step(p, {})
    assert p.counters["string_rows"] == 3 and drafts["s"]
    assert p.take_last_draft_probs() is None, "point masses: vLLM is given no q"


def test_tli_mode_drafts_no_text():
    p = _proposer(draft_mode="tli")
    drafts = _runner().step(p, {})
    assert p.counters["string_rows"] == 0 and all(len(d) == 3 for d in drafts.values())


def _two_ranks(cls) -> list[list[str]]:
    """Two proposers fed the same steps, as two tensor-parallel ranks are (auto mode: text and TLI rows)."""
    digests = []
    for rank in (0, 1):
        target, drafter = _pair()
        p = cls(vllm_config(target, {"drafter": drafter, "adaptive_length": False, "debug_digests": True}, k=3))
        p.rank = rank
        runner = _runner()
        drafts = runner.step(p, {})
        for _ in range(3):
            drafts = runner.step(p, {r: d[:1] or [5] for r, d in drafts.items()})
        assert p.counters["string_rows"] == 8, "both greedy rows drafted text at every step"
        digests.append(p.digests)
    return digests


def test_ranks_draft_identical_text_and_q():
    rank0, rank1 = _two_ranks(UniversalProposer)
    assert len(rank0) == 4 and rank0 == rank1


def test_digests_of_mixed_steps_catch_rank_local_randomness():
    """Planted bug (tests.faults.RankRngProposer): the one digest per step covers the TLI rows too."""
    from tests.faults import RankRngProposer

    rank0, rank1 = _two_ranks(RankRngProposer)
    assert len(rank0) == 4 and rank0 != rank1


def test_string_rows_leave_room_for_their_budget_in_the_drafters_context():
    """A request whose context has room for k drafts but not for the string budget gets no drafts,
    instead of failing the batched forward for every request."""
    probe = _proposer(draft_mode="string")
    runner = _runner()
    runner.step(probe, {})
    n = len(probe.requests.get("g1").translator.draft_ids)
    p = _proposer(draft_mode="string", drafter_max_model_len=n + 4)  # k = 3 fits, the budget 2k+1 = 7 does not
    drafts = _runner().step(p, {})
    assert p.counters.get("failed_steps", 0) == 0, dict(p.counters)
    assert drafts["g1"] == [] and p.counters["skipped_context_full"] >= 1


def test_text_rows_read_their_text_as_the_drafter_cuts_it_and_tli_rows_the_shared_tokens():
    """auto mode: a greedy (string) row's drafter context is its text re-encoded by the drafter's tokenizer
    (ContextTranslator by_text); a sampled (TLI) row's maps shared tokens 1:1. The prompt is one on which
    the two translations differ, so the check can tell them apart."""
    p = _proposer()
    texts = [" the keeper said:\n\n    it was", "  two  spaces,\tand tabs\n\n\n", " it was the keeper's", " the keeper"]

    def translated(ids, by_text):
        tr = p.pair.translator(by_text=by_text)
        tr.start(ids)
        return tr.draft_ids

    prompt = next((ids for ids in map(_prompt, texts) if translated(ids, True) != translated(ids, False)), None)
    assert prompt is not None, "no prompt tells the two translations apart"
    runner = FakeRunner()
    runner.add("g", prompt, sampling(0.0))
    runner.add("s", prompt, sampling(0.8))
    runner.step(p, {})
    assert p.requests.get("g").translator.draft_ids == translated(prompt, True)
    assert p.requests.get("s").translator.draft_ids == translated(prompt, False)
