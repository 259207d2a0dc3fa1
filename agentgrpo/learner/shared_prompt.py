"""The completions' final states, each distinct prompt run through the model once.

In GRPO the G rows of a group start from the same prompt, which is often most of each row's
tokens. Instead of one pass over all B x (P + C) columns, `shared_prompt_states` runs the U
distinct prompts (U x P), gives each row its prompt's keys and values, then runs the B x C
completion columns on top of them (`prefix_cache`). Gradients flow back through those keys and
values into the one prompt pass, so the loss, its gradients and the logprobs equal the one-pass
ones up to float rounding.

Gradient checkpointing keeps this: the caches are never written twice, so a checkpointed layer
may keep them (`GradientCheckpointingLayer._can_checkpoint_with_cache`, set only during the
shared forward). Only non-reentrant checkpointing lets gradients reach the prompt's keys and
values; under reentrant checkpointing `can_share_prompts` says no and the learner takes one pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.learner.output_head import Readout
from agentgrpo.learner.prefix_cache import PrefixCache, RecordingCache

# transformers' GradientCheckpointingLayer (from transformers 5.17) keeps a checkpointed layer's
# cache when this attribute is True; a layer class without it never keeps one.
_KEEPS_CACHE = "_can_checkpoint_with_cache"


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


def can_share_prompts(model: torch.nn.Module, sharded: bool = False) -> bool:
    """Whether `shared_prompt_states` gives `model` the same results as one pass.

    Only for models whose every layer is full attention: a sliding-window layer's cache keeps
    only its window, and recurrent or linear layers keep state that cannot be copied row by row.
    A model that checkpoints its layers (training, gradient checkpointing on) must do so through
    transformers' `GradientCheckpointingLayer`, non-reentrantly. `model` may be wrapped (DDP,
    DeepSpeed), not `sharded` by FSDP2 or ZeRO-3 (`output_head.InForwardScores` says why).
    """
    inner: Any = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    if config is None or sharded:
        return False
    text_config = config.get_text_config(decoder=True)
    layer_types = getattr(text_config, "layer_types", None) or ["full_attention"]
    return set(layer_types) == {"full_attention"} and _checkpoints_keep_caches(inner)


def _checkpoints_keep_caches(model: torch.nn.Module) -> bool:
    """Whether every layer that checkpoints can keep a cache and pass gradients to it.

    True when no layer checkpoints (not training, or checkpointing off). Otherwise the layers
    that checkpoint must be transformers' `GradientCheckpointingLayer`s of a version that
    honours `_can_checkpoint_with_cache`, checkpointing non-reentrantly: a reentrant checkpoint
    differentiates only with respect to its positional inputs, never the cached prompt keys.
    """
    if not getattr(model, "is_gradient_checkpointing", False) or not model.training:
        return True
    layers = _checkpointing_layers(model)
    if not layers:
        return False  # checkpointing of another kind (remote code), or transformers < 5.17
    return all(_non_reentrant(layer._gradient_checkpointing_func) for layer in layers)


def _checkpointing_layers(model: torch.nn.Module) -> list[Any]:
    """The layers that checkpoint through transformers' `GradientCheckpointingLayer.__call__`."""
    return [
        module
        for module in model.modules()
        if getattr(module, "gradient_checkpointing", False) and hasattr(type(module), _KEEPS_CACHE)
    ]


def _non_reentrant(checkpoint: Any) -> bool:
    """Whether a layer's checkpoint function passes `use_reentrant=False`.

    transformers' is a `functools.partial` of torch's `checkpoint`; torch's default is reentrant.
    """
    return (getattr(checkpoint, "keywords", None) or {}).get("use_reentrant") is False


@contextmanager
def caches_through_checkpoints(model: torch.nn.Module) -> Iterator[None]:
    """Let the checkpointing layers keep the (replay-safe) caches until the block ends."""
    layers = _checkpointing_layers(model)
    before = [layer.__dict__.get(_KEEPS_CACHE) for layer in layers]
    for layer in layers:
        setattr(layer, _KEEPS_CACHE, True)
    try:
        yield
    finally:
        for layer, value in zip(layers, before, strict=True):
            if value is None:
                delattr(layer, _KEEPS_CACHE)  # back to the class's value
            else:
                setattr(layer, _KEEPS_CACHE, value)


def shared_prompt_states(
    model: torch.nn.Module,
    batch: TrainingBatch,
    prompts: tuple[list[int], torch.Tensor],
    readout: Readout,
) -> torch.Tensor:
    """`readout`'s states at the positions predicting each completion token: B x C x D.

    The prompt pass keeps only its last position's state (it predicts completion token 0); the
    completion pass, over the prompt's keys and values, gives the rest. The caller checks
    `can_share_prompts(model)` and that the batch has prompt columns and at least 2 completion
    columns.

    Args:
        model: A causal LM that takes `past_key_values`, possibly wrapped.
        batch: The rows to score.
        prompts: `prompt_groups(batch)`.
        readout: What to read from each pass: final hidden states or logits.
    """
    rows_U, prompt_B = prompts
    width_C = batch.completion_width
    width_P = batch.input_ids_B_L.shape[1] - width_C
    recorded = RecordingCache()
    with caches_through_checkpoints(getattr(model, "module", model)):
        prompt_U_1_D, _ = readout(
            model,
            1,
            input_ids=batch.input_ids_B_L[rows_U, :width_P],
            attention_mask=batch.attention_mask_B_L[rows_U, :width_P],
            position_ids=batch.position_ids_B_L[rows_U, :width_P],
            past_key_values=recorded,
        )
        completion_B_C_D, _ = readout(
            model,
            width_C,  # the last one predicts past the completion: dropped
            input_ids=batch.input_ids_B_L[:, width_P:],
            attention_mask=batch.attention_mask_B_L,
            position_ids=batch.position_ids_B_L[:, width_P:],
            past_key_values=PrefixCache(recorded, prompt_B),
        )
    return torch.cat([prompt_U_1_D[prompt_B], completion_B_C_D[:, :-1]], dim=1)
