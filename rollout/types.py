"""The rollout contracts: what a generator returns, what a parser finds, what an episode is.

This module imports nothing of agentgrpo's, so every layer above can depend on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Finish(StrEnum):
    """Why an episode ended. Finished (STOP, ENV_DONE) is kept apart from cut off (the rest)."""

    STOP = "stop"  # the model answered without calling a tool
    ENV_DONE = "env_done"  # the environment set `done = True`
    MAX_TURNS = "max_turns"  # cut off: the model used all `max_turns` turns
    LENGTH = "length"  # cut off: the completion token budget or the context was used up
    ERROR = "error"  # cut off: the model's output could not be rendered into the next turn
    # cut off: a tool or the environment raised `tools.InfrastructureError` on every play
    # (`infra_retries` replays): not scored, not trained on
    INFRA = "infra"

    @property
    def truncated(self) -> bool:
        """True when the episode was cut off rather than finished."""
        return self not in (Finish.STOP, Finish.ENV_DONE)


@dataclass(frozen=True)
class SamplingParams:
    """How one generation request samples.

    `temperature=0` means greedy. `top_k=0` and `top_p=1.0` switch those filters off. `seed`
    makes the request's draws reproducible whatever else is batched with it (None: unseeded).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


# The fields of a vLLM request that agentgrpo sets on every request, from its `SamplingParams`
# and the episode; a backend's `sampling_overrides` (TRL's `generation_kwargs`) may not replace
# them.
RESERVED_SAMPLING_FIELDS = frozenset(
    {"n", "max_tokens", "seed", "logprobs", "stop_token_ids", "detokenize", "output_kind"}
)


def check_sampling_overrides(overrides: Mapping[str, Any]) -> None:
    """Refuse overrides of the fields that keep episodes token-exact and within budget.

    Examples:
        >>> check_sampling_overrides({"min_p": 0.1})
        >>> check_sampling_overrides({"max_tokens": 5, "seed": 1})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: generation_kwargs may not set ['max_tokens', 'seed']: agentgrpo sets them ...

    """
    if clash := sorted(RESERVED_SAMPLING_FIELDS & overrides.keys()):
        raise ValueError(
            f"generation_kwargs may not set {clash}: agentgrpo sets them per request (the "
            "episode's token budget and seed, one sample with its logprob, the stop ids); "
            "remove them"
        )


@dataclass(frozen=True)
class Pictures:
    """The pictures of one request to a vision-language model, in both forms a backend reads.

    Attributes:
        images: The pictures (PIL), in the order their tokens appear in the prompt ids.
        vision: The tensors the model's processor made of them (`pixel_values`, ...): what a
            model run in this process reads (`rollout.template.encode_with_images`). vLLM reads
            `images` and makes its own.
    """

    images: tuple[Any, ...]
    vision: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)


@dataclass(frozen=True)
class Completion:
    """One generation: the sampled token ids and the sampler's log-probability of each.

    `logprobs[i]` is log p(token_ids[i]) under the temperature-scaled distribution the token was
    drawn from, before top-k/top-p filtering: the quantity the learner recomputes. `stopped` is
    True when generation ended on a stop token (kept as the last id), False when `max_tokens` ran
    out. `versions[i]` is the version of the weights `token_ids[i]` was drawn with, when the
    backend counts versions (an asynchronous run updates the weights while episodes play);
    None otherwise.
    """

    token_ids: list[int]
    logprobs: list[float]
    stopped: bool
    versions: list[int] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.logprobs)} logprobs")
        if self.versions is not None and len(self.versions) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} token ids but {len(self.versions)} versions")


@dataclass(frozen=True)
class ToolCall:
    """A tool call the model made: the tool's name and its JSON arguments."""

    name: str
    arguments: Mapping[str, Any]


@dataclass(frozen=True)
class ParsedTurn:
    """What a tool-call parser read from one assistant turn.

    `content` is the text outside the tool calls. `errors` holds one message per tool call that
    could not be read (bad JSON, no name, arguments not an object); each is shown to the model.
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call of an episode and what came of it.

    Attributes:
        name: The tool the model named; None when the call could not be parsed at all.
        arguments: The arguments the model gave, as parsed from its JSON ({} when unparsed).
        result: The text the model was shown: the tool's output, or the error message; cut
            where the token budget left no room for the whole text.
        error: Why the call failed (`parse`, or a `tools.ToolErrorKind` value: `unknown_tool`,
            `bad_arguments`, `exception`, `timeout`, `bad_picture`); None when it succeeded.
        result_chars: The length of the tool's whole output when `result` is a cut of it;
            None when `result` is whole.
    """

    name: str | None
    arguments: Mapping[str, Any]
    result: str
    error: str | None = None
    result_chars: int | None = None


@dataclass(frozen=True)
class TurnRecord:
    """Where one sampled turn of an episode lies in its rows, and what it earned.

    Attributes:
        row: The index of its row in `Episode.rows`.
        start, end: Its tokens' span in that row's completion (all mask 1).
        reward: The turn's reward: its tools' `Rewarded` rewards plus ``turn_reward()``'s.
        state: The state it started from, for ``turn_advantage="same_state"`` (the
            environment's ``state_key``, or its observation); None when not tracked.
    """

    row: int
    start: int
    end: int
    reward: float = 0.0
    state: str | None = None


@dataclass(frozen=True)
class Compaction:
    """One compaction of an episode's context (`rollout.compaction`).

    Attributes:
        turn: The model turns played before it.
        tokens_before: The context's tokens when it applied (the row it closed).
        tokens_after: The new row's prompt tokens: the compacted conversation's rendering.
        policy: ``"truncate"``, ``"summarize"`` or ``"function"``.
        rows: The rows it opened: 2 for a summary (the summary's row, then the compacted
            context's), else 1.
        row: The index in `Episode.rows` of the row the compacted context starts.
    """

    turn: int
    tokens_before: int
    tokens_after: int
    policy: str
    rows: int = 1
    row: int = 0


@dataclass(frozen=True)
class EpisodeStats:
    """Counts for one episode.

    `tool_errors` maps an error kind (`parse`, `unknown_tool`, `bad_arguments`, `exception`,
    `timeout`, `bad_picture`) to how often it happened. `compactions` are the context's
    compactions, in order; `responses` counts the environment's replies in words (``respond``).
    `infra_retries` counts the plays of the episode that an infrastructure failure ended
    before this one (`tools.InfrastructureError`; `RolloutEngine`'s ``infra_retries``).
    """

    turns: int
    tool_calls: int
    tool_errors: Mapping[str, int]
    compactions: tuple[Compaction, ...] = ()
    responses: int = 0
    infra_retries: int = 0

    @property
    def tool_failures(self) -> int:
        """All failed tool calls, whatever their kind."""
        return sum(self.tool_errors.values())


@dataclass(frozen=True)
class EpisodeRow:
    """One training row of an episode: a prompt the model saw, then what followed it.

    Invariants: `loss_mask`, `sampler_logprobs` and `completion_ids` have one entry per
    completion token; `loss_mask[i] == 1` exactly where the policy sampled the token right
    after `prompt_ids + completion_ids[:i]` (so every mask-1 token was sampled in exactly this
    row's context), and `sampler_logprobs[i] == 0.0` wherever the mask is 0.

    A vision-language model's row also holds its `images` (PIL images, in the order their
    tokens appear in the row) and `vision_inputs`, the tensors its processor made of them
    (`pixel_values`, ...; see `rollout.images`), which every forward over the row takes. Both
    are empty for text rows and are left out of equality.
    `policy_versions`, when the generator counted versions for every sampled token (an
    asynchronous run), holds the weights version each completion token was drawn with, and
    -1 wherever the mask is 0; None otherwise.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    sampler_logprobs: list[float]
    images: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    vision_inputs: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    policy_versions: list[int] | None = None

    def __post_init__(self) -> None:
        lengths = {len(self.completion_ids), len(self.loss_mask), len(self.sampler_logprobs)}
        versions = self.policy_versions
        if len(lengths) != 1 or (versions is not None and len(versions) not in lengths):
            raise ValueError(
                f"a row needs one mask, one logprob (and one version, if any) per completion "
                f"token; got {len(self.completion_ids)} ids, {len(self.loss_mask)} mask values, "
                f"{len(self.sampler_logprobs)} logprobs and "
                f"{'no' if versions is None else len(versions)} versions"
            )

    @property
    def model_tokens(self) -> int:
        """How many completion tokens of this row the policy sampled (the mask-1 count)."""
        return sum(self.loss_mask)


@dataclass(frozen=True)
class Episode:
    """One finished episode, token-exact, as one or more training rows.

    `rows` holds the episode's tokens. Usually there is one row: the prompt, then the model's
    turns (mask 1) and the tool/environment turns (mask 0) in order. When the chat template
    renders the conversation differently once a tool turn is added (e.g. Qwen3 drops the
    reasoning of earlier turns), the episode *forks*: it goes on in a new row whose prompt is the
    template's fresh rendering of the whole conversation so far (generation prompt included)
    and whose completion starts with the next sampled turn. Every row shares the episode's one
    reward and advantage; the loss counts an episode's rows as one sequence
    (`agentgrpo.learner.losses`). `len(rows) - 1` is the number of forks.

    `group` and `index` place it in the batch: episodes of one group share the row and the seed.
    `env_reward` is the environment's `reward()` read when the episode ended (None when the
    environment has no `reward`); `environment` is the instance itself, already closed. It is
    the one field that is not data: it is left out of equality and of the episode record
    (`rollout.record`), which reads back None.

    `tool_calls` holds one record per tool message in `messages`, in the same order: each
    turn's parsed calls, then the calls of that turn that could not be parsed. An agent's
    episode (`rollout.agents`) holds its calls that got a result instead, and `agent_rewards`,
    the reward columns of what the agent returned (None for other episodes).

    `turns` places each sampled turn in the rows, with its turn reward (`TurnRecord`); empty
    for episodes the engine did not play turn by turn (agents, `rollout_func`).
    """

    rows: tuple[EpisodeRow, ...]
    messages: list[dict[str, Any]]
    finish: Finish
    stats: EpisodeStats
    row: Mapping[str, Any]
    group: int
    index: int
    env_reward: float | None = None
    environment: Any = field(default=None, repr=False, compare=False)
    error: str | None = None
    tool_calls: tuple[ToolCallRecord, ...] = ()
    agent_rewards: Mapping[str, float | None] | None = None
    turns: tuple[TurnRecord, ...] = ()

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("an episode needs at least one row")

    @property
    def model_tokens(self) -> int:
        """How many completion tokens the policy sampled, over all rows (the mask-1 count)."""
        return sum(row.model_tokens for row in self.rows)

    @property
    def forks(self) -> int:
        """How many times the episode moved to a new row."""
        return len(self.rows) - 1

    @property
    def completion_ids(self) -> list[int]:
        """Every row's completion, in order: what the episode added after each row's prompt.

        For a one-row episode this is its completion. A forked episode's later rows start from
        a fresh rendering of the conversation, which is not in this list.
        """
        return [token for row in self.rows for token in row.completion_ids]
