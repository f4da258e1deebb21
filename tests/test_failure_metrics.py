"""What the workers publish, as the user's Prometheus collector reads it (no engine).

Each worker process leaves one file in the metrics folder. Failures add up over every worker the
user's process started (a counter), but the draft-length gauge shows each rank's newest worker: an
engine started after another one in the same process replaces the first one's lengths.
"""

from __future__ import annotations

import json
import os

from vllm_usd import envs
from vllm_usd.vllm_adapter.failures import LENGTH_METRIC, METRIC, FailureCollector, FailureCounts


def _read(collector: FailureCollector) -> tuple[dict, dict]:
    failures, lengths = {}, {}
    for family in collector.collect():
        for sample in family.samples:
            labels = sample.labels
            if family.name == LENGTH_METRIC:
                lengths[(labels["batch"], labels["rank"])] = sample.value
            elif sample.name.startswith(METRIC):
                failures[(labels["reason"], labels["rank"])] = sample.value
    return failures, lengths


def test_the_gauge_shows_each_ranks_newest_worker_and_failures_add_up(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.METRICS_DIR, str(tmp_path))
    # a worker of an engine that ended earlier, with other lengths (and a bucket the new one never had)
    old = tmp_path / "99999999.json"  # a name that sorts after this process's pid
    old.write_text(json.dumps({"failures": {"0": {"drafter": 2}},
                               "lengths": {"0": {"1": 3, "2-3": 2, "64-127": 1}}}))
    os.utime(old, ns=(1, 1))  # older than anything written now

    counts = FailureCounts(rank=0)
    counts.set_lengths({"1": 1, "2-3": 0})
    counts.record("drafter")
    failures, lengths = _read(FailureCollector())

    assert lengths == {("1", "0"): 1, ("2-3", "0"): 0}
    assert failures == {("drafter", "0"): 3}

