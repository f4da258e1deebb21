"""vLLM source trees for the fingerprint tests: copies of the installed one, and cached releases from PyPI.

``release_source("0.33.0")`` returns ``$VLLM_USD_CACHE/vllm-0.33.0-src`` (a folder
holding ``vllm/`` with only the files the fingerprints read), downloading the wheel
with pip on first use; it returns ``(None, reason)`` when the index cannot be reached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from vllm_usd import envs
from vllm_usd.vllm_adapter import fingerprints

VERSION_FILES = ("vllm/_version.py", "vllm/version.py")


def needed_files() -> list[str]:
    return sorted({rel for rel, _ in fingerprints.FUNCTIONS.values()} | set(VERSION_FILES))


def copy_installed(dest: Path) -> Path:
    """Copy the installed vLLM's fingerprinted files (and its version) into dest/vllm/...; returns dest."""
    root = fingerprints.installed_root()
    assert root is not None, "vLLM is not installed"
    for rel in needed_files():
        if (root / rel).exists():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(root / rel, dest / rel)
    return dest


def release_source(version: str) -> tuple[Path | None, str]:
    """(folder holding vllm/, "") for a vLLM release from PyPI, cached; (None, why) when it cannot be had."""
    cache = Path(os.path.expanduser(envs.cache_dir())) / f"vllm-{version}-src"
    marker = cache / "FILES"  # what was extracted; a cache from before a function was added is stale
    if marker.exists() and set(needed_files()) <= set(marker.read_text().split()):
        return cache, ""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", f"vllm=={version}", "-d", tmp,
               "--quiet", "--disable-pip-version-check"]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"pip download vllm=={version} failed: {exc}"
        wheels = list(Path(tmp).glob("vllm-*.whl"))
        if res.returncode != 0 or not wheels:
            tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["no wheel"]
            return None, f"cannot reach the package index for vllm=={version}: {tail[0]}"
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cache.parent))
        with zipfile.ZipFile(wheels[0]) as wheel:
            names = set(wheel.namelist())
            for rel in needed_files():
                if rel in names:
                    wheel.extract(rel, staging)
        (staging / "FILES").write_text("\n".join(needed_files()) + "\n")
        shutil.rmtree(cache, ignore_errors=True)
        try:
            staging.rename(cache)  # a cache folder that exists is complete
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # another process won the race
    return cache, ""
