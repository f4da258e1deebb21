"""Host reads per drafting step: what would make the GPU wait for the host.

Counted with ``SyncCounter`` (every ``tolist``/``item``/``bool`` ... of a tensor; on the CPU nothing
waits, on CUDA each of these would). The budget, from issue 30:
- TLI: one read per step, the drafts handed to vLLM, whatever the number of positions;
- string drafting: one read per drafter forward (its drafted ids' bytes are needed on the host).
scripts/gpu_check.py checks the same on CUDA with ``torch.cuda.set_sync_debug_mode``. No vLLM.
"""

from __future__ import annotations

import pytest

from tests.fixtures.drafting import forwards_of, run_counted, tli_and_string


@pytest.fixture(scope="module")
def strategies():
    return tli_and_string("cpu")


def test_a_tli_step_reads_the_host_once(strategies):
    tli, rows, _, _ = strategies
    calls = forwards_of(tli.runtime)
    batch, reads, _ = run_counted("cpu", lambda: tli.draft(rows, salt=0, lengths=[3, 2, 1]))
    assert len(calls) == 3, "the step should run the catch-up and two more positions"
    assert reads == ["tolist"], reads
    assert [len(ids) for ids in batch.target_ids] == [3, 2, 1]
    # the drafter's record of what it was fed came from that one read, not from a second copy
    _, reads, _ = run_counted("cpu", lambda: [tli.runtime.cached_tokens(r) for r in rows.req_ids])
    assert reads == []


def test_a_planted_extra_read_is_counted(strategies):
    """The counter catches what it exists for: a draft loop that reads each position's ids back."""
    tli, rows, _, _ = strategies
    runtime = tli.runtime
    original = runtime.forward_next

    def reads_back(req_ids, keep, tokens, host_ids=None):
        return original(req_ids, keep, tokens, host_ids=tokens.tolist())

    runtime.forward_next = reads_back
    try:
        _, reads, _ = run_counted("cpu", lambda: tli.draft(rows, salt=0, lengths=[3, 3, 3]))
    finally:
        runtime.forward_next = original
    assert reads == ["tolist"] * 3


def test_string_drafting_reads_the_host_once_per_forward(strategies):
    _, _, strings, rows = strategies
    calls = forwards_of(strings.runtime)
    out, reads, _ = run_counted("cpu", lambda: strings.draft(rows, [3, 3, 3]))
    assert len(calls) >= 2, "the step should draft past the catch-up"
    assert reads == ["tolist"] * len(calls), (reads, calls)
    assert any(out), "nothing was drafted: the count would be vacuous"
