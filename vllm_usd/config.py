"""The ``additional_config["usd"]`` settings, validated at start-up.

No vLLM import: the proposer passes in the plain dict.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

PROPOSER_CLASS = "vllm_usd.UniversalProposer"
CONFIG_KEY = "usd"
# The default bound on the rows a step drafts for. q is [rows, k, target vocabulary] float32 on every
# tensor-parallel rank: with Gemma-3 (262,144 tokens) at k = 5, 64 rows are 320 MiB, 0.4% of what vLLM
# uses of an 80 GiB H100 at gpu_memory_utilization 0.9, where vLLM's max_num_seqs (1024 by default on
# such a server) would be 5 GiB. Past 64 rows a step is compute-bound and drafting rarely pays.
DEFAULT_DRAFTER_MAX_NUM_SEQS = 64
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class UsdConfig:
    """Settings under ``additional_config={"usd": {...}}``.

    drafter:               local folder or hub id of the drafter (required).
    drafter_runtime:       "auto" (default: llama.cpp on the CPU when a GGUF is found, else transformers),
                           "transformers" or "llama_cpp" (see vllm_usd/drafter/select.py).
    drafter_gguf:          the drafter's GGUF file for llama.cpp (default: the one *.gguf in the drafter folder).
    drafter_gguf_type:     llama.cpp weight type: "auto" (default: the fastest of the types the native probe
                           times on this host, gguf_types.candidates), "file" (as it is), or a type to
                           requantize to: "q4_0", "iq4_nl", "q4_1", "q4_k_m", "q8_0", "f16", "bf16" (vllm_usd/drafter/gguf_types.py).
    drafter_dtype:         transformers weight format: "auto" (default: the fastest measured on the
                           device), "float32", "bfloat16", "float16", "int8" (CPU) or "config".
    drafter_revision:      hub revision of the drafter (model and tokenizer).
    drafter_max_model_len: cap on the drafter's context; requests past it get no drafts.
    draft_sampling:        "auto" drafts like the request samples; "greedy" always argmax.
    trust_remote_code:     for the drafter; defaults to the target's setting.
    drafter_kv_budget_gb:  memory for the drafter's KV cache; past it, requests get no drafts.
    drafter_max_num_seqs:  the most batch rows a step drafts for: it bounds the q buffer and the drafter's KV
                           pool, and a step with more rows drafts nothing; default: vLLM's max_num_seqs, at
                           most DEFAULT_DRAFTER_MAX_NUM_SEQS.
    min_intersection:      smallest shared share of the drafter vocabulary accepted.
    seed:                  seed for drafting in requests without their own seed.
    pruned_head:           compute drafter logits only for shared tokens (same q, less work); draft_mode "tli" only.
    profile:               time the proposer's phases (see UniversalProposer.timings).
    debug_digests:         record a digest of each step's drafts and q (tensor-parallel checks).
    adaptive_length:       each step, draft the length 0..k with the most measured tokens per second
                           (vllm_usd/drafting/controller.py); false: always k (num_speculative_tokens).
    confidence_stop:       a row stops drafting after a draft the drafter gave less than this probability
                           (intersection drafting; 0: off). q is unchanged: the stop only shortens drafts.
    draft_mode:            "auto" (default): string-level drafting for greedy requests (their drafter context
                           is their text as the drafter's tokenizer cuts it), intersection
                           drafting with q (TLI) for sampled ones; "tli": TLI for all; "string": string-level
                           drafting for all (sampled requests then verify point masses: lossless, fewer accepted).
    string_draft_tokens:   drafter tokens per request and step in string-level drafting; null: 2k+1.
    """

    drafter: str
    drafter_runtime: str = "auto"
    drafter_gguf: str | None = None
    drafter_gguf_type: str = "auto"
    drafter_dtype: str = "auto"
    drafter_revision: str | None = None
    drafter_max_model_len: int | None = None
    draft_sampling: str = "auto"
    trust_remote_code: bool | None = None
    drafter_kv_budget_gb: float = 2.0
    drafter_max_num_seqs: int | None = None
    min_intersection: float = 0.01
    seed: int = 0
    pruned_head: bool = True
    profile: bool = False
    debug_digests: bool = False
    adaptive_length: bool = True
    confidence_stop: float = 0.0
    draft_mode: str = "auto"
    string_draft_tokens: int | None = None


_TYPES: dict[str, tuple[type, ...]] = {
    "drafter": (str,),
    "drafter_runtime": (str,),
    "drafter_gguf": (str, type(None)),
    "drafter_gguf_type": (str,),
    "drafter_dtype": (str,),
    "drafter_revision": (str, type(None)),
    "drafter_max_model_len": (int, type(None)),
    "draft_sampling": (str,),
    "trust_remote_code": (bool, type(None)),
    "drafter_kv_budget_gb": (int, float),
    "drafter_max_num_seqs": (int, type(None)),
    "min_intersection": (int, float),
    "seed": (int,),
    "pruned_head": (bool,),
    "profile": (bool,),
    "debug_digests": (bool,),
    "adaptive_length": (bool,),
    "confidence_stop": (int, float),
    "draft_mode": (str,),
    "string_draft_tokens": (int, type(None)),
}
_REMOVED = ("draft_cost", "verify_token_cost", "compute_bound_tokens", "cost_calibration_steps", "probe_interval")
_CHOICES = {
    "drafter_runtime": ("auto", "transformers", "llama_cpp"),
    "drafter_gguf_type": ("auto", "file", "q4_0", "iq4_nl", "q4_1", "q4_k_m", "q8_0", "f16", "bf16"),
    "drafter_dtype": ("auto", "float32", "bfloat16", "float16", "int8", "config"),
    "draft_sampling": ("auto", "greedy"),
    "draft_mode": ("auto", "tli", "string"),
}


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def parse_usd_config(additional_config: Any) -> UsdConfig:
    """Validate ``additional_config`` and return the ``usd`` settings.

    Every problem is a one-line ValueError that names the key and the fix.
    """
    valid = ", ".join(f.name for f in fields(UsdConfig))
    if not isinstance(additional_config, dict) or CONFIG_KEY not in additional_config:
        raise ValueError(
            f"vllm-usd: additional_config has no '{CONFIG_KEY}' section. Pass "
            f"additional_config={{\"{CONFIG_KEY}\": {{\"drafter\": \"<folder or hub id>\"}}}} "
            f"(or --additional-config '{{\"{CONFIG_KEY}\": {{\"drafter\": ...}}}}'). Valid keys: {valid}."
        )
    raw = additional_config[CONFIG_KEY]
    if not isinstance(raw, dict):
        raise ValueError(f"vllm-usd: additional_config.{CONFIG_KEY} must be a JSON object, got {type(raw).__name__}.")
    for key in raw:
        if key in _REMOVED:
            raise ValueError(f"vllm-usd: additional_config.{CONFIG_KEY}.{key} was removed: the draft-length "
                             "controller measures what drafting costs on this engine. Delete the key.")
        if key not in _TYPES:
            raise ValueError(f"vllm-usd: unknown key '{key}' in additional_config.{CONFIG_KEY}. Valid keys: {valid}.")
    if "drafter" not in raw or not raw["drafter"]:
        raise ValueError(
            f"vllm-usd: additional_config.{CONFIG_KEY}.drafter is missing: set it to the drafter's local "
            "folder or hub id."
        )
    for key, value in raw.items():
        types = _TYPES[key]
        if isinstance(value, bool) and bool not in types:  # bool is an int subclass
            types = ()
        if not isinstance(value, types):
            raise ValueError(
                f"vllm-usd: additional_config.{CONFIG_KEY}.{key} must be {_type_names(_TYPES[key])}, "
                f"got {value!r} ({type(value).__name__})."
            )
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ValueError(
                f"vllm-usd: additional_config.{CONFIG_KEY}.{key} = {value!r}; choose one of {', '.join(_CHOICES[key])}."
            )
    cfg = UsdConfig(**raw)
    for key in ("drafter_max_model_len", "drafter_max_num_seqs", "string_draft_tokens"):
        value = getattr(cfg, key)
        if value is not None and value < 1:
            raise ValueError(f"vllm-usd: additional_config.{CONFIG_KEY}.{key} must be >= 1, got {value}.")
    if not 0 < cfg.drafter_kv_budget_gb <= 1024:
        raise ValueError(f"vllm-usd: additional_config.{CONFIG_KEY}.drafter_kv_budget_gb must be in (0, 1024].")
    if not 0 <= cfg.min_intersection <= 1:
        raise ValueError(f"vllm-usd: additional_config.{CONFIG_KEY}.min_intersection must be in [0, 1].")
    if not 0 <= cfg.confidence_stop < 1:
        raise ValueError(f"vllm-usd: additional_config.{CONFIG_KEY}.confidence_stop must be in [0, 1) (0: off).")
    return cfg


def check_num_speculative_tokens(k: int) -> None:
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"vllm-usd: num_speculative_tokens = {k}; use 1..{MAX_SPECULATIVE_TOKENS} (typically 2-5)."
        )


def check_no_sleep_mode(enabled: bool) -> None:
    """Sleep mode is refused: ``sleep(level=2)`` discards what the drafter allocated at start-up under vLLM's
    "weights" tag (its KV pool, and the q buffer whose columns outside the intersection must stay zero for the
    rejection sampler's residual to be right), and nothing would restore them on wake."""
    if enabled:
        raise ValueError("vllm-usd: enable_sleep_mode is not supported: sleeping would discard the drafter's KV "
                         "pool and q buffer; start vLLM without enable_sleep_mode.")


def speculative_args(drafter: str, k: int = 3, **usd: Any) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM(...)`` that turn vllm-usd on.

    >>> LLM(model=target, **speculative_args(drafter="path/to/small-model", k=3))
    """
    check_num_speculative_tokens(k)
    additional = {CONFIG_KEY: {"drafter": drafter, **usd}}
    parse_usd_config(additional)
    return {
        "speculative_config": {"method": "custom_class", "model": PROPOSER_CLASS, "num_speculative_tokens": k},
        "additional_config": additional,
    }
