"""A bad drafter setting stops vLLM's start-up with vllm-usd's own one-line message, as the last line,
in the user's process (the front-end check), before an engine core starts."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.engine

SCRIPT = textwrap.dedent("""
    import sys
    if __name__ == "__main__":
        from vllm import LLM
        case = sys.argv[3]
        LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
            speculative_config={"method": "custom_class",
                                "model": "vllm_usd.UniversalProposr" if case == "misspelled"
                                else "vllm_usd.UniversalProposer",
                                "num_speculative_tokens": 100 if case == "k100" else 3},
            additional_config={"usd": {"drafter": sys.argv[2], "drafter_typo": 1}
                               if case == "typo" else {"drafter": sys.argv[2]}})
""")


@pytest.mark.parametrize("case,expected", [
    ("missing", "vllm-usd: drafter folder not found"),
    ("typo", "vllm-usd: unknown key 'drafter_typo' in additional_config.usd. Valid keys: drafter,"),
    ("k100", "vllm-usd: num_speculative_tokens = 100; use 1..16"),
    ("misspelled", "has no attribute 'UniversalProposr' (speculative_config.model='vllm_usd.UniversalProposr')"),
])
def test_startup_error_reaches_the_user(tmp_path, case, expected):
    from tests.fixtures import tiny

    target, drafter = tiny.tiny_pair("bpe", "sp")
    if case == "missing":
        drafter = str(tmp_path / "no" / "such-drafter")
    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    res = subprocess.run([sys.executable, str(script), target, drafter, case], capture_output=True, text=True,
                         timeout=300, env=env)
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: vllm-usd: ") and expected in last, last
    assert "Engine core initialization failed" not in res.stdout + res.stderr
