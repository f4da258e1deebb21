"""Drafting failures and draft lengths, where a user sees them: ``stats()``, the log, and Prometheus.

A step whose drafting fails on any tensor-parallel rank goes without drafts on every rank; the
engine goes on. Each such step is counted by its reason (the exception's type, ``another rank
failed``, or ``cuda graph capture``: the drafter then runs eagerly), and logged: the first of each reason with its traceback,
then at most one line a minute with the count.

Counts cross processes through files: each worker writes its own to
``$VLLM_USD_METRICS_DIR/<pid>.json``. ``register()`` makes that folder in the user's process
before any engine starts (the engine's processes inherit the variable) and registers a
Prometheus collector there that sums them, so ``vllm:usd_drafting_failures_total{reason,rank}``
stands next to vLLM's ``vllm:spec_decode_*`` counters on the API server's ``/metrics`` and in
``LLM.get_metrics()``. The same files carry the draft-length controller's current length per
batch-size bucket, the gauge ``vllm:usd_draft_length{batch,rank}``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

from vllm_usd import envs

logger = logging.getLogger("vllm.usd")

LOG_INTERVAL_S = 60.0
METRIC = "vllm:usd_drafting_failures"
LENGTH_METRIC = "vllm:usd_draft_length"
PEER_FAILED = "another tensor-parallel rank failed"
GRAPH_CAPTURE = "cuda graph capture"
_collector_installed = False


class FailureCounts:
    """One worker's failed drafting steps by reason, logged and published."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.by_reason: Counter[str] = Counter()
        self._last_log = float("-inf")
        self._since_log = 0
        self.lengths: dict[str, int] = {}  # batch-size bucket -> the controller's current length

    def set_lengths(self, lengths: dict[str, int]) -> None:
        """The controller's lengths per bucket, published when they change."""
        if lengths != self.lengths:
            self.lengths = dict(lengths)
            self._publish()

    def record(self, reason: str, exc: BaseException | None = None) -> None:
        first = reason not in self.by_reason
        self.by_reason[reason] += 1
        self._since_log += 1
        now = time.monotonic()
        total = sum(self.by_reason.values())
        if first:
            logger.error("vllm-usd: drafting failed (%s); this step goes without drafts on every rank, and the "
                         "engine goes on. Failures are counted in stats() and %s_total", reason, METRIC,
                         exc_info=exc)
        elif now - self._last_log >= LOG_INTERVAL_S:
            logger.warning("vllm-usd: drafting failed in %d steps so far (%d since the last report; by reason: %s); "
                           "those steps went without drafts", total, self._since_log, dict(self.by_reason))
        else:
            self._publish()
            return
        self._last_log, self._since_log = now, 0
        self._publish()

    def check_graph_capture(self, runtime: object) -> None:
        """A failed CUDA-graph capture (the drafter then runs eagerly) counts like a failed step, once."""
        graphs = getattr(runtime, "graphs", None)
        if graphs is not None and graphs.failure is not None and GRAPH_CAPTURE not in self.by_reason:
            self.record(GRAPH_CAPTURE, graphs.failure)

    def _publish(self) -> None:
        folder = envs.metrics_dir()
        if not folder:
            return
        path = Path(folder) / f"{os.getpid()}.json"
        try:
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps({"failures": {str(self.rank): dict(self.by_reason)},
                                       "lengths": {str(self.rank): self.lengths}}))
            os.replace(tmp, path)
        except OSError:
            pass  # the counts stay in stats() and the log


class FailureCollector:
    """A Prometheus collector: the workers' counts, summed by reason and rank."""

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        family = CounterMetricFamily(METRIC, "Engine steps whose drafts vllm-usd dropped because drafting failed",
                                     labels=["reason", "rank"])
        gauge = GaugeMetricFamily(LENGTH_METRIC, "The draft length vllm-usd's controller chose last, per batch size",
                                  labels=["batch", "rank"])
        totals: Counter[tuple[str, str]] = Counter()
        lengths: dict[str, dict[str, int]] = {}  # rank -> its newest worker's lengths by bucket
        for path in _published_oldest_first():
            try:
                published = json.loads(path.read_text())
                for rank, reasons in published["failures"].items():
                    for reason, n in reasons.items():
                        totals[(reason, rank)] += int(n)
                for rank, by_batch in published["lengths"].items():
                    lengths[rank] = {batch: int(n) for batch, n in by_batch.items()}
            except (OSError, ValueError, AttributeError, KeyError):
                continue
        for (reason, rank), n in sorted(totals.items()):
            family.add_metric([reason, rank], n)
        for rank, by_batch in sorted(lengths.items()):
            for batch, n in sorted(by_batch.items()):
                gauge.add_metric([batch, rank], n)
        yield family
        yield gauge


def _published_oldest_first() -> list[Path]:
    """The workers' files, oldest first: failures add up over every worker this process started, but
    a rank's lengths are its newest worker's (an engine started after another replaces its lengths)."""
    folder = envs.metrics_dir()
    stamped = []
    for path in Path(folder).glob("*.json") if folder else ():
        try:
            stamped.append((path.stat().st_mtime_ns, path.name, path))
        except OSError:
            continue  # a worker replaced it meanwhile
    return [path for _, _, path in sorted(stamped)]


def install_collector() -> None:
    """In the user's process: the folder the workers write to, and the collector that reads it."""
    global _collector_installed
    if _collector_installed:
        return
    _collector_installed = True
    if not envs.metrics_dir():
        envs.set_metrics_dir(tempfile.mkdtemp(prefix="vllm-usd-metrics-"))
    try:
        from prometheus_client import REGISTRY

        REGISTRY.register(FailureCollector())
    except ImportError:
        pass  # no Prometheus client: the counts stay in stats() and the log
