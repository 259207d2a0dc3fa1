"""transformers' SDPA attention, reading grouped-query key and value heads in place on a CPU.

With an attention mask (every padded batch: the generation backend's decoding rows, the
learner's prompts), transformers' "sdpa" attention copies each key and value head once per
query head it serves before calling `scaled_dot_product_attention`; for SmolLM2 (9 query heads,
3 key-value heads) that copy is most of the attention time of a decoding step. PyTorch's CPU
kernels take grouped heads as they are (`enable_gqa=True`), with the same results.
`use_grouped_query_sdpa(model)` switches a model from "sdpa" to "sdpa_gqa", this module's
attention, which does exactly what "sdpa" does except that copy: on a CPU through
`scaled_dot_product_attention(enable_gqa=True)`; on a GPU for a decoding step (one query per
row, over a masked cache such as `slot_batch`'s), where it would copy the whole cache
every token, through two grouped matrix products that read each key and value head once.

The switch is made where models are loaded (`models.loading`: the policy, and the model that
`agentgrpo eval` and `doctor --generate` play with), so the learner and the transformers
backend read the same attention.
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

    Only the case that copies heads changes: a boolean attention mask, grouped heads, no
    position bias, no paged cache, and a CPU or a one-token query (without dropout). Then, as
    transformers does with a mask, attention is not causal by flag (the mask holds
    causality). Everything else goes to transformers.
    """
    grouped = (
        attention_mask is not None
        and attention_mask.dtype == torch.bool
        and getattr(module, "num_key_value_groups", 1) > 1
        and kwargs.get("position_bias") is None
        and kwargs.get("cache") is None
        and not kwargs.get("output_attentions", False)
    )
    if grouped and query.device.type != "cpu" and query.shape[2] == 1 and not dropout:
        assert attention_mask is not None  # grouped says so
        return grouped_decode_attention(query, key, value, attention_mask, scaling), None
    if not (grouped and query.device.type == "cpu"):
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


def grouped_decode_attention(
    query_B_Hq_1_D: torch.Tensor,
    key_B_Hk_T_D: torch.Tensor,
    value_B_Hk_T_D: torch.Tensor,
    mask_B_1_1_T: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """Attention of one query per row over grouped key-value heads, without copying them.

    Query head h reads key-value head h // G (G = Hq / Hk), as transformers' `repeat_kv`
    pairs them. Scores and softmax in float32; every row's mask must allow some position.

    Returns:
        The output as transformers' attention functions return it: B x 1 x Hq x D.
    """
    rows, query_heads, _, dim = query_B_Hq_1_D.shape
    kv_heads = key_B_Hk_T_D.shape[1]
    scale = dim**-0.5 if scaling is None else scaling
    query_B_Hk_G_D = query_B_Hq_1_D.view(rows, kv_heads, query_heads // kv_heads, dim)
    scores_B_Hk_G_T = torch.matmul(query_B_Hk_G_D, key_B_Hk_T_D.transpose(-1, -2)).float()
    scores_B_Hk_G_T = (scores_B_Hk_G_T * scale).masked_fill(~mask_B_1_1_T, float("-inf"))
    weights_B_Hk_G_T = torch.softmax(scores_B_Hk_G_T, dim=-1).to(value_B_Hk_T_D.dtype)
    output_B_Hk_G_D = torch.matmul(weights_B_Hk_G_T, value_B_Hk_T_D)
    return output_B_Hk_G_D.reshape(rows, 1, query_heads, dim)


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
