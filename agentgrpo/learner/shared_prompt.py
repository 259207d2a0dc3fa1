"""Next-token logits of a batch's completions, running each distinct prompt through the model once.

In GRPO the G rows of a group start from the same prompt, which is often most of each row's
tokens. Instead of one pass over all B x (P + C) columns, `shared_prompt_logits` runs the U
distinct prompts (U x P), copies each prompt's keys and values to the rows that share it, then
runs the B x C completion columns on top of that cache. Gradients flow back through the copies
into the one prompt pass, so the loss, its gradients and the logits equal the one-pass ones up to
float rounding.
"""

from __future__ import annotations

from typing import Any

import torch

from agentgrpo.learner.batch import TrainingBatch


def prompt_groups(batch: TrainingBatch) -> tuple[list[int], torch.Tensor]:
    """Which rows share a prompt: equal prompt columns of input ids and attention mask.

    Returns:
        rows_U: The first row of each of the U distinct prompts.
        prompt_B: Each row's prompt, an index into `rows_U` (long).
    """
    width_P = batch.input_ids_B_L.shape[1] - batch.completion_width
    key_B_2P = torch.cat(
        [batch.input_ids_B_L[:, :width_P], batch.attention_mask_B_L[:, :width_P]], dim=1
    )
    first_row_of: dict[tuple[int, ...], int] = {}
    prompt_of = [first_row_of.setdefault(tuple(key), b) for b, key in enumerate(key_B_2P.tolist())]
    rows_U = list(first_row_of.values())
    prompt_B = torch.tensor([rows_U.index(row) for row in prompt_of], dtype=torch.long)
    return rows_U, prompt_B


def can_share_prompts(model: torch.nn.Module) -> bool:
    """Whether `shared_prompt_logits` gives `model` the same results as one pass.

    Only for models whose every layer is full attention: a sliding-window layer's cache keeps
    only its window, and recurrent or linear layers keep state that cannot be copied row by row.
    Not for a gradient-checkpointing model either (transformers turns its cache off). `model`
    may be wrapped (DDP, DeepSpeed).
    """
    inner: Any = getattr(model, "module", model)
    if getattr(inner, "is_gradient_checkpointing", False):
        return False
    config = getattr(inner, "config", None)
    if config is None:
        return False
    text_config = config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None) or ["full_attention"]
    return set(layer_types) == {"full_attention"}


def shared_prompt_logits(
    model: torch.nn.Module, batch: TrainingBatch, prompts: tuple[list[int], torch.Tensor]
) -> torch.Tensor:
    """Logits predicting each completion token (B x C x V), each distinct prompt run once.

    The prompt pass keeps only its last position's logits (they predict completion token 0);
    the completion pass, over the cached prompt, gives the rest. The caller checks
    `can_share_prompts(model)` and that the batch has prompt columns and at least 2 completion
    columns.

    Args:
        model: A causal LM that takes `past_key_values` and `logits_to_keep`.
        batch: The rows to score.
        prompts: `prompt_groups(batch)`.
    """
    rows_U, prompt_B = prompts
    width_C = batch.completion_width
    width_P = batch.input_ids_B_L.shape[1] - width_C
    prompt = model(
        input_ids=batch.input_ids_B_L[rows_U, :width_P],
        attention_mask=batch.attention_mask_B_L[rows_U, :width_P],
        position_ids=batch.position_ids_B_L[rows_U, :width_P],
        use_cache=True,
        logits_to_keep=1,
    )
    cache_B = prompt.past_key_values  # the model's own cache, U rows
    cache_B.reorder_cache(prompt_B)  # now B rows: an index_select, so gradients flow back
    completion = model(
        input_ids=batch.input_ids_B_L[:, width_P:],
        attention_mask=batch.attention_mask_B_L,
        position_ids=batch.position_ids_B_L[:, width_P:],
        past_key_values=cache_B,
        use_cache=True,
        logits_to_keep=width_C,  # the last one predicts past the completion: dropped
    )
    return torch.cat([prompt.logits[prompt_B], completion.logits[:, :-1]], dim=1)
