"""The front-end check: a bad vllm-usd start-up fails in the user's process, before any engine process starts."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tests.fakes import small_gguf, vllm_config
from tests.fixtures import tiny
from vllm_usd.vllm_adapter import compat, frontend, patches


@pytest.fixture(scope="module")
def pair():
    return tiny.build_distribution_pair()


def _raises(config, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        frontend.check_engine_config(config)
    assert type(info.value) is ValueError and "\n" not in str(info.value)
    assert str(info.value).startswith("vllm-usd: ")
    return str(info.value)


def test_a_good_config_passes(pair):
    target, drafter = pair
    frontend.check_engine_config(vllm_config(target, {"drafter": drafter}))


def test_other_speculative_methods_and_other_custom_classes_are_left_alone(pair):
    target, _ = pair
    frontend.check_engine_config(vllm_config(target, {"drafter": "/no/such"}, method="ngram"))
    frontend.check_engine_config(vllm_config(target, None, proposer="someone_else.Proposer"))
    assert not compat.wants_vllm_usd(vllm_config(target, None, proposer="someone_else.Proposer"))
    assert compat.wants_vllm_usd(vllm_config(target, None))  # vllm_usd's class without a usd section


@pytest.mark.parametrize("usd,k,proposer,match", [
    ({"drafter": "/no/such/drafter"}, 3, "vllm_usd.UniversalProposer", "vllm-usd: drafter folder not found"),
    ({"drafter": "D", "drafter_typo": 1}, 3, "vllm_usd.UniversalProposer", "unknown key 'drafter_typo'"),
    (None, 3, "vllm_usd.UniversalProposer", "additional_config has no 'usd' section"),
    ({"drafter": "D"}, 100, "vllm_usd.UniversalProposer", r"num_speculative_tokens = 100; use 1\.\.16"),
    ({"drafter": "D"}, 3, "vllm_usd.UniversalProposr",
     re.escape("has no attribute 'UniversalProposr' (speculative_config.model='vllm_usd.UniversalProposr')")),
    ({"drafter": "D", "min_intersection": 1.0}, 3, "vllm_usd.UniversalProposer", "share .* at least 100% is needed"),
])
def test_bad_settings_are_one_line(pair, usd, k, proposer, match):
    target, drafter = pair
    if usd is not None and usd["drafter"] == "D":
        usd = {**usd, "drafter": drafter}
    _raises(vllm_config(target, usd, k=k, proposer=proposer), match)


def test_a_drafter_without_a_tokenizer(pair, tmp_path):
    import shutil

    target, drafter = pair
    shutil.copyfile(os.path.join(drafter, "config.json"), tmp_path / "config.json")
    _raises(vllm_config(target, {"drafter": str(tmp_path)}), "the drafter has no readable tokenizer")


@pytest.mark.skipif(not __import__("importlib").util.find_spec("llama_cpp"), reason="llama-cpp-python is not installed")
@pytest.mark.parametrize("cut,match", [
    (-100, r"is truncated: its tensors need \d+ bytes but the file has \d+"),  # the end of the weights lost
    (40, r"cannot be read"),  # inside the header
])
def test_a_broken_gguf_is_refused_in_one_line(pair, tmp_path, cut, match):
    """Named in usd.drafter_gguf or found in the drafter folder, a GGUF that is not whole is refused here,
    before any engine process starts, with the fix; a whole one passes this check."""
    import shutil

    target, drafter = pair
    line = _raises(vllm_config(target, {"drafter": drafter, "drafter_gguf": small_gguf(tmp_path / "d.gguf", cut)}), match)
    assert "usd.drafter_runtime = \"transformers\"" in line
    folder = tmp_path / "folder"
    shutil.copytree(drafter, folder)
    small_gguf(folder / "model.gguf", cut)
    _raises(vllm_config(target, {"drafter": str(folder)}), match)
    from vllm_usd.drafter.select import check_gguf

    check_gguf(small_gguf(tmp_path / "whole.gguf"))


def test_model_runner_v2_is_refused(pair):
    """vLLM's V2 runner has no custom_class proposers (VLLM_USE_V2_MODEL_RUNNER=1 forces it)."""
    target, drafter = pair
    config = vllm_config(target, {"drafter": drafter})
    config.use_v2_model_runner = True
    _raises(config, "vLLM chose Model Runner V2")


def test_sleep_mode_is_refused_in_one_line_here_and_in_the_worker(pair):
    """Issue 39, finding 8: sleep(level=2) would discard the drafter's KV pool and q buffer (their zero columns
    keep the residual right), so vllm-usd refuses enable_sleep_mode at start-up, before and in the worker."""
    from vllm_usd import UniversalProposer

    target, drafter = pair
    config = vllm_config(target, {"drafter": drafter})
    config.model_config.enable_sleep_mode = True
    _raises(config, "enable_sleep_mode is not supported")
    with pytest.raises(ValueError, match="enable_sleep_mode is not supported"):
        UniversalProposer(config)


def test_lossy_verification_is_allowed_with_a_warning(pair, caplog):
    import logging

    target, drafter = pair
    config = vllm_config(target, {"drafter": drafter})
    config.speculative_config.rejection_sample_method = "fly"  # vLLM 0.33.0's FLy
    with caplog.at_level(logging.WARNING, logger="vllm.usd"):
        frontend.check_engine_config(config)
    assert any("rejection_sample_method='fly'" in r.getMessage() for r in caplog.records)


def test_an_unsupported_vllm_fails_here_too(pair, monkeypatch):
    target, drafter = pair
    monkeypatch.setattr(patches, "refusal", lambda name, root=None: f"vllm-usd: patch {name} not applied: X changed")
    _raises(vllm_config(target, {"drafter": drafter}), "patch runner_hook not applied: X changed")


def test_the_wrapper_checks_what_create_engine_config_returns(pair):
    from vllm_usd.vllm_adapter import plugin

    plugin.register()  # as vLLM does in every process: it wires the front-end check into the patch
    target, drafter = pair
    bad, good = vllm_config(target, {"drafter": "/no/such"}), vllm_config(target, {"drafter": drafter})
    wrapped = patches._wrap_create_engine_config(lambda self, *a, **k: self)
    assert wrapped(good) is good
    with pytest.raises(ValueError, match="drafter folder not found"):
        wrapped(bad)


def test_the_worker_keeps_its_own_check(pair):
    """The backstop: the proposer refuses the same config in the worker."""
    from vllm_usd import UniversalProposer
    from vllm_usd.drafter import DrafterLoadError

    target, _ = pair
    with pytest.raises(DrafterLoadError, match="drafter folder not found"):
        UniversalProposer(vllm_config(target, {"drafter": "/no/such"}))


SCRIPT = textwrap.dedent("""
    import json, sys, time
    if __name__ == "__main__":
        started = time.perf_counter()
        from vllm import LLM
        imported = time.perf_counter()
        try:
            LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=256,
                speculative_config={"method": "custom_class", "model": "vllm_usd.UniversalProposer",
                                    "num_speculative_tokens": 3},
                additional_config={"usd": json.loads(sys.argv[2])})
        finally:
            print(f"TIMES import={imported - started:.2f} llm={time.perf_counter() - imported:.2f}", flush=True)
""")


def _start(target: str, usd: dict, tmp_path) -> tuple[subprocess.CompletedProcess, str]:
    """``LLM(...)`` with vllm-usd's ``usd`` settings in a fresh interpreter: (the process, its last line)."""
    import json

    script = tmp_path / "start.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    res = subprocess.run([sys.executable, str(script), target, json.dumps(usd)], capture_output=True, text=True,
                         timeout=300, env=env)
    out = res.stdout + res.stderr
    assert res.returncode != 0
    assert "EngineCore" not in out and "Engine core initialization failed" not in out, "an engine process started"
    return res, res.stderr.strip().splitlines()[-1]


@pytest.mark.engine
def test_llm_with_a_bad_drafter_fails_in_the_front_end(pair, tmp_path):
    target, drafter = pair
    res, last = _start(target, {"drafter": "/nonexistent"}, tmp_path)
    assert last == ("ValueError: vllm-usd: drafter folder not found (additional_config.usd.drafter = '/nonexistent'). "
                    "Point it at a local model folder or a hub id."), last
    times = dict(kv.split("=") for kv in re.search(r"TIMES (.*)", res.stdout).group(1).split())
    print(f"\nfront-end failure: import vllm {times['import']} s, then LLM(...) raised after {times['llm']} s")
    assert float(times["llm"]) < 15, times  # was 22+ s after the import, with an engine core and a worker started
    # a truncated GGUF: vllm-usd's one line is the last the user sees (the worker's loader wrapper would
    # have added "The class constructor must accept VllmConfig as argument.")
    gguf = small_gguf(tmp_path / "cut.gguf", -100)
    _, last = _start(target, {"drafter": drafter, "drafter_gguf": gguf}, tmp_path)
    assert last.startswith(f"ValueError: vllm-usd: the drafter GGUF '{gguf}' is truncated: its tensors need "), last


def test_the_front_end_makes_no_cuda_call(pair, monkeypatch):
    """Issue 39, finding 5: the check runs in the user's process, inside vLLM's create_engine_config, before any
    engine process exists. A CUDA context there would make vLLM spawn its processes and hold cuda:0. On a GPU
    host (is_available() answers without a context), every call that initialises CUDA raises here."""
    import types

    import torch

    def no_cuda(name):
        def call(*args, **kwargs):  # one function per name: torch's own tables reject a shared one
            raise AssertionError(f"CUDA initialised in the user's process (torch.cuda.{name})")
        return call

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("_lazy_init", "init", "current_device", "set_device", "synchronize", "mem_get_info",
                 "get_device_properties", "get_device_name", "get_device_capability", "memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, no_cuda(name))
    target, drafter = pair
    config = vllm_config(target, {"drafter": drafter})
    config.device_config = types.SimpleNamespace(device="cuda")
    frontend.check_engine_config(config)
    with pytest.raises(AssertionError, match="CUDA initialised"):  # power check: the trap is set
        torch.cuda.current_device()
