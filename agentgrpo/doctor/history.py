"""Check 3: whether the template extends a conversation, or rewrites history as turns are added.

A run renders the prompt once and then only appends: the model's turn as sampled, then the tool
turn. That is exact only when every rendering starts with the one before it. The probe plays a
two-tool-turn conversation, rendering it after each message as the engine would (with the
generation prompt before each model turn, without it after), and names the first message whose
text a later rendering changes, with what changed. A rewrite is a warning, not a failure: the
engine continues the episode on a new training row there (it forks).
"""

from __future__ import annotations

import difflib
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from agentgrpo.doctor.checks import (
    CheckResult,
    Setup,
    Status,
    probe_call,
    shared_prefix,
    what_happened,
)
from rollout import ChatRenderer

_REASONING = "<think>\nFirst I look the word up.\n</think>"


def probe_conversation(schemas: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """user, assistant (reasoning + call), tool, assistant (call), tool, assistant (answer).

    The first turn carries its reasoning inline, as the engine records what the model wrote;
    the second has none, so templates that treat empty reasoning apart are probed too.
    """
    call = probe_call(schemas)
    name = call["function"]["name"]
    return [
        {"role": "user", "content": "Look up 'agent' twice, then answer."},
        {"role": "assistant", "content": _REASONING, "tool_calls": [call]},
        {"role": "tool", "name": name, "content": "agent: one who acts"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": name, "content": "agent: one who acts for another"},
        {"role": "assistant", "content": "An agent is one who acts."},
    ]


def renderings(
    renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]]
) -> list[tuple[int, str]]:
    """The conversation's text after each message, as the engine sees it grow.

    After a message that the model answers next (user, tool) the text ends with the generation
    prompt; after an assistant turn it does not. Consecutive tool messages are one tool turn.

    Returns:
        `(n, text)` pairs: the text of the first `n` messages.

    """
    texts = []
    for end in range(1, len(messages) + 1):
        following = messages[end] if end < len(messages) else None
        if following is not None and following["role"] == messages[end - 1]["role"] == "tool":
            continue
        prompt = messages[end - 1]["role"] != "assistant"
        texts.append((end, renderer.render(messages[:end], generation_prompt=prompt)))
    return texts


def check_history(setup: Setup) -> CheckResult:
    """Check 3: the first rewrite of history in the probe conversation, if there is one."""
    messages = probe_conversation(setup.schemas)
    try:
        renderer = setup.renderer()
        texts = renderings(renderer, messages)
    except Exception as error:  # the template fails on a multi-turn tool conversation
        return CheckResult(
            "history",
            Status.FAIL,
            f"the template fails on a conversation with two tool turns: {what_happened(error)}",
            "use a template that renders multi-turn tool conversations",
        )
    for (_, shorter), (end, longer) in itertools.pairwise(texts):
        if not longer.startswith(shorter):
            return _rewrite(renderer, messages, shorter, longer, messages[end - 1]["role"])
    return CheckResult(
        "history", Status.OK, f"each of {len(texts)} renderings extends the one before: no forks"
    )


def _rewrite(
    renderer: ChatRenderer,
    messages: Sequence[Mapping[str, Any]],
    shorter: str,
    longer: str,
    added: str,
) -> CheckResult:
    """The warning for a `longer` rendering (after an `added` message) that rewrites `shorter`."""
    at = len(shared_prefix(shorter, longer))
    index, end = _message_at(renderer, messages, shorter, at)
    line_start = shorter.rfind("\n", 0, at) + 1  # diff whole lines: `<think>`, not `hink>`
    change = summarise_change(shorter[line_start:end], longer[line_start:])
    after = "a tool result follows it" if added == "tool" else "the model's turn is added"
    return CheckResult(
        "history",
        Status.WARNING,
        f"the template rewrites {_turn_name(messages, index)} once {after}: {change}; the run "
        f"will fork training rows there (a new row from that turn on)",
        "none needed, forking keeps training token-exact; a template that renders past turns "
        "as they were (such as a family's *_training.jinja) trains one row per episode",
    )


def _message_at(
    renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]], text: str, at: int
) -> tuple[int | None, int]:
    """The message whose rendering covers character `at` of `text`, and where that ends.

    None stands for the generation prompt after the last message. `text` renders some prefix
    of `messages`; each shorter prefix, rendered on its own, marks where a message ends.
    """
    for end in range(1, len(messages) + 1):
        part = renderer.render(messages[:end], generation_prompt=False)
        if len(part) > at and text.startswith(part[: at + 1]):
            return end - 1, min(len(part), len(text))
        if not text.startswith(part):
            break
    return None, len(text)


def _turn_name(messages: Sequence[Mapping[str, Any]], index: int | None) -> str:
    """`assistant turn 2`, `tool result 1`, `the user message`, or `the generation prompt`."""
    if index is None:
        return "the generation prompt"
    role = messages[index]["role"]
    if role in ("assistant", "tool"):
        count = sum(m["role"] == role for m in messages[: index + 1])
        return f"{'assistant turn' if role == 'assistant' else 'tool result'} {count}"
    return f"the {role} message"


def summarise_change(old: str, new: str, most: int = 2) -> str:
    """What turned `old` into the start of `new`, in words: `drops '<think>...'` and the like.

    Text `new` adds past the end of `old` (what follows in the longer conversation) is not a
    change.

    >>> summarise_change("<think>x</think>call", "call, then more")
    "drops '<think>x</think>'"
    >>> summarise_change("a b", "a c b")
    "inserts 'c '"
    """
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    changes = []
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal" or (tag == "insert" and i1 == len(old)):
            continue
        if tag == "delete":
            changes.append(f"drops {_quote(old[i1:i2])}")
        elif tag == "insert":
            changes.append(f"inserts {_quote(new[j1:j2])}")
        else:
            changes.append(f"replaces {_quote(old[i1:i2])} with {_quote(new[j1:j2])}")
    return ", then ".join(changes[:most]) or "changes its text"


def _quote(text: str, width: int = 60) -> str:
    return repr(text[:width]) + ("..." if len(text) > width else "")
