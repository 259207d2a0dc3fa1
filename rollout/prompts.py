"""The conversation an episode starts with: the row's prompt, its images, and reset's text."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rollout.images import with_observation_parts, with_row_images


def prompt_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The conversation a row starts with: its `prompt`, a string or a list of messages."""
    prompt = row["prompt"]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    messages = [dict(m) for m in prompt]
    if not messages or messages[-1].get("role") != "user":
        raise ValueError(f"a conversational prompt must end with a user message: {prompt!r}")
    return messages


def with_observation(
    messages: list[dict[str, Any]], observation: str | list[Any] | None
) -> list[dict[str, Any]]:
    """Add reset's text: on a new line of the last user message, or as the prompt itself.

    A row without a `prompt` column leaves the environment to state the task (TRL's
    environment-owned data): its text is the user's message, and when `reset` returns None
    the message is empty, as in TRL (the environment's tools and the template still frame
    the task). A list (texts and images, for a vision-language model) is added as content
    parts, in order (`rollout.images.with_observation_parts`), and so is a text when the last
    user message's content is already parts (its images kept).
    """
    if isinstance(observation, list):
        return with_observation_parts(messages, observation)
    if observation and messages and isinstance(messages[-1].get("content"), list):
        return with_observation_parts(messages, [observation])
    if not messages:
        return [{"role": "user", "content": observation or ""}]
    if not observation:
        return messages
    content = messages[-1].get("content") or ""
    last = {**messages[-1], "content": f"{content}\n{observation}" if content else observation}
    return [*messages[:-1], last]


def row_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The row's prompt messages with its images (`with_row_images`); none without a prompt.

    Raises:
        ValueError: The row's images do not fit its prompt, or cannot be shown, naming the row.
    """
    if "prompt" not in row:
        return []
    try:
        return with_row_images(prompt_messages(row), row)
    except ValueError as error:
        raise ValueError(f"{error}. Row: {show_row(row)}") from None


def show_row(row: Mapping[str, Any], width: int = 200) -> str:
    """The row as error messages show it: its repr, cut to `width` characters."""
    text = repr(dict(row))
    return text if len(text) <= width else text[: width - 3] + "..."
