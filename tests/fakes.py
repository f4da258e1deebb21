"""Stand-ins for the vLLM objects the proposer reads, to test it without an engine."""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace

import numpy as np


def vllm_config(target: str, usd: dict | None, k: int = 3, max_num_seqs: int = 8, method: str = "custom_class",
                proposer: str = "vllm_usd.UniversalProposer"):
    """usd=None: no ``usd`` section in additional_config."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(target).vocab_size
    drafter = (usd or {}).get("drafter")
    if drafter and os.path.isdir(drafter) and not glob.glob(os.path.join(drafter, "*.gguf")) \
            and "drafter_gguf" not in usd:
        usd = {"drafter_runtime": "transformers", **usd}  # as tests/engines.py: no conversion here
    model_config = SimpleNamespace(tokenizer=target, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: vocab, max_model_len=512)
    return SimpleNamespace(
        additional_config={} if usd is None else {"usd": usd}, model_config=model_config,
        speculative_config=SimpleNamespace(num_speculative_tokens=k, method=method, model=proposer),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
    )


def sampling(temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
             max_tokens: int | None = 1000):
    return SimpleNamespace(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=max_tokens)


class FakeRunner:
    """input_batch.req_ids and .temperature_cpu + requests[req_id].sampling_params, and the token history arrays."""

    def __init__(self, max_len: int = 512):
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests: dict[str, SimpleNamespace] = {}
        self.history: dict[str, list[int]] = {}
        self.max_len = max_len
        self.last_drafts: dict[str, list[int]] = {}  # what the target verifies in the next step

    def add(self, req_id: str, prompt: list[int], params=None) -> None:
        self.requests[req_id] = SimpleNamespace(sampling_params=params or sampling(), num_prompt_tokens=len(prompt))
        self.history[req_id] = list(prompt)
        self.input_batch.req_ids.append(req_id)

    def remove(self, req_id: str) -> None:
        self.requests.pop(req_id, None)
        self.history.pop(req_id, None)
        self.input_batch.req_ids.remove(req_id)

    def step(self, proposer, new_tokens: dict[str, list[int]], finished=(), preempted=(), prefill=()):
        """Append tokens, then call propose as vLLM's runner would. Returns the drafts by req_id."""
        for req_id, toks in new_tokens.items():
            self.history[req_id].extend(toks)
        ids = self.input_batch.req_ids
        n = len(ids)
        num = np.array([len(self.history[r]) for r in ids], dtype=np.int32)
        arr = np.zeros((max(n, 1), self.max_len), dtype=np.int32)
        for i, r in enumerate(ids):
            arr[i, : len(self.history[r])] = self.history[r]
        sampled = [[] if r in prefill else (new_tokens.get(r) or self.history[r][-1:]) for r in ids]
        spec = {r: self.last_drafts.get(r, []) for r in ids if r not in prefill}
        scheduled = {r: len(self.history[r]) if r in prefill else 1 + len(spec[r]) for r in ids}
        # vLLM's InputBatch keeps each row's temperature, 0.0 for a greedy request
        self.input_batch.temperature_cpu = np.array([self.requests[r].sampling_params.temperature or 0.0
                                                     for r in ids] + [0.0], dtype=np.float32)
        proposer.bind_step(self, SimpleNamespace(finished_req_ids=set(finished), preempted_req_ids=set(preempted),
                                                 num_scheduled_tokens=scheduled, scheduled_spec_decode_tokens=spec))
        drafts = proposer.propose(sampled, num, arr)
        self.last_drafts = dict(zip(ids, drafts))
        return dict(zip(ids, drafts))


def small_gguf(path, n_bytes: int | None = None) -> str:
    """A small, whole GGUF (two tensors) at ``path``; with ``n_bytes``, only its first n_bytes
    (a negative count: all but the last -n_bytes)."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for name in ("token_embd.weight", "output.weight"):
        writer.add_tensor(name, np.ones((64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if n_bytes is not None:
        data = path.read_bytes()
        path.write_bytes(data[:n_bytes if n_bytes >= 0 else len(data) + n_bytes])
    return str(path)
