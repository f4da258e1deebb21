"""Start-up validation of additional_config["usd"] and of the proposer's inputs. No engine."""

from __future__ import annotations

import pytest

import vllm_usd
from tests.fakes import vllm_config as _vllm_config
from vllm_usd.config import parse_usd_config


def test_defaults_and_helper():
    cfg = parse_usd_config({"usd": {"drafter": "some/model"}})
    assert cfg.drafter == "some/model" and cfg.draft_sampling == "auto" and cfg.trust_remote_code is None
    assert cfg.adaptive_length and cfg.confidence_stop == 0.0
    args = vllm_usd.speculative_args(drafter="d", k=4, draft_sampling="greedy")
    assert args["speculative_config"] == {"method": "custom_class", "model": "vllm_usd.UniversalProposer",
                                          "num_speculative_tokens": 4}
    assert args["additional_config"] == {"usd": {"drafter": "d", "draft_sampling": "greedy"}}


@pytest.mark.parametrize("additional,message", [
    (None, "has no 'usd' section"),
    ({}, "has no 'usd' section"),
    ({"usd": "x"}, "must be a JSON object"),
    ({"usd": {}}, "drafter is missing"),
    ({"usd": {"drafter": "d", "drafterr": 1}}, r"unknown key 'drafterr'.*Valid keys: drafter, drafter_runtime, drafter_gguf, drafter_gguf_type, drafter_dtype"),
    ({"usd": {"drafter": "d", "seed": "1"}}, r"usd\.seed must be int, got '1'"),
    ({"usd": {"drafter": "d", "pruned_head": 1}}, r"usd\.pruned_head must be bool"),
    ({"usd": {"drafter": "d", "seed": True}}, r"usd\.seed must be int"),
    ({"usd": {"drafter": "d", "draft_sampling": "random"}}, r"choose one of auto, greedy"),
    ({"usd": {"drafter": "d", "drafter_gguf_type": "q2_k"}}, r"drafter_gguf_type = .q2_k.; choose one of auto, file, q4_0"),
    ({"usd": {"drafter": "d", "drafter_kv_budget_gb": -1}}, r"drafter_kv_budget_gb must be in"),
    ({"usd": {"drafter": "d", "drafter_max_model_len": 0}}, r"drafter_max_model_len must be >= 1"),
    ({"usd": {"drafter": "d", "adaptive_length": "yes"}}, r"usd\.adaptive_length must be bool"),
    ({"usd": {"drafter": "d", "draft_cost": 0.1}}, r"draft_cost was removed: the draft-length controller measures"),
    ({"usd": {"drafter": "d", "confidence_stop": 1.0}}, r"confidence_stop must be in \[0, 1\) \(0: off\)"),
    ({"usd": {"drafter": "d", "draft_mode": "slem"}}, r"draft_mode = 'slem'; choose one of auto, tli, string"),
    ({"usd": {"drafter": "d", "string_draft_tokens": 0}}, r"string_draft_tokens must be >= 1"),
])
def test_bad_config_is_one_clear_line(additional, message):
    with pytest.raises(ValueError, match=message) as err:
        parse_usd_config(additional)
    assert "\n" not in str(err.value) and str(err.value).startswith("vllm-usd:")


@pytest.mark.parametrize("k", [0, 100])
def test_bad_num_speculative_tokens(k):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        vllm_usd.speculative_args(drafter="d", k=k)


def test_proposer_startup_errors(tmp_path):
    from vllm_usd import UniversalProposer
    from tests.fixtures import tiny

    target, drafter = tiny.tiny_pair("bpe", "sp")
    proposer = UniversalProposer(_vllm_config(target, {"drafter": drafter}))
    assert proposer.mapping.size > 0 and proposer.mapping.target_vocab_size == 1088

    with pytest.raises(ValueError, match="drafter folder not found"):
        UniversalProposer(_vllm_config(target, {"drafter": str(tmp_path / "nope" / "model")}))
    with pytest.raises(ValueError, match="at least 99%"):
        UniversalProposer(_vllm_config(target, {"drafter": drafter, "min_intersection": 0.99}))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        UniversalProposer(_vllm_config(target, {"drafter": drafter}, k=0))
    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        (no_tok / f).write_bytes((__import__("pathlib").Path(drafter) / f).read_bytes())
    with pytest.raises(ValueError, match="no readable tokenizer"):
        UniversalProposer(_vllm_config(target, {"drafter": str(no_tok)}))
    not_lm = tmp_path / "not-lm"
    not_lm.mkdir()
    (not_lm / "config.json").write_text('{"model_type": "vit", "hidden_size": 8, "num_hidden_layers": 1, '
                                        '"num_attention_heads": 1, "intermediate_size": 8}')
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (not_lm / f).write_bytes((__import__("pathlib").Path(drafter) / f).read_bytes())
    with pytest.raises(ValueError, match="not a causal language model"):
        UniversalProposer(_vllm_config(target, {"drafter": str(not_lm)}))


def test_custom_code_drafter_is_refused_without_trust_remote_code(tmp_path):
    """vllm-usd never turns trust_remote_code on by itself."""
    from vllm_usd.drafter import DrafterLoadError, load_drafter

    (tmp_path / "config.json").write_text(
        '{"model_type": "my_custom_lm", "auto_map": {"AutoConfig": "configuration_my.MyConfig", '
        '"AutoModelForCausalLM": "modeling_my.MyModel"}}')
    (tmp_path / "configuration_my.py").write_text("raise RuntimeError('custom code must not run')\n")
    with pytest.raises(DrafterLoadError, match="trust_remote_code"):
        load_drafter(str(tmp_path), trust_remote_code=False)
