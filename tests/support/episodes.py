"""The Counter episode as tests script it: its row, the turns, and the engine that plays it."""

from __future__ import annotations

import json

import anyio

from environments import Counter, environment_tools
from rollout import Episode, EpisodeConfig, EpisodeRow, RolloutEngine, ScriptedBackend
from tools import call_tool

COUNTER_ROW = {"prompt": "Make the counter reach 7.", "target": 7}


def tool_call(name: str, **arguments) -> str:
    """A Hermes-style tool call as the model writes it."""
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


COUNTER_TURNS = [tool_call("increment", step=3), tool_call("increment", step=4), "Done."]

# What the chatml_tools template adds after the model's <|im_end|> for a tool result.
TOOL_TURN = (
    "\n<|im_start|>tool\n<tool_response>{}</tool_response><|im_end|>\n<|im_start|>assistant\n"
)


def counter_segments(tokenizer) -> list[tuple[list[int], int]]:
    """The completion of the COUNTER_TURNS episode as (token ids, loss mask) segments, by hand."""
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    eos = [tokenizer.eos_token_id]
    return [
        (encode(COUNTER_TURNS[0]) + eos, 1),
        (encode(TOOL_TURN.format(3)), 0),
        (encode(COUNTER_TURNS[1]) + eos, 1),
        (encode(TOOL_TURN.format(7)), 0),
        (encode(COUNTER_TURNS[2]) + eos, 1),
    ]


def single_row(episode: Episode) -> EpisodeRow:
    """The one training row of an episode that did not fork."""
    [row] = episode.rows
    return row


def scripted_backend(tokenizer, turns: list[str], delay_s: float = 0.0) -> ScriptedBackend:
    """Answer turn k of every episode with turns[k] (k = tool responses seen so far)."""
    eos = tokenizer.eos_token_id

    def respond(context: list[int]) -> list[int]:
        k = tokenizer.decode(context).count("<tool_response>")
        return tokenizer.encode(turns[min(k, len(turns) - 1)], add_special_tokens=False) + [eos]

    return ScriptedBackend(respond, [eos], delay_s=delay_s)


def scripted_episode(tokenizer, turns: list[str], row=COUNTER_ROW) -> Episode:
    """The Counter episode the engine records when the model says `turns` (k-th after k tools)."""
    engine = RolloutEngine(
        scripted_backend(tokenizer, turns),
        tokenizer,
        environment_factory=Counter,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=512),
    )
    [episode] = anyio.run(engine.run, [row])
    return episode


def replay(env: object, conversation: list[dict]) -> list[str]:
    """Play every tool call of a conversation on `env` as the engine would; return the results."""
    tools, results = environment_tools(env), []
    for message in conversation:
        for requested in message.get("tool_calls", []):
            function = requested["function"]
            result = anyio.run(call_tool, tools, function["name"], function["arguments"], None)
            assert result.error is None, result.content
            results.append(result.content)
    return results
