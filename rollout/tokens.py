"""Append-only token bookkeeping for one episode."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout.images import join_vision_inputs
from rollout.types import Pictures


class TokenRow:
    """The tokens of one episode: a prompt, then completion tokens that are only ever appended.

    Sampled tokens carry loss mask 1 and their sampler logprob; tokens the template, a tool or the
    environment adds carry mask 0 and logprob 0.0. Nothing is decoded and re-encoded.
    `versions` holds each token's weights version (-1 for mask 0) while every sampled token came
    with one, and is None from the first that did not.

    >>> row = TokenRow([1, 2])
    >>> row.append_sampled([3, 4], [-0.5, -0.25])
    >>> row.append_context([5])
    >>> row.context_ids, row.loss_mask, row.logprobs
    ([1, 2, 3, 4, 5], [1, 1, 0], [-0.5, -0.25, 0.0])
    """

    def __init__(
        self,
        prompt_ids: Sequence[int],
        images: Sequence[Any] = (),
        vision: Mapping[str, Any] | None = None,
    ):
        self.prompt_ids = list(prompt_ids)
        self.completion_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        # A VLM's images in the row, in order, and the processor's tensors for each addition.
        self.images: list[Any] = list(images)
        self.vision_parts: list[Mapping[str, Any]] = [vision] if vision else []
        self.versions: list[int] | None = []

    def append_sampled(
        self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int] | None = None
    ) -> None:
        """Append tokens the policy sampled, with the sampler's logprob (and version) of each."""
        if len(ids) != len(logprobs):
            raise ValueError(f"{len(ids)} sampled ids but {len(logprobs)} logprobs")
        self.completion_ids.extend(ids)
        self.loss_mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)
        if versions is None or self.versions is None:
            self.versions = None
        else:
            self.versions.extend(versions)

    def append_context(
        self,
        ids: Sequence[int],
        images: Sequence[Any] = (),
        vision: Mapping[str, Any] | None = None,
    ) -> None:
        """Append tokens the policy did not sample (tool results, template glue): mask 0.

        `images` are those whose tokens `ids` hold, `vision` the processor's tensors of them.
        """
        self.images.extend(images)
        if vision:
            self.vision_parts.append(vision)
        self.completion_ids.extend(ids)
        self.loss_mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        if self.versions is not None:
            self.versions.extend([-1] * len(ids))

    @property
    def vision_inputs(self) -> dict[str, Any]:
        """The processor's tensors of every image in the row, in order (empty: no images)."""
        return join_vision_inputs(self.vision_parts)

    @property
    def pictures(self) -> Pictures | None:
        """The row's pictures, as a backend takes them with a request; None without any."""
        return Pictures(tuple(self.images), self.vision_inputs) if self.images else None

    @property
    def context_ids(self) -> list[int]:
        """Everything the model has seen so far: the prompt, then the completion."""
        return self.prompt_ids + self.completion_ids

    def __len__(self) -> int:
        """The number of completion tokens (the budget `max_completion_length` counts)."""
        return len(self.completion_ids)
