"""The drafter's memory, decided at start-up: checked against what vLLM will use, allocated, logged.

vLLM sizes its own KV cache from the memory left after ``load_model`` and its
profiling run. The proposer's ``load_model`` calls ``allocate_drafter_memory``,
so the drafter's KV pool and the q buffer are counted in that measurement, and
neither grows afterwards. A setting that cannot fit is refused here, with the
numbers and what to change, instead of failing mid-serving.
"""

from __future__ import annotations

import torch

from vllm_usd.drafter.base import DrafterRuntime
from vllm_usd.vllm_adapter.q_buffer import DraftProbsBuffer

_MIB = 1 << 20


def memory_left(device: torch.device, utilization: float) -> int | None:
    """What the drafter may still take on ``device``; None where it cannot be read. On a GPU that is vLLM's
    budget (``gpu_memory_utilization`` x the card) less what is taken already, by anyone: memory free now
    beyond the budget is not ours to take. On the CPU, what the host has available."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return int(utilization * total) - (int(total) - int(free))
    if device.type == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    return None


def allocate_drafter_memory(runtime: DrafterRuntime, q_buffer: DraftProbsBuffer, utilization: float = 0.9) -> str:
    """Allocate the drafter's KV cache and the q buffer in full, or refuse; returns the start-up log line.
    ``utilization``: vLLM's gpu_memory_utilization."""
    kv, q = runtime.planned_kv_bytes, q_buffer.planned_bytes
    need = (kv - runtime.kv_bytes) + (q - q_buffer.nbytes)
    left = memory_left(runtime.device, utilization)
    if left is not None and need > left:
        where = (f"of vLLM's budget (gpu_memory_utilization {utilization:g}) {max(left, 0) / _MIB:.0f} MiB is left"
                 if runtime.device.type == "cuda" else f"{left / _MIB:.0f} MiB is available")
        raise ValueError(
            f"vllm-usd: the drafter's memory does not fit on {runtime.device}: it needs {need / _MIB:.0f} MiB "
            f"(KV cache {kv / _MIB:.0f} MiB, q buffer {q / _MIB:.0f} MiB = drafter_max_num_seqs {q_buffer.max_rows} "
            f"x k {q_buffer.k} x target vocabulary {q_buffer.vocab} x 4 B) and {where}. Lower "
            f"additional_config.usd.drafter_kv_budget_gb, usd.drafter_max_num_seqs or num_speculative_tokens.")
    runtime.allocate()
    q_buffer.allocate()
    return describe(runtime, q_buffer)


def describe(runtime: DrafterRuntime, q_buffer: DraftProbsBuffer) -> str:
    """One line: each allocation's size and what it holds."""
    from vllm_usd.drafter.attention import KERNEL
    from vllm_usd.drafter.hf_runtime import BLOCK_SIZE, HFDrafterRuntime

    kv = runtime.planned_kv_bytes
    parts = []
    if isinstance(runtime, HFDrafterRuntime):
        parts.append(f"KV cache {kv / _MIB:.1f} MiB ({runtime.num_blocks} blocks of {BLOCK_SIZE} tokens, "
                     f"{runtime.num_blocks * BLOCK_SIZE} tokens across requests; attention: {KERNEL})")
        parts.append(f"catch-up workspace {runtime.workspace_bytes / _MIB:.1f} MiB")
        graphs = runtime.graphs
        parts.append("no decode graphs" if graphs is None or graphs.failed else
                     f"{graphs.captures} drafter graphs ({'/'.join(map(str, graphs.token_counts))} tokens per row x "
                     f"{len(graphs.buckets)} batch sizes x {len(graphs.widths)} table widths) "
                     f"{graphs.nbytes / _MIB:.1f} MiB")
    else:
        parts.append(f"KV cache {kv / _MIB:.1f} MiB (llama.cpp's own, fixed when it loaded)")
    parts.append(f"q buffer {q_buffer.planned_bytes / _MIB:.1f} MiB (drafter_max_num_seqs {q_buffer.max_rows} x k "
                 f"{q_buffer.k} x target vocabulary {q_buffer.vocab} x 4 B)" if q_buffer.needed
                 else "no q buffer (no draft carries a q)")
    return f"vllm-usd: drafter memory on {runtime.device}, fixed from start-up: {'; '.join(parts)}"
