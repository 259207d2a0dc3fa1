"""Demonstration conversations as token rows laid out the way the engine lays out episodes.

A warm start trains on these rows, so they must match what the model sees when it plays: the
same template, tool schemas and segment boundaries. The prompt ends with the assistant header;
each assistant turn is encoded on its own, up to and including the end-of-turn text, and is the
only part with mask 1; whatever the template writes after it (tool results, the next header) has
mask 0, as a tool turn has in an episode.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rollout.template import ChatRenderer, TemplateDriftError


def demonstration_ids(
    renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]], stop_text: str
) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and its mask (1 on assistant turns, 0 elsewhere).

    Args:
        renderer: The renderer episodes use (its template and tool schemas).
        messages: A conversation starting with the prompt; assistant turns may carry
            `tool_calls`, and tool results are `{"role": "tool", "name": ..., "content": ...}`.
        stop_text: The text that ends an assistant turn (the model's end-of-turn token).

    Raises:
        ValueError: The conversation has no assistant turn, or starts with one.
        TemplateDriftError: The template renders a prefix of the conversation differently
            once later turns follow, or an assistant turn does not end with `stop_text`.

    """
    roles = [m["role"] for m in messages]
    if "assistant" not in roles or roles[0] == "assistant":
        raise ValueError(
            f"a demonstration needs a prompt followed by at least one assistant turn; "
            f"its roles are {roles}"
        )
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for index, message in enumerate(messages):
        before_reply = index + 1 < len(messages) and roles[index + 1] == "assistant"
        text = renderer.render(messages[: index + 1], generation_prompt=before_reply)
        if not text.startswith(rendered):
            raise TemplateDriftError(
                f"the chat template renders the conversation before message {index} differently "
                f"once message {index} ({message['role']}) follows; demonstrations would teach "
                f"tokens the model never sees when it plays"
            )
        segment, rendered = text[len(rendered) :], text
        for part, trained in _parts(segment, message["role"] == "assistant", stop_text):
            part_ids = renderer.encode(part)
            ids += part_ids
            mask += [int(trained)] * len(part_ids)
    return ids, mask


def _parts(segment: str, assistant: bool, stop_text: str) -> list[tuple[str, bool]]:
    """Split an assistant turn's text into the trained turn and the untrained text after it."""
    if not assistant:
        return [(segment, False)]
    end = segment.find(stop_text)
    if end < 0:
        raise TemplateDriftError(
            f"the chat template does not end assistant turns with {stop_text!r}, the model's "
            f"end-of-turn text, so a demonstration cannot show where a turn stops"
        )
    end += len(stop_text)
    return [(segment[:end], True), (segment[end:], False)]
