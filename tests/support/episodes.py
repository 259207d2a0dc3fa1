"""The Counter episode as tests script it: its row, the turns, and the engine that plays it."""

from __future__ import annotations

import json

import anyio

from environments import Counter, class_tools, environment_tools
from rollout import (
    ChatRenderer,
    Episode,
    EpisodeConfig,
    EpisodeRow,
    RolloutEngine,
    ScriptedBackend,
    load_template,
)
from rollout.demonstrations import demonstration_ids
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


def chatml_engine(backend, tokenizer, environment_factory, **episode_fields) -> RolloutEngine:
    """An engine playing `environment_factory` in the chatml_tools template.

    `episode_fields` are EpisodeConfig's (its defaults where not given).
    """
    return RolloutEngine(
        backend,
        tokenizer,
        environment_factory=environment_factory,
        chat_template="chatml_tools",
        config=EpisodeConfig(**episode_fields),
    )


def counter_engine(backend, tokenizer, **episode_fields) -> RolloutEngine:
    """An engine playing Counter in the chatml_tools template; `episode_fields`: EpisodeConfig's."""
    return chatml_engine(backend, tokenizer, Counter, **episode_fields)


def scripted_episode(tokenizer, turns: list[str], row=COUNTER_ROW) -> Episode:
    """The Counter episode the engine records when the model says `turns` (k-th after k tools)."""
    engine = counter_engine(
        scripted_backend(tokenizer, turns), tokenizer, max_completion_length=512
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


class Workbench(Counter):
    """Counter with a tool that raises and one that never returns."""

    def explode(self, x: int) -> int:
        """Raise, always.

        Args:
            x: Ignored.
        """
        raise RuntimeError("boom")

    async def hang(self, x: int) -> int:
        """Never return.

        Args:
            x: Ignored.
        """
        await anyio.sleep(60)
        return x


def assert_demonstrations_train_every_call(tokenizer, environment_class) -> None:
    """Four demonstrations, laid out in the engine's template, train each of their tool calls."""
    schemas = [tool.schema for tool in class_tools(environment_class).values()]
    renderer = ChatRenderer(tokenizer, load_template(tokenizer, "chatml_tools"), schemas)
    for conversation in environment_class.demonstrations(4):
        [(ids, mask)] = demonstration_ids(renderer, conversation, "<|im_end|>")
        trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
        assert trained.count("<tool_call>") == sum("tool_calls" in m for m in conversation)
