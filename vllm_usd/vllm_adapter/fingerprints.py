"""Fingerprints of the vLLM functions vllm-usd's patches rely on, read from source without importing vLLM.

A fingerprint is the first 16 hex digits of the SHA-256 of the function's
normalised AST (``ast.dump`` without line numbers, docstrings removed), so a
reformatting or a comment does not change it and a changed statement does.
The fingerprints of every vLLM release vllm-usd was checked against are in
``vllm_usd/data/vllm_fingerprints.json``; a function matches when its
fingerprint is one of them. Record a new release's table with

    python -m vllm_usd.vllm_adapter.fingerprints DIR   # DIR holds vllm/
"""

from __future__ import annotations

import ast
import functools
import gc
import hashlib
import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

# function key -> (file under the folder that holds vllm/, qualified name in that file)
FUNCTIONS: dict[str, tuple[str, str]] = {
    "GPUModelRunner.propose_draft_token_ids": (
        "vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner.propose_draft_token_ids"),
    "GPUModelRunner._get_spec_decode_draft_probs": (
        "vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner._get_spec_decode_draft_probs"),
    "GPUModelRunner._sample": ("vllm/v1/worker/gpu_model_runner.py", "GPUModelRunner._sample"),
    "create_custom_proposer": ("vllm/v1/spec_decode/custom_class_proposer.py", "create_custom_proposer"),
    "VllmConfig._get_v2_model_runner_unsupported_features": (
        "vllm/config/vllm.py", "VllmConfig._get_v2_model_runner_unsupported_features"),
    "expand_batch_to_tokens": ("vllm/v1/sample/rejection_sampler.py", "expand_batch_to_tokens"),
    "apply_sampling_constraints": ("vllm/v1/sample/rejection_sampler.py", "apply_sampling_constraints"),
    "rejection_sample": ("vllm/v1/sample/rejection_sampler.py", "rejection_sample"),
    "sample_recovered_tokens": ("vllm/v1/sample/rejection_sampler.py", "sample_recovered_tokens"),
    "_sample_recovered_tokens": ("vllm/v1/sample/rejection_sampler.py", "_sample_recovered_tokens"),
    "EngineArgs.create_engine_config": ("vllm/engine/arg_utils.py", "EngineArgs.create_engine_config"),
    "EngineCore.step": ("vllm/v1/engine/core.py", "EngineCore.step"),
    "EngineCore.post_step": ("vllm/v1/engine/core.py", "EngineCore.post_step"),
    "MultiprocExecutor.sample_tokens": ("vllm/v1/executor/multiproc_executor.py", "MultiprocExecutor.sample_tokens"),
    "MultiprocExecutor.take_draft_token_ids": (
        "vllm/v1/executor/multiproc_executor.py", "MultiprocExecutor.take_draft_token_ids"),
    "Worker.sample_tokens": ("vllm/v1/worker/gpu_worker.py", "Worker.sample_tokens"),
    "Worker.take_draft_token_ids": ("vllm/v1/worker/gpu_worker.py", "Worker.take_draft_token_ids"),
}
MATCH, CHANGED, MISSING = "match", "changed", "missing"
_TABLE = Path(__file__).resolve().parents[1] / "data" / "vllm_fingerprints.json"


@functools.cache
def known() -> dict[str, dict[str, str]]:
    """{vLLM version: {function key: fingerprint}}, for every version vllm-usd was checked against."""
    return json.loads(_TABLE.read_text(encoding="utf-8"))["versions"]


def known_versions() -> list[str]:
    return sorted(known(), key=lambda v: tuple(int(p) if p.isdigit() else p for p in v.split(".")))


# --- computing ---------------------------------------------------------------------------------
def _strip_docstrings(node: ast.AST) -> ast.AST:
    for sub in ast.walk(node):
        body = getattr(sub, "body", None)
        if (isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            sub.body = body[1:] or [ast.Pass()]
    return node


def fingerprint_node(node: ast.AST) -> str:
    """Strips ``node``'s docstrings in place: its tree is parsed for this and dropped after."""
    dump = ast.dump(_strip_docstrings(node), include_attributes=False)
    return hashlib.sha256(dump.encode("utf-8")).hexdigest()[:16]


def _find(tree: ast.Module, qualname: str) -> ast.AST | None:
    node: ast.AST = tree
    for part in qualname.split("."):
        node = next((n for n in getattr(node, "body", ())
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part), None)
        if node is None:
            return None
    return node


@functools.lru_cache(maxsize=32)
def _fingerprints_in(path: str, mtime_ns: int, qualnames: tuple[str, ...]) -> dict[str, str | None]:
    """{qualified name: fingerprint, or None if absent} for functions of one file, from one parse.

    Every vLLM process computes these (``plugin.register``), for every user. Only the fingerprints are kept:
    keeping the trees held about 119,000 objects in each process. The collector is paused while the trees are
    built, as their objects set off collections that walk vLLM's whole heap. On a 2-CPU EPYC with vLLM imported,
    register() took 0.24-0.26 s, against 0.32-0.40 s before."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return dict.fromkeys(qualnames)
    collecting = gc.isenabled()
    gc.disable()
    try:
        tree = ast.parse(text, filename=path)
        nodes = {name: _find(tree, name) for name in qualnames}
        return {name: fingerprint_node(node) if node is not None else None for name, node in nodes.items()}
    except SyntaxError:
        return dict.fromkeys(qualnames)
    finally:
        if collecting:
            gc.enable()


def fingerprint(root: str | Path, key: str) -> str | None:
    """The fingerprint of function ``key`` in the tree at ``root`` (the folder holding vllm/); None if absent."""
    rel, qualname = FUNCTIONS[key]
    path = Path(root) / rel
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        return None
    in_file = tuple(sorted(name for file, name in FUNCTIONS.values() if file == rel))
    return _fingerprints_in(str(path), mtime, in_file)[qualname]


# --- checking ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class FunctionCheck:
    key: str
    file: str
    fingerprint: str | None
    status: str  # MATCH, CHANGED or MISSING
    versions: tuple[str, ...]  # the known versions whose fingerprint this one equals

    def as_dict(self) -> dict:
        return {"function": self.key, "file": self.file, "fingerprint": self.fingerprint,
                "status": self.status, "matches_versions": list(self.versions)}


def check(root: str | Path, keys) -> list[FunctionCheck]:
    out = []
    for key in keys:
        fp = fingerprint(root, key)
        versions = tuple(v for v in known_versions() if known()[v].get(key) == fp) if fp else ()
        status = MISSING if fp is None else MATCH if versions else CHANGED
        out.append(FunctionCheck(key, FUNCTIONS[key][0], fp, status, versions))
    return out


def refusal(checks: list[FunctionCheck], what: str) -> str | None:
    """One line naming every function that changed or is missing, or None when all match."""
    bad = [c for c in checks if c.status != MATCH]
    if not bad:
        return None
    named = "; ".join(f"{c.key} ({c.file}) {'is missing' if c.status == MISSING else 'changed'}" for c in bad)
    return (f"vllm-usd: {what} not applied: vLLM's {named}, compared with the vLLM versions known to work "
            f"({', '.join(known_versions())}). Run `vllm-usd doctor`; VLLM_USD_SKIP_FINGERPRINTS=1 applies it "
            "anyway, at your own risk.")


# --- where vLLM is ---------------------------------------------------------------------------------
def installed_root() -> Path | None:
    """The folder that holds the installed vllm/ package, found without importing it."""
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).resolve().parent.parent


def source_version(root: str | Path) -> str:
    """The version in vllm/_version.py (or vllm/version.py) of a tree, read without importing it."""
    for name in ("_version.py", "version.py"):
        try:
            tree = ast.parse((Path(root) / "vllm" / name).read_text(encoding="utf-8"))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) and node.value is not None else []
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if names & {"__version__", "version"} and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                return node.value.value
    return "unknown"


def record(root: str | Path) -> dict[str, dict[str, str | None]]:
    """{version: {function key: fingerprint}} of a tree, in the table's format."""
    return {source_version(root).split("+")[0]: {key: fingerprint(root, key) for key in FUNCTIONS}}


if __name__ == "__main__":
    print(json.dumps(record(sys.argv[1] if len(sys.argv) > 1 else installed_root()), indent=2))
