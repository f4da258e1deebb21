"""Weight formats for the transformers drafter: int8 linear layers on the CPU.

Quantizing the drafter keeps the output lossless: q is the quantized drafter's
own distribution, and that is what the rejection sampler is handed.

torch's own dynamic int8 ``Linear`` (``torch.ao.quantization.quantize_dynamic``)
is used, though torch marks it deprecated in favour of ``torchao``: measured
here (torch 2.13 CPU, torchao 0.18, two 576x1536 layers at batch 1, eager),
torchao's ``Int8DynamicActivationInt8WeightConfig`` takes 5.9 ms a call against
0.13 ms for torch's own, because torchao's CPU int8 path is made for
``torch.compile``. Revisit when torchao's eager CPU kernels catch up.
"""

from __future__ import annotations

import warnings

import torch


def quantize_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 (weights int8, activations quantized per call) for every ``nn.Linear`` but the head.

    The head stays in its float format: the runtime prunes it to the intersection and
    multiplies it itself (see HFDrafterRuntime.set_output_rows).
    """
    head = model.get_output_embeddings()
    body = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, model.base_model_prefix)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.ao.quantization is deprecated for torchao
        quantized = torch.ao.quantization.quantize_dynamic(body, {torch.nn.Linear}, dtype=torch.qint8)
    setattr(model, model.base_model_prefix, quantized)
    assert model.get_output_embeddings() is head
    model.vllm_usd_int8 = "torch.ao"
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's weights as stored (int8 linear layers count one byte a weight)."""
    total = 0
    seen: set[int] = set()
    for module in model.modules():
        packed = getattr(module, "_packed_params", None)
        if packed is not None and callable(getattr(module, "weight", None)):  # torch.ao dynamic int8 Linear
            w = module.weight()
            total += w.numel() * w.element_size()
            continue
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total
