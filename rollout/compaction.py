"""Context policies: what an episode does when its context nears the window.

An episode's context is the current row's tokens (prompt, then every turn). Once it passes
`ContextPolicy.threshold` of the window before a model turn, the policy rewrites the
conversation the model sees, and the episode goes on in a new row: the template's fresh
rendering of the rewritten conversation (mask 0), then the turns sampled after it. Every
sampled token stays in the row it was sampled in, so training stays token-exact; all rows
share the episode's reward. The episode's messages (what reward functions and the record see)
keep the whole conversation as it happened, the compaction included.

The policies:

- ``"truncate"``: every tool result (and environment reply) but the last `keep_last` is replaced
  by `TRUNCATED_MARKER`.
- ``"summarize"``: the model is asked, in a user turn holding `instruction`, to summarize its
  progress; the summary is sampled (and trained: its tokens are the policy's) in a row whose
  prompt is the whole conversation and that instruction; the new conversation is the system
  prompt and the task, with the summary after `SUMMARY_HEADER` on the task's message.
- a function ``(messages, tokenizer) -> messages``: the new conversation, as the function
  writes it.

``"none"`` compacts nothing, even where the environment names a policy of its own.

A rewrite that does not make the context shorter is not applied; the episode goes on as it
would without a policy (and ends with LENGTH when the budget runs out).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from rollout.template import ChatRenderer
from rollout.tokens import EpisodeState
from rollout.types import Completion, Finish

SUMMARY_INSTRUCTION = (
    "Your context is almost full. Summarize your progress so far for yourself: the task, what "
    "you have done, what you learned from the results, and what is left to do. Be brief and "
    "keep every detail you will need, since the conversation so far is replaced by this "
    "summary. Do not call tools in this turn."
)
"""The default instruction of the ``"summarize"`` policy's summary turn."""

SUMMARY_HEADER = "Summary of your progress so far (the earlier conversation was compacted):"
"""What precedes the summary on the task's message in the compacted conversation."""

TRUNCATED_MARKER = "[result removed to save context]"
"""What replaces an old tool result under the ``"truncate"`` policy."""

POLICY_NAMES = ("truncate", "summarize", "none")

ContextFunction = Callable[[list[dict[str, Any]], Any], list[dict[str, Any]]]
Generate = Callable[[int, int], Awaitable[Completion]]
"""``generate(max_tokens, seed)``: the model's next turn after the episode's current row."""


class ContextPolicyError(ValueError):
    """A context policy's settings cannot work; the message names the option and what does."""


@dataclass(frozen=True)
class ContextPolicy:
    """How an episode's context is compacted, and when.

    Attributes:
        kind: ``"truncate"``, ``"summarize"``, ``"function"``, or ``"none"`` (no compaction,
            over an environment's own policy).
        threshold: The share of the window (0 < threshold < 1) the context may reach before a
            model turn; past it, the policy applies.
        keep_last: ``"truncate"``: how many of the latest tool and environment results stay.
        instruction: ``"summarize"``: the user turn asking for the summary.
        summary_tokens: ``"summarize"``: the most tokens the summary may take.
        function: ``"function"``: ``(messages, tokenizer) -> messages``.
    """

    kind: str
    threshold: float = 0.75
    keep_last: int = 2
    instruction: str = SUMMARY_INSTRUCTION
    summary_tokens: int = 256
    function: ContextFunction | None = None

    def check_window(self, window: int) -> None:
        """Refuse settings that cannot work in a context of `window` tokens.

        Raises:
            ContextPolicyError: The summary cannot fit between the threshold and the window.
        """
        room = window - int(self.threshold * window)
        if self.kind == "summarize" and self.summary_tokens >= room:
            raise ContextPolicyError(
                f"context_summary_tokens={self.summary_tokens} does not fit the "
                f"{room} tokens context_threshold={self.threshold} leaves in a {window}-token "
                f"window: lower context_summary_tokens or context_threshold"
            )


def context_policy_of(
    value: str | ContextFunction | None,
    threshold: float = 0.75,
    keep_last: int = 2,
    instruction: str | None = None,
    summary_tokens: int = 256,
) -> ContextPolicy | None:
    """The policy a `context_policy` option names: a policy name or a function; None: none.

    Raises:
        ContextPolicyError: An unknown name, a threshold outside (0, 1), a negative
            `keep_last` or a `summary_tokens` under 1, naming the option.
    """
    if value is None:
        return None
    if not 0 < threshold < 1:
        raise ContextPolicyError(
            f"context_threshold={threshold} must be a share of the window between 0 and 1 "
            "(e.g. 0.75: compact once the context passes three quarters of the window)"
        )
    if keep_last < 0 or summary_tokens < 1:
        raise ContextPolicyError(
            f"context_keep_last={keep_last} must be 0 or more and context_summary_tokens="
            f"{summary_tokens} 1 or more"
        )
    settings = dict(threshold=threshold, keep_last=keep_last, summary_tokens=summary_tokens)
    if callable(value):
        return ContextPolicy("function", function=value, **settings)  # type: ignore[arg-type]
    if value not in POLICY_NAMES:
        raise ContextPolicyError(
            f"context_policy={value!r} is not a policy: use one of {list(POLICY_NAMES)}, or a "
            "function (messages, tokenizer) -> messages ('module:function' on the command line)"
        )
    return ContextPolicy(
        value,
        instruction=instruction or SUMMARY_INSTRUCTION,
        **settings,  # type: ignore[arg-type]
    )


def truncated(messages: Sequence[Mapping[str, Any]], keep_last: int) -> list[dict[str, Any]]:
    """`messages` with every tool result but the last `keep_last` replaced by the marker."""
    results = [i for i, m in enumerate(messages) if m.get("role") == "tool"]
    old = set(results[: max(len(results) - keep_last, 0)])
    return [
        {**m, "content": TRUNCATED_MARKER} if i in old else dict(m) for i, m in enumerate(messages)
    ]


def task_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversation's start: its system messages and its first user message (the task)."""
    first_user = next(i for i, m in enumerate(messages) if m.get("role") == "user")
    return [dict(m) for m in messages[: first_user + 1]]


def summarized(task: Sequence[Mapping[str, Any]], summary: str) -> list[dict[str, Any]]:
    """The task's messages with `summary` after `SUMMARY_HEADER` on the last (user) one.

    On the task's own message rather than a message of its own: many templates refuse two
    user messages in a row. A content of parts (text and images) gets a text part.
    """
    *before, last = [dict(m) for m in task]
    note = f"{SUMMARY_HEADER}\n{summary}"
    content = last.get("content")
    if isinstance(content, list):
        last["content"] = [*content, {"type": "text", "text": note}]
    else:
        last["content"] = f"{content}\n\n{note}" if content else note
    return [*before, last]


def checked_messages(value: Any) -> list[dict[str, Any]]:
    """A context function's result, checked: a list of messages ending with a user or tool one.

    Raises:
        ContextPolicyError: It returned something else, saying what.
    """
    if not isinstance(value, list) or not all(isinstance(m, Mapping) for m in value):
        raise ContextPolicyError(
            f"the context_policy function returned {type(value).__name__}; it must return the "
            "new conversation, a list of message dicts"
        )
    if not value or value[-1].get("role") not in ("user", "tool"):
        raise ContextPolicyError(
            "the context_policy function's conversation must end with a user or tool message, "
            "for the model to answer"
        )
    return [dict(m) for m in value]


async def compact(
    state: EpisodeState,
    policy: ContextPolicy,
    window: int,
    renderer: ChatRenderer,
    generate: Generate,
) -> Finish | None:
    """Apply `policy` to the episode's context; a Finish if the episode ends here.

    A rewrite that would not shorten the context is not applied. A template that cannot
    render the compacted conversation ends the episode (ERROR), as a turn it cannot render.

    Raises:
        ContextPolicyError: A policy function returned something other than a conversation.
    """
    try:
        if policy.kind == "summarize":
            return await _summarize(state, policy, window, renderer, generate)
        if policy.function is not None:
            written = policy.function(state.context_messages, renderer.tokenizer)
            messages = checked_messages(written)
        else:
            messages = truncated(state.context_messages, policy.keep_last)
        fresh = renderer.fresh(messages)
    except jinja2.TemplateError as error:
        state.error = f"the chat template could not render the compacted context: {error}"
        return Finish.ERROR
    if len(fresh.ids) < len(state.tokens.context_ids):
        state.compact(messages, fresh, policy.kind)
    return None


async def _summarize(
    state: EpisodeState,
    policy: ContextPolicy,
    window: int,
    renderer: ChatRenderer,
    generate: Generate,
) -> Finish | None:
    """The ``"summarize"`` policy: the model summarizes, and goes on from the task and that.

    The summary is sampled in a row of its own (the whole conversation and the instruction as
    its prompt), so its tokens are trained in the context they were sampled in. A summary
    that does not end within its budget ends the episode (LENGTH): the model's, and data.
    """
    before = len(state.tokens.context_ids)
    ask = [*state.context_messages, {"role": "user", "content": policy.instruction}]
    question = renderer.fresh(ask)
    room = min(policy.summary_tokens, window - len(question.ids))
    if room < 1:
        return Finish.LENGTH
    state.messages.append(ask[-1])
    state.add_tool_turn(question)
    completion = await generate(room, hash((state.sample_seed, "summary", state.turns)) % 2**62)
    state.add_sampled(completion)  # no state: a summary is compared with no other turn
    decode = renderer.tokenizer.decode
    if not completion.stopped:
        state.messages.append({"role": "assistant", "content": decode(completion.token_ids)})
        return Finish.LENGTH
    summary = decode(completion.token_ids[:-1])
    state.messages.append({"role": "assistant", "content": summary})
    compacted = summarized(task_messages(state.messages), summary)
    state.compact(compacted, renderer.fresh(compacted), policy.kind, before)
    return None
