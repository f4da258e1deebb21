"""Smoke-check the real model pair in vLLM (CPU): greedy text for two prompts per model.

Usage::

    python scripts/check_real_pair.py            # both models, one subprocess each
    python scripts/check_real_pair.py gemma3     # just one (runs in this process)

vLLM start-up takes about a minute per model on a small CPU box; one engine per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = ["The capital of France is", "Water boils at a temperature of"]


def check(key: str) -> dict[str, object]:
    """Load model ``key`` in vLLM and greedily generate 24 tokens for each prompt."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from vllm_usd.demo_pair import ensure_real_pair

    path = ensure_real_pair()[key]
    llm = LLM(model=path, dtype="float32", enforce_eager=True, max_model_len=512, max_num_seqs=8)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))
    return {
        "model": key,
        "path": path,
        "texts": {o.prompt: o.outputs[0].text for o in outputs},
        "prompt_token_ids": {o.prompt: o.prompt_token_ids for o in outputs},
    }


def main() -> int:
    """Check the models named on the command line (default: both, each in its own process)."""
    keys = sys.argv[1:] or ["smollm2", "gemma3"]
    if len(keys) == 1:
        print("RESULT " + json.dumps(check(keys[0]), ensure_ascii=False), flush=True)
        return 0
    return max(subprocess.call([sys.executable, __file__, key]) for key in keys)


if __name__ == "__main__":
    sys.exit(main())
