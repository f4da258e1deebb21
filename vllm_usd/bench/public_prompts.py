"""Prompts nobody here wrote, shipped with Python itself, so every machine has them offline.

* **code**: functions from the standard library's own sources (the top-level ``*.py``
  modules of the running interpreter's ``Lib``), each cut before its body: the ``def``
  line(s) and the docstring, if any; the model writes the body.
* **prose**: paragraphs of ``pydoc_data.topics`` (the language reference's text that
  ``help()`` shows), each cut after its first half of words; the model continues it.
* **chat**: our own chat-style prompts (``data/bench_prompts.json``), for comparison.

Each category is taken at a fixed stride over its candidates in a fixed order (files
and topics sorted, functions in source order), so a run is reproducible on one Python
version; every prompt records where it came from (file and line, or topic and paragraph)
and ``sources()`` names the Python version, for the result file.
"""

from __future__ import annotations

import ast
import platform
import sysconfig
import textwrap
from pathlib import Path

CATEGORIES = ("code", "prose", "chat")
MAX_PROMPT_CHARS = 1200  # a longer signature and docstring is skipped (prompts stay a few hundred tokens)
MIN_BODY_LINES = 3  # a function whose body after the docstring is shorter leaves too little to write
MIN_PARAGRAPH_WORDS = 40


def stdlib_code(n: int) -> list[dict]:
    """``n`` functions of the standard library, cut before the body, at a fixed stride."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[dict] = []
    for path in sorted(root.glob("*.py")):
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        lines = source.splitlines(keepends=True)
        functions = [f for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for func in sorted(functions, key=lambda f: f.lineno):
            prompt = _cut_before_body(func, lines)
            if prompt is not None:
                found.append({"text": prompt, "source": f"{path.name}:{func.lineno}", "name": func.name})
    return _at_stride(found, n)


def _cut_before_body(func: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> str | None:
    body = func.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
        and isinstance(body[0].value.value, str)
    rest = body[1:] if has_doc else body
    if not rest or rest[-1].end_lineno - rest[0].lineno + 1 < MIN_BODY_LINES:
        return None
    text = textwrap.dedent("".join(lines[func.lineno - 1:rest[0].lineno - 1]))
    return text if 0 < len(text) <= MAX_PROMPT_CHARS else None


def pydoc_prose(n: int) -> list[dict]:
    """``n`` paragraphs of ``pydoc_data.topics``, each cut after its first half of words, at a fixed stride."""
    from pydoc_data.topics import topics

    found: list[dict] = []
    for topic in sorted(topics):
        for index, paragraph in enumerate(topics[topic].split("\n\n")):
            if paragraph.startswith(" ") or "*****" in paragraph or "-----" in paragraph:
                continue  # code, a signature's description, a heading
            words = paragraph.split()
            if len(words) >= MIN_PARAGRAPH_WORDS:
                found.append({"text": " ".join(words[:len(words) // 2]), "source": f"{topic}#{index}"})
    return _at_stride(found, n)


def own_chat(n: int) -> list[dict]:
    from vllm_usd.bench.plan import load_prompts

    prompts, meta = load_prompts()
    chat = [p["text"] for p in prompts if p["group"] == "chat"]
    return [{"text": text, "source": f"{meta['file']}:chat#{i}"} for i, text in enumerate(chat[:n])]


def _at_stride(found: list[dict], n: int) -> list[dict]:
    """Every (len / n)-th candidate, the first half a stride in: spread over the whole set."""
    if n <= 0 or not found:
        return []
    stride = max(len(found) // n, 1)
    return found[stride // 2::stride][:n]


def load_workloads(categories: tuple[str, ...] | list[str] = CATEGORIES, n: int = 8) -> dict[str, list[dict]]:
    """``n`` prompts per category: ``{"code": [{"text", "source"}, ...], ...}``."""
    make = {"code": stdlib_code, "prose": pydoc_prose, "chat": own_chat}
    unknown = set(categories) - set(make)
    if unknown:
        raise ValueError(f"unknown workload categories {sorted(unknown)}; choose from {list(CATEGORIES)}")
    return {c: make[c](n) for c in categories}


def sources(workloads: dict[str, list[dict]]) -> dict:
    """Where each prompt came from, for a result file."""
    return {"python": platform.python_version(), "stdlib": sysconfig.get_paths()["stdlib"],
            "prompts": {c: [p["source"] for p in ps] for c, ps in workloads.items()}}
