"""``vllm-usd analyze``: what a target/drafter pair shares, and the acceptance it can expect."""

from __future__ import annotations

from typing import Any

SAMPLE_TEXT = """\
The quick brown fox jumps over the lazy dog. Speculative decoding lets a small model
propose tokens that a large model checks in one step.
def mean(xs):
\treturn sum(xs) / len(xs)  # average
Les élèves étudient à l'école. Die Straße ist naß. 東京は日本の首都です。 😀
{"key": [1, 2, 3], "ok": true}
"""


def analyze_pair(target: str, drafter: str, text: str, trust_remote_code: bool = False) -> dict[str, Any]:
    """Vocabulary statistics for a pair; the numbers ``vllm-usd analyze`` prints."""
    from transformers import AutoConfig, AutoTokenizer

    from vllm_usd.core import VocabMapping

    t_tok = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    d_tok = AutoTokenizer.from_pretrained(drafter, trust_remote_code=trust_remote_code)
    configs = {}
    for name, path in (("target", target), ("drafter", drafter)):
        try:
            configs[name] = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError):
            configs[name] = None
    t_size = getattr(configs["target"], "vocab_size", None)
    d_size = getattr(configs["drafter"], "vocab_size", None)
    m = VocabMapping.build(t_tok, d_tok, target_vocab_size=t_size, draft_vocab_size=d_size, min_share=0.0)
    ids = t_tok(text, add_special_tokens=False).input_ids
    shared = sum(1 for i in ids if m.target_to_draft[i] >= 0)

    def params(cfg) -> int | None:
        if cfg is None:
            return None
        try:
            from accelerate import init_empty_weights  # type: ignore[import-not-found]
        except ImportError:
            return _estimate_params(cfg)
        from transformers import AutoModelForCausalLM

        with init_empty_weights():
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())

    t_params, d_params = params(configs["target"]), params(configs["drafter"])
    return {
        "target": {"path": target, "vocab_size": m.target_vocab_size, "tokenizer_size": len(t_tok), "params": t_params},
        "drafter": {"path": drafter, "vocab_size": m.draft_vocab_size, "tokenizer_size": len(d_tok), "params": d_params},
        "intersection": m.size,
        "intersection_share_of_target": m.size / m.target_vocab_size,
        "intersection_share_of_drafter": m.size / m.draft_vocab_size,
        "byte_only_matches": m.byte_only_matches,
        "text_tokens": len(ids),
        "text_tokens_shared": shared,
        "text_share_shared": shared / len(ids) if ids else None,
        "text_share_retokenized": (len(ids) - shared) / len(ids) if ids else None,
        "param_ratio": d_params / t_params if d_params and t_params else None,
    }


def _estimate_params(cfg) -> int | None:
    """Rough decoder-only parameter count from the config (no weights loaded)."""
    try:
        h, n, v = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
        inter = getattr(cfg, "intermediate_size", 4 * h)
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or h // heads
        kv = (getattr(cfg, "num_key_value_heads", None) or heads) * head_dim
        per_layer = h * heads * head_dim * 2 + 2 * h * kv + 3 * h * inter
        tied = getattr(cfg, "tie_word_embeddings", True)
        return n * per_layer + v * h * (1 if tied else 2)
    except AttributeError:
        return None


def print_analysis(report: dict[str, Any]) -> None:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    rows = [
        ("target vocab (logits / tokenizer)", f"{report['target']['vocab_size']} / {report['target']['tokenizer_size']}"),
        ("drafter vocab (logits / tokenizer)", f"{report['drafter']['vocab_size']} / {report['drafter']['tokenizer_size']}"),
        ("shared tokens", str(report["intersection"])),
        ("  % of target vocab", pct(report["intersection_share_of_target"])),
        ("  % of drafter vocab", pct(report["intersection_share_of_drafter"])),
        ("  matched by bytes only (Ċ ~ <0x0A> ...)", str(report["byte_only_matches"])),
        ("sample text: target tokens", str(report["text_tokens"])),
        ("  in the intersection", pct(report["text_share_shared"])),
        ("  re-tokenized for the drafter", pct(report["text_share_retokenized"])),
        ("drafter / target parameters", "n/a" if report["param_ratio"] is None else f"{report['param_ratio']:.3f}"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"target : {report['target']['path']}\ndrafter: {report['drafter']['path']}")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    acc = report.get("acceptance")
    if acc:
        print(f"\nestimated acceptance length (teacher-forced on {acc['positions']} positions; "
              f"greedy match {pct(acc['greedy_match_rate'])}, mean sum min(p,q) {acc['mean_alpha']:.2f})")
        print("   k  greedy  sampled(T=1)")
        for k, g in acc["greedy_acceptance_length"].items():
            print(f"  {k:>2}  {g:6.2f}  {acc['sampled_acceptance_length'][k]:6.2f}")
        print(f"recommended k at drafter/target cost ratio {acc['cost_ratio_used']:.3f}: "
              f"{acc['recommended_k_greedy']} (greedy), {acc['recommended_k_sampled']} (sampled)")


def estimate_for_text(target: str, drafter: str, text: str, cost_ratio: float | None,
                      trust_remote_code: bool = False) -> dict[str, Any]:
    """Teacher-forced acceptance estimate on ``text`` (see vllm_usd.analysis.acceptance)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_usd.analysis.acceptance import estimate_acceptance
    from vllm_usd.drafter import load_drafter

    t_tok = AutoTokenizer.from_pretrained(target, trust_remote_code=trust_remote_code)
    t_model = AutoModelForCausalLM.from_pretrained(target, trust_remote_code=trust_remote_code).eval()
    d_model, d_tok = load_drafter(drafter, trust_remote_code=trust_remote_code)
    ids = t_tok(text).input_ids
    chunks = [ids[i:i + 256] for i in range(0, len(ids), 256)]
    est = estimate_acceptance(t_model, t_tok, d_model, d_tok, chunks)
    ratio = cost_ratio if cost_ratio else 0.1
    return {
        "positions": est.positions, "greedy_match_rate": est.greedy_match_rate, "mean_alpha": est.mean_alpha,
        "greedy_acceptance_length": est.greedy_length, "sampled_acceptance_length": est.sampled_length,
        "cost_ratio_used": ratio, "recommended_k_greedy": est.recommend_k(ratio, greedy=True),
        "recommended_k_sampled": est.recommend_k(ratio, greedy=False),
    }
