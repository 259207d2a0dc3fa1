"""`tool_call_match`: whether an episode's tool calls match the row's ground truth.

The ready reward of function-calling datasets (`rollout.row_tools`). It reads the calls the
model made from the assistant messages of the completion (every turn's, in order) and compares
them with the row's gold calls, in one of two formats:

- ``ground_truth`` (BFCL's ``possible_answer``): a list of ``{function_name: {argument:
  [acceptable values...]}}``. An argument whose list holds ``""`` may be left out. A dict
  value's acceptable values are themselves ``{key: [acceptable values...]}``.
- ``answers`` (xLAM's): a list of ``{"name", "arguments"}``, each argument's value the one
  acceptable value.

Either may be a JSON string of that list. The calls match when there are as many as gold calls
and they pair up one to one, in any order (parallel calls), each with a gold call of its name
whose every argument it gives is acceptable and whose every argument it leaves out may be left
out. Values compare as JSON does, with an integer equal to the same float (``5 == 5.0``), never
a bool to a number; strings compare ignoring case, whitespace and the characters ``,./-_*^``
(as BFCL's checker does); lists item by item. The score is 1.0 or 0.0: there is no partial
credit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

_IGNORED_IN_STRINGS = re.compile(r"[\s,./\-_*^]")

#: A gold call: the function's name and each argument's acceptable values.
GoldCall = tuple[str, Mapping[str, Sequence[Any]]]


def tool_call_match(
    completions: Sequence[Any],
    ground_truth: Sequence[Any] | None = None,
    answers: Sequence[Any] | None = None,
) -> list[float | None]:
    """1.0 where the completion's tool calls match the row's gold calls, else 0.0.

    Args:
        completions: One conversational completion (a list of messages) per sample.
        ground_truth: BFCL's gold calls per sample (a dataset column), or None.
        answers: xLAM's gold calls per sample (a dataset column), read where the row has no
            ``ground_truth``.

    Returns:
        Per sample: 1.0 or 0.0; None where the row has no gold calls.

    Raises:
        ValueError: The rows have neither column, a completion is text (the run played it
            without tools, so its calls were never parsed), or gold calls are malformed.

    Examples:
        >>> call = {"type": "function", "function": {"name": "area", "arguments": {"r": 2}}}
        >>> turn = [{"role": "assistant", "content": "", "tool_calls": [call]}]
        >>> tool_call_match([turn, turn], ground_truth=[[{"area": {"r": [2, 2.0]}}],
        ...                                              [{"area": {"r": [3]}}]])
        [1.0, 0.0]
        >>> tool_call_match([turn], answers=['[{"name": "area", "arguments": {"r": 2}}]'])
        [1.0]

    """
    if ground_truth is None and answers is None:
        raise ValueError(
            "tool_call_match compares calls with a 'ground_truth' column (BFCL's format) or "
            "an 'answers' column (xLAM's); the dataset has neither"
        )
    rewards: list[float | None] = []
    for i, completion in enumerate(completions):
        gold = _gold_calls(
            None if ground_truth is None else ground_truth[i],
            None if answers is None else answers[i],
        )
        if gold is None:
            rewards.append(None)
            continue
        rewards.append(1.0 if _calls_match(called_tools(completion), gold) else 0.0)
    return rewards


def called_tools(completion: Any) -> list[tuple[str, dict[str, Any]]]:
    """The (name, arguments) of every tool call in the completion's assistant messages.

    Raises:
        ValueError: The completion is text rather than messages.
    """
    if isinstance(completion, str):
        raise ValueError(
            "tool_call_match reads tool calls from conversational completions, and this one "
            "is text: the episode offered no tools. Give the rows a 'tools' column "
            "(rollout.row_tools) or the run tools"
        )
    calls = []
    for message in completion:
        if message.get("role") != "assistant":
            continue
        for call in message.get("tool_calls") or ():
            function = call.get("function", call)
            arguments = function.get("arguments") or {}
            if isinstance(arguments, str):
                arguments = _json_or_none(arguments) or {}
            calls.append((function.get("name"), arguments))
    return calls


def _gold_calls(bfcl: Any, xlam: Any) -> list[GoldCall] | None:
    """The gold calls of one row, from BFCL's column if it has a value, else xLAM's."""
    if isinstance(bfcl, str):
        bfcl = json.loads(bfcl)
    if bfcl is not None:
        if not isinstance(bfcl, list) or not all(
            isinstance(c, Mapping) and len(c) == 1 for c in bfcl
        ):
            raise ValueError(
                "a 'ground_truth' value is a list of {function_name: {argument: [acceptable "
                f"values...]}} (BFCL's format), not {bfcl!r}"
            )
        return [next(iter(call.items())) for call in bfcl]
    if isinstance(xlam, str):
        xlam = json.loads(xlam)
    if xlam is None:
        return None
    if not isinstance(xlam, list) or not all(isinstance(c, Mapping) and "name" in c for c in xlam):
        raise ValueError(
            'an \'answers\' value is a list of {"name", "arguments"} (xLAM\'s format), '
            f"not {xlam!r}"
        )
    return [(c["name"], _acceptable(c.get("arguments") or {})) for c in xlam]


def _acceptable(arguments: Mapping[str, Any]) -> dict[str, list[Any]]:
    """The exact arguments of xLAM as acceptable values of BFCL: each value its only one."""

    def value(item: Any) -> Any:
        if isinstance(item, Mapping):
            return _acceptable(item)
        if isinstance(item, list):
            return [value(x) for x in item]
        return item

    return {name: [value(item)] for name, item in arguments.items()}


def _calls_match(calls: list[tuple[str, dict[str, Any]]], gold: list[GoldCall]) -> bool:
    """Whether the calls and the gold calls pair up one to one (Kuhn's bipartite matching)."""
    if len(calls) != len(gold):
        return False
    fits = [[_call_fits(call, g) for g in gold] for call in calls]
    partner: list[int | None] = [None] * len(gold)  # the call paired with each gold call

    def pair(c: int, seen: set[int]) -> bool:
        for g in range(len(gold)):
            if fits[c][g] and g not in seen:
                seen.add(g)
                if partner[g] is None or pair(partner[g], seen):  # type: ignore[arg-type]
                    partner[g] = c
                    return True
        return False

    return all(pair(c, set()) for c in range(len(calls)))


def _call_fits(call: tuple[str, Any], gold: GoldCall) -> bool:
    name, arguments = call
    return name == gold[0] and _arguments_fit(arguments, gold[1])


def _arguments_fit(arguments: Any, acceptable: Mapping[str, Sequence[Any]]) -> bool:
    """Every argument given is acceptable; every one left out may be (its values hold "")."""
    if not isinstance(arguments, Mapping):
        return False
    for name, values in acceptable.items():
        if name not in arguments and "" not in values:
            return False
    return all(
        name in acceptable and any(_same(value, ok) for ok in acceptable[name])
        for name, value in arguments.items()
    )


def _same(value: Any, gold: Any) -> bool:
    """`value` equals the acceptable value `gold` (module docstring)."""
    if isinstance(gold, Mapping):
        return _arguments_fit(value, gold)
    if isinstance(gold, list):
        return (
            isinstance(value, list)
            and len(value) == len(gold)
            and all(_same(v, g) for v, g in zip(value, gold, strict=True))
        )
    if isinstance(gold, bool) or isinstance(value, bool):
        return value is gold
    if isinstance(gold, int | float):
        return isinstance(value, int | float) and value == gold
    if isinstance(gold, str):
        return isinstance(value, str) and _plain(value) == _plain(gold)
    return bool(value == gold)


def _plain(text: str) -> str:
    return _IGNORED_IN_STRINGS.sub("", text).lower()


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None
