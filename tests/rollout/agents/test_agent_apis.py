"""Agents written against OpenAI's Responses API and Anthropic's Messages API, on the endpoint.

The real `openai` client's `responses.create` and the real `anthropic` client's
`messages.create` talk over HTTP to the endpoint the engine serves; the generator is the scripted
backend (and, at the end, a tiny real model), so every recorded token can be checked against
what was sampled: the same rows as the engine's own Counter episode.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from rollout import EpisodeConfig, Finish, RolloutEngine, TransformersBackend
from rollout.agents import Agent
from rollout.agents.messages_api import anthropic_client
from tests.rollout.agents.test_agents import COUNTER_TOOLS, agent_engine, play
from tests.support.episodes import (
    COUNTER_TURNS,
    counter_segments,
    scripted_episode,
)

# The Counter's tools in each API's form: the Responses tool is the chat function, flattened.
RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in COUNTER_TOOLS]
MESSAGES_TOOLS = [
    {"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
    for f in (tool["function"] for tool in COUNTER_TOOLS)
]


def first_prompt(row: dict) -> str:
    return f"{row['prompt']}\nThe counter is at 0."


async def responses_counter(client: openai.AsyncOpenAI, row: dict) -> float:
    """Counter through `responses.create`, sending the whole conversation back each time."""
    value, items = 0, [{"role": "user", "content": first_prompt(row)}]
    while True:
        response = await client.responses.create(model="m", input=items, tools=RESPONSES_TOOLS)
        items += [item.model_dump(exclude_none=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return float(value == row["target"] and response.output_text == "Done.")
        for call in calls:
            value += json.loads(call.arguments)["step"]
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": str(value)})  # fmt: skip


def messages_counter(client: openai.OpenAI, row: dict) -> float:
    """Counter through the `anthropic` client's `messages.create` (sync, in a worker thread)."""
    claude = anthropic_client(client)
    value, turns = 0, [{"role": "user", "content": first_prompt(row)}]
    while True:
        message = claude.messages.create(
            model="m", max_tokens=256, messages=turns, tools=MESSAGES_TOOLS
        )
        turns.append({"role": "assistant", "content": message.content})
        calls = [block for block in message.content if block.type == "tool_use"]
        if message.stop_reason != "tool_use":
            return float(value == row["target"] and message.content[0].text == "Done.")
        results = []
        for call in calls:
            value += call.input["step"]
            results.append({"type": "tool_result", "tool_use_id": call.id, "content": str(value)})
        turns.append({"role": "user", "content": results})


def test_a_responses_agent_records_the_rows_the_engine_records(tokenizer):
    [episode] = play(agent_engine(tokenizer, responses_counter))
    assert episode.rows == scripted_episode(tokenizer, COUNTER_TURNS).rows
    assert episode.finish is Finish.STOP
    assert episode.agent_rewards == {"responses_counter": 1.0}
    assert [(c.name, dict(c.arguments), c.result) for c in episode.tool_calls] == [
        ("increment", {"step": 3}, "3"),
        ("increment", {"step": 4}, "7"),
    ]


def test_a_messages_agent_records_the_sampled_turns_and_masks_the_tool_results(tokenizer):
    [episode] = play(agent_engine(tokenizer, messages_counter))
    [row] = episode.rows
    segments = counter_segments(tokenizer)
    assert row.completion_ids == [t for ids, _ in segments for t in ids]
    assert row.loss_mask == [m for ids, m in segments for _ in ids]
    assert episode.agent_rewards == {"messages_counter": 1.0}
    assert (episode.stats.turns, episode.stats.tool_calls) == (3, 2)
    # The tools reach the template as the chat function they describe.
    assert '"name": "increment"' in tokenizer.decode(row.prompt_ids)


def test_previous_response_id_continues_the_row_token_exactly(tokenizer):
    async def chained(client: openai.AsyncOpenAI, row: dict) -> float:
        instructions = "Use the tools."
        response = await client.responses.create(
            model="m", instructions=instructions, input=first_prompt(row), tools=RESPONSES_TOOLS
        )
        value = 0
        while calls := [item for item in response.output if item.type == "function_call"]:
            outputs = []
            for call in calls:
                value += json.loads(call.arguments)["step"]
                outputs.append({"type": "function_call_output", "call_id": call.call_id,
                                "output": str(value)})  # fmt: skip
            response = await client.responses.create(
                model="m", instructions=instructions, previous_response_id=response.id,
                input=outputs, tools=RESPONSES_TOOLS,
            )  # fmt: skip
        return float(value == row["target"])

    [episode] = play(agent_engine(tokenizer, chained))
    [row] = episode.rows  # each request extended the last: one row, no fork
    segments = counter_segments(tokenizer)
    assert row.completion_ids == [t for ids, _ in segments for t in ids]
    assert row.loss_mask == [m for ids, m in segments for _ in ids]
    assert "Use the tools." in tokenizer.decode(row.prompt_ids)
    assert episode.agent_rewards == {"chained": 1.0} and episode.forks == 0


def test_streamed_replies_of_both_apis_are_whole_and_record_the_same(tokenizer):
    seen = {}

    async def streaming(client: openai.AsyncOpenAI, row: dict) -> float:
        ask = [{"role": "user", "content": first_prompt(row)}]
        async with client.responses.stream(model="m", input=ask, tools=RESPONSES_TOOLS) as stream:
            kinds = [event.type async for event in stream]
            response = await stream.get_final_response()
        [call] = response.output
        seen["responses"] = (kinds[0], kinds[-1], call.name, json.loads(call.arguments))
        claude = anthropic_client(client)
        turns = [{"role": "user", "content": first_prompt(row)}]
        async with claude.messages.stream(
            model="m", max_tokens=64, messages=turns, tools=MESSAGES_TOOLS
        ) as stream:
            message = await stream.get_final_message()
        [block] = message.content
        seen["messages"] = (message.stop_reason, block.name, block.input, message.usage)
        return 0.0

    [episode] = play(agent_engine(tokenizer, streaming))
    assert seen["responses"] == (
        "response.created", "response.completed", "increment", {"step": 3}
    )  # fmt: skip
    stop_reason, name, arguments, usage = seen["messages"]
    assert (stop_reason, name, arguments) == ("tool_use", "increment", {"step": 3})
    first_turn = counter_segments(tokenizer)[0][0]
    assert usage.output_tokens == len(first_turn)
    # Two first requests, neither extending the other: two rows, each the sampled first turn.
    assert [r.completion_ids for r in episode.rows] == [first_turn, first_turn]
    assert all(m == 1 for r in episode.rows for m in r.loss_mask)


def test_replies_carry_token_ids_and_logprobs_on_request(tokenizer):
    seen = {}

    async def agent(client: openai.AsyncOpenAI, row: dict) -> float:
        ask = [{"role": "user", "content": "Hi"}]
        seen["responses"] = await client.responses.create(
            model="m", input=ask, include=["message.output_text.logprobs"],
            extra_body={"return_token_ids": True},
        )  # fmt: skip
        seen["messages"] = await anthropic_client(client).messages.create(
            model="m", max_tokens=64, messages=ask, extra_body={"return_token_ids": True}
        )
        return 0.0

    [episode] = play(agent_engine(tokenizer, agent, turns=["Hello there."]))
    row = episode.rows[-1]
    for reply in (seen["responses"], seen["messages"]):
        assert reply.model_extra["prompt_token_ids"] == row.prompt_ids
        assert reply.model_extra["token_ids"] == row.completion_ids
    [text] = seen["responses"].output[0].content
    assert [t.logprob for t in text.logprobs] == row.sampler_logprobs
    assert seen["responses"].output_text == seen["messages"].content[0].text == "Hello there."


def test_a_messages_agent_that_rewrites_history_forks_a_new_row(tokenizer):
    async def forgetful(client: openai.AsyncOpenAI, row: dict) -> float:
        claude = anthropic_client(client)
        ask = {"role": "user", "content": "Count to 7."}
        first = await claude.messages.create(
            model="m", max_tokens=64, messages=[ask], tools=MESSAGES_TOOLS
        )
        summary = f"Count to 7. The counter is at 3 ({first.content[0].id})."
        await claude.messages.create(
            model="m", max_tokens=64, messages=[{"role": "user", "content": summary}],
            tools=MESSAGES_TOOLS,
        )  # fmt: skip
        return 1.0

    [episode] = play(agent_engine(tokenizer, forgetful))
    assert len(episode.rows) == 2 and episode.forks == 1
    assert "The counter is at 3" in tokenizer.decode(episode.rows[1].prompt_ids)


def test_requests_either_api_cannot_honour_get_a_clear_400(tokenizer):
    errors = []

    async def picky(client: openai.AsyncOpenAI, row: dict) -> float:
        user = {"role": "user", "content": "x"}
        for extra in (
            {"input": [user, {"type": "reasoning", "id": "r", "summary": []}]},
            {"input": [user], "tools": [{"type": "web_search"}]},
            {"input": [user], "text": {"format": {"type": "json_object"}}},
            {"input": [user], "previous_response_id": "resp_unknown"},
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.responses.create(model="m", **extra)
            errors.append(refused.value.body["message"])
        claude = anthropic_client(client)
        image = {"type": "image", "source": {"type": "url", "url": "http://x"}}
        for extra in (
            {"messages": [{"role": "user", "content": [image]}]},
            {"messages": [user], "stop_sequences": ["\n"]},
            {"messages": [user], "tools": [{"type": "web_search_20250305", "name": "web"}]},
        ):
            with pytest.raises(anthropic.BadRequestError) as refused:
                await claude.messages.create(model="m", max_tokens=8, **extra)
            errors.append(refused.value.body["error"]["message"])
        await client.responses.create(model="m", input="x")
        return 0.0

    [episode] = play(agent_engine(tokenizer, picky, turns=["ok"]), rows=[{}])
    assert episode.finish is Finish.STOP and episode.stats.turns == 1
    assert [e.split(" ")[:2] for e in errors] == [
        ["input[1]", "is"],
        ["tools[0]", "is"],
        ["text.format", "'json_object'"],
        ["previous_response_id", "'resp_unknown'"],
        ["messages[0].content[0]", "is"],
        ["stop_sequences", "are"],
        ["tools[0]", "('web_search_20250305')"],
    ]
    assert "'reasoning' item; supported: message, function_call" in errors[0]
    assert "'image' block (role user); supported: text, tool_use" in errors[4]


def test_wrong_typed_fields_get_a_400_in_each_apis_form(tokenizer):
    answers = {}

    def agent(client: openai.OpenAI, row: dict) -> float:
        base = str(client.base_url)
        user = {"role": "user", "content": "x"}
        bad = {
            "responses": {"input": [user], "max_output_tokens": True},
            "messages": {"messages": [user], "max_tokens": 0, "stream": "yes"},
        }
        for route, body in bad.items():
            answers[route] = httpx.post(f"{base}{route}", json=body, timeout=60)
        answers["gone"] = httpx.post(
            base.replace("/sessions/", "/sessions/x") + "messages", json=bad["messages"]
        )
        client.responses.create(model="m", input="x")
        return 0.0

    play(agent_engine(tokenizer, agent, turns=["ok"]), rows=[{}])
    assert [answers[r].status_code for r in ("responses", "messages", "gone")] == [400, 400, 404]
    assert (
        "'max_output_tokens' must be a whole number"
        in answers["responses"].json()["error"]["message"]
    )
    assert answers["messages"].json()["type"] == "error"
    assert answers["messages"].json()["error"]["type"] == "invalid_request_error"
    assert answers["gone"].json()["error"]["type"] == "not_found_error"


def real_engine(model, tokenizer, agent) -> RolloutEngine:
    return RolloutEngine(
        TransformersBackend.from_tokenizer(model, tokenizer),
        tokenizer,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=256, max_turns=5, temperature=0.0),
        player=Agent(agent).player,
    )


def test_a_tiny_real_model_plays_the_counter_through_the_responses_api(
    tokenizer, tool_calling_tiny_model
):
    [episode] = play(real_engine(tool_calling_tiny_model, tokenizer, responses_counter))
    [row] = episode.rows
    segments = counter_segments(tokenizer)
    assert row.completion_ids == [t for ids, _ in segments for t in ids]
    assert row.loss_mask == [m for ids, m in segments for _ in ids]
    assert all(
        lp == 0.0 for lp, m in zip(row.sampler_logprobs, row.loss_mask, strict=True) if not m
    )
    assert episode.finish is Finish.STOP and episode.agent_rewards == {"responses_counter": 1.0}


def test_a_tiny_real_model_through_the_messages_api_trains_on_exactly_what_it_sampled(
    tokenizer, tool_calling_tiny_model
):
    replies = []

    async def claude_counter(client: openai.AsyncOpenAI, row: dict) -> float:
        claude = anthropic_client(client)
        turns = [{"role": "user", "content": first_prompt(row)}]
        for value in range(3):  # whatever the model does: its tool calls answered, three turns
            message = await claude.messages.create(
                model="m", max_tokens=64, messages=turns, tools=MESSAGES_TOOLS,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            replies.append(message.model_extra)
            turns.append({"role": "assistant", "content": message.content})
            results = [
                {"type": "tool_result", "tool_use_id": block.id, "content": str(value)}
                for block in message.content
                if block.type == "tool_use"
            ]
            turns.append({"role": "user", "content": results or "Go on."})
        return 0.0

    [episode] = play(real_engine(tool_calling_tiny_model, tokenizer, claude_counter))
    [row] = episode.rows  # every request extended the one before
    context = row.prompt_ids + row.completion_ids
    assert replies[0]["prompt_token_ids"] == row.prompt_ids
    assert context == replies[-1]["prompt_token_ids"] + replies[-1]["token_ids"]
    trained = [0] * len(context)
    for reply in replies:  # each reply's sampled ids sit right after the context it was shown
        start = len(reply["prompt_token_ids"])
        assert context[start : start + len(reply["token_ids"])] == reply["token_ids"]
        trained[start : start + len(reply["token_ids"])] = [1] * len(reply["token_ids"])
    assert row.loss_mask == trained[len(row.prompt_ids) :]
