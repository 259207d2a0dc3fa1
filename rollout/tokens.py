"""Append-only token bookkeeping for one episode: its rows, and its state while it plays."""

from __future__ import annotations

import dataclasses
from collections import Counter as Tally
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout.images import join_vision_inputs
from rollout.template import ToolTurn
from rollout.types import Compaction, Completion, EpisodeRow, Pictures, ToolCallRecord, TurnRecord


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


@dataclass
class EpisodeState:
    """An episode in play. `tokens` is the current row; `done_rows` the rows closed before it.

    `messages` is the whole conversation as it happened (what reward functions and the record
    see). After a compaction the model sees `context_messages` instead: the compacted
    conversation (`base`), then what was added to `messages` since (from `base_at` on).
    """

    messages: list[dict[str, Any]]
    tokens: TokenRow
    prompt_text: str
    sample_seed: int
    turns: int = 0
    tool_calls: int = 0
    tool_errors: Tally = field(default_factory=Tally)
    responses: int = 0
    error: str | None = None
    calls: list[ToolCallRecord] = field(default_factory=list)
    done_rows: list[EpisodeRow] = field(default_factory=list)
    base: list[dict[str, Any]] | None = None
    base_at: int = 0
    compactions: list[Compaction] = field(default_factory=list)
    turn_log: list[TurnRecord] = field(default_factory=list)
    tool_reward: float = 0.0  # what the turn's tool calls earned, until `score_turn` adds it

    def __post_init__(self) -> None:
        self.first_prompt_length = len(self.tokens.prompt_ids)

    @property
    def spent(self) -> int:
        """Tokens past the task's prompt, as the current row renders the conversation.

        `max_completion_length` bounds this. For a row that never forked it is the row's
        completion length; after a fork it counts the fresh rendering's part past the prompt.
        """
        return len(self.tokens.context_ids) - self.first_prompt_length

    @property
    def context_messages(self) -> list[dict[str, Any]]:
        """The conversation the model sees now: `messages`, or since a compaction its result."""
        if self.base is None:
            return self.messages
        return [*self.base, *self.messages[self.base_at :]]

    def add_sampled(self, completion: Completion, state_key: str | None = None) -> None:
        """Append a sampled turn to the current row, and log where it lies (`TurnRecord`)."""
        start = len(self.tokens.completion_ids)
        self.tokens.append_sampled(completion.token_ids, completion.logprobs, completion.versions)
        end = len(self.tokens.completion_ids)
        self.turn_log.append(TurnRecord(len(self.done_rows), start, end, state=state_key))

    def score_turn(self, reward: float) -> None:
        """Give the turn logged last its reward: `reward` plus what its tool calls earned."""
        last = self.turn_log[-1]
        earned, self.tool_reward = reward + self.tool_reward, 0.0
        self.turn_log[-1] = dataclasses.replace(last, reward=last.reward + earned)

    def add_tool_turn(self, turn: ToolTurn) -> None:
        """Append the tool turn to the current row, or close the row and start a new one."""
        self.prompt_text = turn.prompt_text
        if not turn.fork:
            self.tokens.append_context(turn.ids, turn.images, turn.vision)
            return
        self.done_rows.append(row_of(self.tokens))
        self.tokens = TokenRow(turn.ids, turn.images, turn.vision)

    def compact(
        self,
        messages: list[dict[str, Any]],
        fresh: ToolTurn,
        policy: str,
        before: int | None = None,
    ) -> None:
        """Go on in a new row from `fresh`, the rendering of `messages`, the compacted context.

        `before`: the context's length when the compaction began, when a summary's row was
        opened since (None: the current row's, and the compaction opens one row).
        """
        rows = 1 if before is None else 2
        if before is None:
            before = len(self.tokens.context_ids)
        self.base, self.base_at = messages, len(self.messages)
        self.add_tool_turn(fresh)
        after, row = len(fresh.ids), len(self.done_rows)
        self.compactions.append(Compaction(self.turns, before, after, policy, rows, row))

    def rows(self) -> tuple[EpisodeRow, ...]:
        """Every row of the episode, the current one last."""
        return (*self.done_rows, row_of(self.tokens))


def row_of(tokens: TokenRow) -> EpisodeRow:
    """The training row `tokens` make (their versions only where every sampled token had one)."""
    versions = tokens.versions if tokens.versions and 1 in tokens.loss_mask else None
    return EpisodeRow(
        tokens.prompt_ids,
        tokens.completion_ids,
        tokens.loss_mask,
        tokens.logprobs,
        tuple(tokens.images),
        tokens.vision_inputs,
        policy_versions=versions,
    )
