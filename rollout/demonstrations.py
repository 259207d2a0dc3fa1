"""Demonstration conversations as token rows laid out the way the engine lays out episodes.

A warm start trains on these rows, so they must match what the model sees when it plays: the
same template, tool schemas and segment boundaries. A row starts with a prompt that ends with
the assistant header; each assistant turn is encoded on its own, up to and including the
end-of-turn text, and is the only part with mask 1; what the template writes after it (tool
results, the next header) has mask 0, as a tool turn has in an episode.

Where the template renders the conversation differently once the messages after an assistant
turn are added (Qwen3 drops a past turn's empty `<think>` block), the demonstration *forks*
as an episode does (`rollout.types.Episode`): the row ends with that assistant turn, and the
next one starts with the template's fresh rendering of the conversation before the next
assistant turn, generation prompt included. So each assistant turn is trained in exactly the
context an episode playing the same turns would sample it in.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from rollout.template import ChatRenderer, TemplateDriftError


class DemonstrationRow(NamedTuple):
    """One row of a demonstration: token ids and their mask (1 on assistant turns, 0 elsewhere).

    `ids` starts with the row's prompt (mask 0). For a template that never rewrites history
    a demonstration is one row: the whole conversation, with whatever the template writes after
    the last assistant turn (mask 0) at the end. A row closed by a fork ends with the stop text
    of its last assistant turn, as the episode's row does.
    """

    ids: list[int]
    mask: list[int]


def demonstration_ids(
    renderer: ChatRenderer, messages: Sequence[Mapping[str, Any]], stop_text: str
) -> list[DemonstrationRow]:
    """A conversation's token rows, one more for each fork of the template (see the module).

    Args:
        renderer: The renderer episodes use (its template, tool schemas and template kwargs).
        messages: A conversation starting with the prompt; assistant turns may carry
            `tool_calls`, and tool results are `{"role": "tool", "name": ..., "content": ...}`.
        stop_text: The text that ends an assistant turn (the model's end-of-turn token).

    Returns:
        The rows in order; every row has at least one assistant turn (mask 1).

    Raises:
        ValueError: The conversation has no assistant turn, or starts with one.
        TemplateDriftError: An assistant turn does not end with `stop_text`, or its rendering
            does not start with the generation prompt it follows, so the text the model writes
            after that prompt cannot be told.

    """
    turns = _assistant_turns(messages)
    prompt_text = renderer.render(messages[: turns[0]], generation_prompt=True)
    rows = [_prompt_row(renderer, prompt_text)]
    for turn, end in zip(turns, [*turns[1:], len(messages)], strict=True):
        before = renderer.render(messages[: turn + 1], generation_prompt=False)
        trained, glue = _assistant_text(prompt_text, before, stop_text, turn)
        _extend(rows[-1], renderer.encode(trained), 1)
        last = end == len(messages)
        after = renderer.render(messages[:end], generation_prompt=not last)
        if after.startswith(before):
            _extend(rows[-1], renderer.encode(glue + after[len(before) :]), 0)
        elif not last:  # the template rewrote history: fork, as an episode does
            rows.append(_prompt_row(renderer, after))
        prompt_text = after
    return rows


def _assistant_turns(messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """The indices of the assistant messages; raise unless a prompt precedes the first."""
    roles = [m["role"] for m in messages]
    turns = [index for index, role in enumerate(roles) if role == "assistant"]
    if not turns or turns[0] == 0:
        raise ValueError(
            f"a demonstration needs a prompt followed by at least one assistant turn; "
            f"its roles are {roles}"
        )
    return turns


def _assistant_text(prompt_text: str, rendered: str, stop_text: str, turn: int) -> tuple[str, str]:
    """The assistant turn's text up to and including `stop_text`, and the text after it."""
    if not rendered.startswith(prompt_text):
        raise TemplateDriftError(
            f"the chat template renders assistant turn {turn} in a way that does not start with "
            f"the generation prompt before it, so the demonstration cannot tell what the model "
            f"writes after that prompt; use a template whose assistant turns start with its "
            f"generation prompt"
        )
    segment = rendered[len(prompt_text) :]
    end = segment.find(stop_text)
    if end < 0:
        raise TemplateDriftError(
            f"the chat template does not end assistant turns with {stop_text!r}, the model's "
            f"end-of-turn text, so a demonstration cannot show where a turn stops"
        )
    end += len(stop_text)
    return segment[:end], segment[end:]


def _prompt_row(renderer: ChatRenderer, prompt_text: str) -> DemonstrationRow:
    """A new row holding only its prompt (mask 0)."""
    ids = renderer.encode(prompt_text)
    return DemonstrationRow(ids, [0] * len(ids))


def _extend(row: DemonstrationRow, ids: list[int], trained: int) -> None:
    """Append `ids` to the row, all with mask `trained`."""
    row.ids.extend(ids)
    row.mask.extend([trained] * len(ids))
