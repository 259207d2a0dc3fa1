"""The two key-value caches of the shared-prompt forward, safe to replay under checkpointing.

Under (non-reentrant) gradient checkpointing a decoder layer runs twice: in the forward, and
again in the backward to recompute the activations it did not keep. A layer that writes its keys
and values to an ordinary cache writes them a second time on that replay, which is why
transformers drops the cache of a checkpointed layer unless the layer only reads it
(`GradientCheckpointingLayer._can_checkpoint_with_cache`). Neither cache here changes after its
first use, so a replay sees exactly what the forward saw:

- `RecordingCache`, the prompt pass's: the first `update` of a layer keeps that layer's keys and
  values, a replay's keeps nothing; both return what they were given (the prompt has no past).
- `PrefixCache`, the completion pass's: each layer's prompt keys and values, one row per batch
  row; `update` returns them followed by the new ones and stores nothing.

The prompt's keys and values stay tensors of the autograd graph: the completion tokens' loss
reaches the prompt pass through them.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from transformers.cache_utils import Cache, DynamicLayer


class _RecordingLayer(DynamicLayer):
    """One layer of a `RecordingCache`: keeps the keys and values of its first `update`."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
        return key_states, value_states


class _PrefixLayer(DynamicLayer):
    """One layer of a `PrefixCache`: a fixed prefix that every `update` reads and none extends."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = torch.cat([self.keys, key_states], dim=-2)  # type: ignore[list-item]
        values = torch.cat([self.values, value_states], dim=-2)  # type: ignore[list-item]
        return keys, values


class RecordingCache(Cache):
    """The prompt pass's cache: each layer's keys and values, as its first forward made them."""

    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=_RecordingLayer)

    def recorded(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values (U x heads x P x head size), in layer order.

        Raises:
            ValueError: The prompt pass recorded nothing (it ran no attention layer).
        """
        layers = cast(list[_RecordingLayer], self.layers)  # the only layers it makes
        if not layers or not all(layer.is_initialized for layer in layers):
            raise ValueError("the prompt pass recorded no keys and values: nothing to read")
        return [(layer.keys, layer.values) for layer in layers]  # type: ignore[misc]


class PrefixCache(Cache):
    """A read-only cache over a recorded prompt pass, with its rows picked per batch row.

    Args:
        prompts: The prompt pass's cache, U rows.
        prompt_B: Each batch row's prompt, an index into those U rows (long); picking the rows
            is an index_select, so gradients flow back to the prompt pass.

    Raises:
        ValueError: The prompt pass recorded nothing (it ran no attention layer).
    """

    def __init__(self, prompts: RecordingCache, prompt_B: torch.Tensor):
        recorded = prompts.recorded()
        super().__init__(layers=[_PrefixLayer(k[prompt_B], v[prompt_B]) for k, v in recorded])


class PackedPrefixCache(Cache):
    """A read-only cache over a recorded prompt pass, its U prompts one after another in one row.

    Each layer's keys and values (U x heads x P x size) become one row, 1 x heads x U·P x size:
    prompt u at columns u·P to (u + 1)·P, left padding included. A packed row of completion
    tokens reads them all; its attention mask (`packing`) says which prompt each token sees.

    Args:
        prompts: The prompt pass's cache, U rows.

    Raises:
        ValueError: The prompt pass recorded nothing (it ran no attention layer).
    """

    def __init__(self, prompts: RecordingCache):
        super().__init__(
            layers=[_PrefixLayer(_one_row(k), _one_row(v)) for k, v in prompts.recorded()]
        )


def _one_row(states_U_h_P_d: torch.Tensor) -> torch.Tensor:
    """U rows of keys (or values) laid one after another: 1 x heads x U·P x size."""
    count_U, heads, width_P, size = states_U_h_P_d.shape
    return states_U_h_P_d.transpose(0, 1).reshape(1, heads, count_U * width_P, size)
