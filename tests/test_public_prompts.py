"""The public workloads (vllm_usd/bench/public_prompts.py): text nobody here wrote, shipped with Python."""

from __future__ import annotations

import ast

import pytest

from vllm_usd.bench.public_prompts import CATEGORIES, load_workloads, pydoc_prose, sources, stdlib_code


def test_code_prompts_are_stdlib_functions_cut_right_before_their_body():
    prompts = stdlib_code(12)
    assert len(prompts) == 12
    for p in prompts:
        text = p["text"]
        assert text.lstrip().startswith(("def ", "async def ")), text
        ast.parse(text + "    pass\n")  # a whole signature (and docstring): one body statement completes it
        file, _, line = p["source"].partition(":")
        assert file.endswith(".py") and int(line) > 0
    assert len({p["source"].split(":")[0] for p in prompts}) >= 6, "spread over the library, not one file"


def test_prose_prompts_are_halves_of_pydoc_paragraphs():
    from pydoc_data.topics import topics

    prompts = pydoc_prose(8)
    assert len(prompts) == 8 and len({p["source"] for p in prompts}) == 8
    for p in prompts:
        topic, _, index = p["source"].partition("#")
        paragraph = " ".join(topics[topic].split("\n\n")[int(index)].split())
        assert paragraph.startswith(p["text"]) and len(p["text"].split()) >= 20 and paragraph != p["text"]


def test_the_same_prompts_every_time_and_their_sources_recorded():
    first, again = load_workloads(n=6), load_workloads(n=6)
    assert first == again and list(first) == list(CATEGORIES) and all(len(v) == 6 for v in first.values())
    recorded = sources(first)
    assert recorded["python"] and recorded["prompts"]["code"] == [p["source"] for p in first["code"]]
    with pytest.raises(ValueError, match="unknown workload"):
        load_workloads(["poetry"])
