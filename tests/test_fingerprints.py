"""The fingerprint guard: the installed vLLM passes, a changed or missing function is refused by name. No engine."""

from __future__ import annotations

import logging

import pytest

from tests import vllm_sources
from vllm_usd.vllm_adapter import compat, fingerprints, patches

RUNNER = "vllm/v1/worker/gpu_model_runner.py"
SAMPLER = "vllm/v1/sample/rejection_sampler.py"
DRAFT_PROBS_LINE = "        if self._draft_probs is None or self._draft_prob_req_ids is None:\n"


def _edit(path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} is not once in {path}"
    path.write_text(text.replace(old, new))


@pytest.fixture
def tree(tmp_path):
    """A copy of the installed vLLM's fingerprinted files, to alter."""
    return vllm_sources.copy_installed(tmp_path / "src")


@pytest.fixture
def use_tree(monkeypatch):
    """Make ``tree`` the vLLM that patches.apply checks, in a process where nothing is applied yet."""
    def use(root):
        monkeypatch.setattr(fingerprints, "installed_root", lambda: root)
        monkeypatch.setattr(patches, "_applied", set())
    return use


def test_the_installed_vllm_matches_every_patch():
    version = fingerprints.source_version(fingerprints.installed_root())
    assert version == compat.vllm_version().split("+")[0] == "0.32.0"
    for name in patches.PATCHES:
        checks = patches.check(name)
        assert [c.status for c in checks] == ["match"] * len(checks), (name, checks)
        assert all(version in c.versions for c in checks), (name, checks)
        assert patches.refusal(name) is None


def test_the_table_holds_both_supported_releases_and_every_function():
    assert fingerprints.known_versions() == ["0.32.0", "0.33.0"]
    for version, table in fingerprints.known().items():
        assert set(table) == set(fingerprints.FUNCTIONS), version
    needed = {key for patch in patches.PATCHES.values() for key in patch.needs}
    assert needed == set(fingerprints.FUNCTIONS), "every fingerprinted function is needed by a patch, and back"


def test_a_copy_of_the_installed_tree_passes(tree):
    assert fingerprints.source_version(tree) == "0.32.0"
    assert all(patches.refusal(name, tree) is None for name in patches.PATCHES)


def test_no_parsed_tree_outlives_the_check(tree):
    """Every vLLM process checks the fingerprints: it keeps them, not the parsed files (which were about
    119,000 objects)."""
    import ast
    import gc

    def trees() -> int:
        gc.collect()
        return sum(isinstance(o, ast.AST) for o in gc.get_objects())

    before = trees()
    checks = fingerprints.check(tree, fingerprints.FUNCTIONS)
    assert [c.status for c in checks] == ["match"] * len(fingerprints.FUNCTIONS)
    assert trees() - before < 100


def test_comments_docstrings_and_layout_do_not_change_a_fingerprint(tree):
    before = fingerprints.fingerprint(tree, "GPUModelRunner._get_spec_decode_draft_probs")
    _edit(tree / RUNNER, DRAFT_PROBS_LINE, "        # a comment\n\n" + DRAFT_PROBS_LINE.replace("is None or", "is None  or"))
    _edit(tree / SAMPLER, '    """Expand [batch_size] tensor to [num_tokens] tensor', '    """Expand a [batch_size] tensor')
    assert fingerprints.fingerprint(tree, "GPUModelRunner._get_spec_decode_draft_probs") == before
    assert patches.refusal("cpu_expand_fix", tree) is None


def test_an_altered_function_is_refused_by_name(tree):
    _edit(tree / RUNNER, DRAFT_PROBS_LINE, "        if self._draft_probs is None:\n")
    checks = {c.key: c for c in patches.check("runner_hook", tree)}
    assert checks["GPUModelRunner._get_spec_decode_draft_probs"].status == "changed"
    assert checks["GPUModelRunner.propose_draft_token_ids"].status == "match", "only the altered one"
    line = patches.refusal("runner_hook", tree)
    assert line is not None and "\n" not in line
    assert "GPUModelRunner._get_spec_decode_draft_probs (vllm/v1/worker/gpu_model_runner.py) changed" in line
    assert "patch runner_hook" in line and "0.32.0, 0.33.0" in line
    assert "propose_draft_token_ids" not in line
    assert patches.refusal("cpu_expand_fix", tree) is None and patches.refusal("frontend_check", tree) is None


@pytest.mark.parametrize("how", ["renamed", "file_deleted"])
def test_a_missing_function_is_refused(tree, how):
    if how == "renamed":
        _edit(tree / SAMPLER, "def expand_batch_to_tokens(", "def expand_batch_to_tokens_v2(")
    else:
        (tree / SAMPLER).unlink()
    [c] = patches.check("cpu_expand_fix", tree)
    assert c.status == "missing" and c.fingerprint is None
    line = patches.refusal("cpu_expand_fix", tree)
    assert "expand_batch_to_tokens (vllm/v1/sample/rejection_sampler.py) is missing" in line


def test_apply_and_the_proposer_refuse_an_altered_vllm(tree, use_tree):
    from vllm_usd import UniversalProposer

    _edit(tree / RUNNER, DRAFT_PROBS_LINE, "        if self._draft_probs is None:\n")
    use_tree(tree)
    with pytest.raises(compat.UnsupportedVllmVersion, match=r"_get_spec_decode_draft_probs .* changed"):
        patches.apply(["runner_hook"])
    assert "runner_hook" not in patches.applied()
    with pytest.raises(compat.UnsupportedVllmVersion, match="_get_spec_decode_draft_probs"):
        UniversalProposer(object())  # refused before it reads the config


def test_register_warns_names_the_function_and_stays_inactive(tree, use_tree, monkeypatch, caplog):
    from vllm_usd.vllm_adapter import plugin

    installed = []
    for name, patch in list(patches.PATCHES.items()):  # record instead of touching vLLM's classes
        monkeypatch.setitem(patches.PATCHES, name, patches.Patch(lambda n=name: installed.append(n) or True,
                                                                 patch.needs, patch.applies))
    _edit(tree / RUNNER, DRAFT_PROBS_LINE, "        if self._draft_probs is None:\n")
    use_tree(tree)
    monkeypatch.setattr(plugin, "_registered", False)
    with caplog.at_level(logging.INFO, logger="vllm.usd"):
        plugin.register()
        plugin.register()  # re-entrant: nothing twice
    assert installed == ["frontend_check", "drafts_with_sampled_tokens"], "only the patches whose functions match"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("_get_spec_decode_draft_probs" in w and "patch runner_hook" in w for w in warnings), warnings
    assert any("stays inactive" in w for w in warnings), warnings
    assert not any("vllm-usd: active on" in r.getMessage() for r in caplog.records)


def test_the_escape_hatch_applies_anyway_and_says_so(tree, use_tree, monkeypatch, caplog):
    _edit(tree / SAMPLER, "def expand_batch_to_tokens(", "def expand_batch_to_tokens_v2(")
    use_tree(tree)
    monkeypatch.setenv("VLLM_USD_SKIP_FINGERPRINTS", "1")
    with caplog.at_level(logging.WARNING, logger="vllm.usd"):
        assert patches.refusal("cpu_expand_fix") is None
    [warning] = [r.getMessage() for r in caplog.records]
    assert "VLLM_USD_SKIP_FINGERPRINTS=1" in warning and "expand_batch_to_tokens" in warning


def test_version_is_read_without_importing(tmp_path):
    (tmp_path / "vllm").mkdir()
    assert fingerprints.source_version(tmp_path) == "unknown"
    (tmp_path / "vllm" / "version.py").write_text("__version__ = '9.9.9'\n")
    assert fingerprints.source_version(tmp_path) == "9.9.9"
    (tmp_path / "vllm" / "_version.py").write_text("__version__ = version = '0.33.0'\n")
    assert fingerprints.source_version(tmp_path) == "0.33.0"
