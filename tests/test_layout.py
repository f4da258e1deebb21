"""The package's shape: the vLLM-free folders stay vLLM-free, files stay small, no test switches ship."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vllm_usd"
VLLM_FREE = ("core", "drafting", "drafter", "analysis")
IMPORTS_VLLM = re.compile(r"^\s*(from\s+vllm(\.|\s)|import\s+vllm(\.|\s|$))", re.MULTILINE)


def _sources(folder: Path = PACKAGE) -> list[Path]:
    return sorted(folder.rglob("*.py"))


@pytest.mark.parametrize("folder", VLLM_FREE)
def test_vllm_free_folders_import_no_vllm(folder):
    files = _sources(PACKAGE / folder)
    assert files, f"vllm_usd/{folder} is empty"
    offenders = [str(f.relative_to(PACKAGE)) for f in files if IMPORTS_VLLM.search(f.read_text())]
    assert not offenders, f"these import vLLM: {offenders}"


def test_the_import_check_sees_a_vllm_import():
    """Power check for the grep above: it must match the ways vLLM gets imported, and not vllm_usd."""
    for line in ("import vllm", "from vllm import LLM", "    from vllm.v1 import x", "import vllm.platforms"):
        assert IMPORTS_VLLM.search(line), line
    for line in ("from vllm_usd.core import VocabMapping", "import vllm_usd", "# vllm is not imported"):
        assert not IMPORTS_VLLM.search(line), line


def test_no_package_file_is_over_400_lines():
    long = {str(f.relative_to(PACKAGE)): n for f in _sources() if (n := len(f.read_text().splitlines())) > 400}
    assert not long, long


def test_no_test_fault_switch_ships():
    hits = [str(f.relative_to(PACKAGE)) for f in _sources() if "TEST_FAULT" in f.read_text()]
    assert not hits, hits


def test_environment_variables_are_read_only_in_envs():
    """Every VLLM_USD_* variable is named in envs.py and nowhere else in the package."""
    from vllm_usd import envs

    for f in _sources():
        if f.name == "envs.py":
            continue
        text = f.read_text()
        assert "os.environ.get(\"VLLM_USD" not in text and "getenv(\"VLLM_USD" not in text, f
        for name in re.findall(r"\bVLLM_USD_[A-Z_]+", text):
            assert name in envs.ALL, f"{f.relative_to(PACKAGE)} names {name}, which envs.py does not list"


def test_the_drafting_folder_stays_within_1000_lines_and_11_numeric_constants():
    """Issue 31: a controller a maintainer can explain. Numeric module constants: NAME = <number or tuple of numbers>.
    Issue 40 added the eleventh, LOSS_BUDGET: the stated bound on what exploring may cost."""
    files = _sources(PACKAGE / "drafting")
    lines = sum(len(f.read_text().splitlines()) for f in files)
    numeric = re.compile(r"^[A-Z][A-Z0-9_]*\s*(:[^=]+)?=\s*[-(\d]", re.MULTILINE)
    constants = [m.group(0) for f in files for m in numeric.finditer(f.read_text())]
    assert lines <= 1000, lines
    assert len(constants) <= 11, constants
    assert numeric.search("EXPLORE_EVERY = 32") and numeric.search("PRIOR = (1.0, 2.0)"), "power check"


def _adapter_imports() -> dict[str, set[str]]:
    """vllm_adapter module -> the vllm_adapter modules it imports anywhere (function bodies included)."""
    import ast

    folder = PACKAGE / "vllm_adapter"
    modules = {f.stem for f in _sources(folder) if f.stem != "__init__"}
    edges: dict[str, set[str]] = {}
    for name in modules:
        found = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "vllm_usd.vllm_adapter":
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm_usd.vllm_adapter."):
                found.add(node.module.rsplit(".", 1)[1])
            elif isinstance(node, ast.Import):
                found |= {a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("vllm_usd.vllm_adapter.")}
        edges[name] = found & modules - {name}
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as a path that ends where it starts; None when there is none."""
    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node):] + [node]
        for nxt in sorted(edges.get(node, ())):
            found = visit(nxt, path + [node])
            if found:
                return found
        return None

    for start in sorted(edges):
        found = visit(start, [])
        if found:
            return found
    return None


def test_no_import_circle_in_the_vllm_adapter():
    """Issue 38: patches.py knew the front end, which knew the proposer, which knew patches.py."""
    edges = _adapter_imports()
    assert edges["proposer"] >= {"patches", "compat"}, "power check: the walk sees top-level imports"
    assert "failures" in edges["frontend"], "power check: the walk sees imports inside functions"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"], "power check"
    assert _cycle(edges) is None, " -> ".join(_cycle(edges))


def test_each_adapter_module_imports_on_its_own():
    import subprocess
    import sys

    code = "import importlib, sys; importlib.import_module('vllm_usd.vllm_adapter.' + sys.argv[1])"
    procs = {name: subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, cwd=PACKAGE.parent)
             for name in sorted(_adapter_imports())}
    failed = {name: p.communicate()[1].strip().splitlines()[-1:] for name, p in procs.items()}
    assert not {name: err for name, err in failed.items() if procs[name].returncode}, failed
