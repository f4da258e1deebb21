"""vllm-usd analyze / serve (command construction). No engine."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

from transformers import AutoTokenizer

from vllm_usd.cli import main
from tests.fixtures import tiny
from vllm_usd.core import VocabMapping

SCHEMA = {"target", "drafter", "intersection", "intersection_share_of_target", "intersection_share_of_drafter",
          "byte_only_matches", "text_tokens", "text_tokens_shared", "text_share_shared", "text_share_retokenized",
          "param_ratio"}


def test_analyze_json_matches_vocab_mapping(capsys, tmp_path):
    target, drafter = tiny.tiny_pair("bpe", "sp")
    text = tmp_path / "t.txt"
    text.write_text("Hello world\n\tcafé 😀 東京\n", encoding="utf-8")
    assert main(["analyze", target, drafter, "--json", "--text", str(text)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == SCHEMA
    assert set(report["target"]) == {"path", "vocab_size", "tokenizer_size", "params"}
    m = VocabMapping.build(AutoTokenizer.from_pretrained(target), AutoTokenizer.from_pretrained(drafter),
                           target_vocab_size=1088, min_share=0.0)
    assert report["intersection"] == m.size and report["byte_only_matches"] == m.byte_only_matches
    assert report["target"]["vocab_size"] == 1088 and report["drafter"]["vocab_size"] == 1500
    ids = AutoTokenizer.from_pretrained(target)(text.read_text(encoding="utf-8"), add_special_tokens=False).input_ids
    assert report["text_tokens"] == len(ids)
    assert report["text_tokens_shared"] == sum(1 for i in ids if m.target_to_draft[i] >= 0)
    assert 0 < report["param_ratio"] < 2


def test_analyze_table(capsys):
    target, drafter = tiny.tiny_pair("sp", "bpe")
    assert main(["analyze", target, drafter]) == 0
    out = capsys.readouterr().out
    assert "shared tokens" in out and "matched by bytes only" in out


def test_serve_dry_run_prints_a_valid_vllm_command():
    res = subprocess.run([sys.executable, "-m", "vllm_usd.cli", "serve", "/models/t", "--drafter", "/models/d",
                          "-k", "4", "--usd", "draft_sampling=greedy", "--usd", "drafter_kv_budget_gb=1.5",
                          "--port", "8123", "--dry-run"], capture_output=True, text=True, check=True)
    cmd = shlex.split(res.stdout.strip().splitlines()[-1])
    assert cmd[1:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model"] and cmd[4] == "/models/t"
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    extra = json.loads(cmd[cmd.index("--additional-config") + 1])
    assert spec == {"method": "custom_class", "model": "vllm_usd.UniversalProposer", "num_speculative_tokens": 4}
    assert extra == {"usd": {"drafter": "/models/d", "draft_sampling": "greedy", "drafter_kv_budget_gb": 1.5}}
    assert cmd[-2:] == ["--port", "8123"]
    # vLLM's own argument parser accepts it
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(cmd[3:])
    assert args.model == "/models/t" and args.port == 8123


def test_serve_rejects_bad_settings(capsys):
    assert main(["serve", "/t", "--drafter", "/d", "--usd", "nope=1", "--dry-run"]) == 2
    assert "unknown key 'nope'" in capsys.readouterr().err
