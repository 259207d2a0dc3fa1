"""transformers' SDPA attention, reading grouped-query key and value heads in place on a CPU.

With an attention mask (every padded batch: the generation backend's decoding rows, the
learner's prompts), transformers' "sdpa" attention copies each key and value head once per
query head it serves before calling `scaled_dot_product_attention`; for SmolLM2 (9 query heads,
3 key-value heads) that copy is most of the attention time of a decoding step. PyTorch's CPU
kernels take grouped heads as they are (`enable_gqa=True`), with the same results.
`use_grouped_query_sdpa(model)` switches a model from "sdpa" to "sdpa_gqa", this module's
attention, which does exactly what "sdpa" does except that copy, and only on a CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "sdpa_gqa"


def grouped_query_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`sdpa_attention_forward` of transformers, with grouped key-value heads read in place.

    Only the case that copies heads changes: a boolean attention mask, grouped heads, a CPU,
    no position bias and no paged cache. Then, as transformers does with a mask, attention is
    not causal by flag (the mask holds causality). Everything else goes to transformers.
    """
    plain = (
        attention_mask is not None
        and attention_mask.dtype == torch.bool
        and query.device.type == "cpu"
        and getattr(module, "num_key_value_groups", 1) > 1
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
        and not kwargs.get("output_attentions", False)
    )
    if not plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    output_B_H_Q_D = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=True,
    )
    return output_B_H_Q_D.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_query_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_grouped_query_sdpa(model: Any) -> bool:
    """Switch `model` (or the model inside a PEFT wrapper) from "sdpa" to "sdpa_gqa".

    Results are unchanged; only the head copies go. Models on another attention (eager,
    flash) are left as they are. The saved config does not record the switch. Returns whether
    the model was switched.
    """
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(inner, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if not hasattr(inner, "set_attn_implementation"):
        return False
    inner.set_attn_implementation(NAME)
    return True
