"""An agent of your own, trained by agentgrpo.

    agentgrpo run agent:examples/calculator_agent.py:solve

`solve` is an ordinary OpenAI-client agent with its own loop and its own tool. agentgrpo gives
each episode a client pointed at the policy it is training (a loopback server), records every
request token by token, and trains on what `solve` returns as the reward. The same function runs
against any OpenAI-compatible server: `asyncio.run(solve(openai.AsyncOpenAI(), row))`.

`dataset(split)` beside it gives the task rows (`--dataset FILE.jsonl` replaces them): sums of
two numbers, train and eval drawn from different seeds; `episode_limits` what an episode needs.
"""

from __future__ import annotations

import json
import random

import datasets

# What an episode needs (`agentgrpo run` uses these unless told otherwise): a call, its result
# and the answer fit in 192 tokens, in at most 3 requests.
episode_limits = {"max_completion_length": 192, "max_turns": 3}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers and return the sum.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]


def add(a: float, b: float) -> float:
    """The agent's tool: it runs here, in the agent, not in agentgrpo."""
    return a + b


async def solve(client, row: dict) -> float:
    """Answer `row["question"]`, calling `add` as the model asks; 1.0 for the right sum."""
    messages = [
        {"role": "system", "content": "Use the add tool, then give the sum as a number."},
        {"role": "user", "content": row["question"]},
    ]
    for _ in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(str(row["answer"]) in (message.content or ""))
        for call in message.tool_calls:
            try:
                result = str(round(add(**json.loads(call.function.arguments))))
            except (TypeError, ValueError) as error:  # the model's mistake: tell it
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0


def dataset(split: str = "train") -> datasets.Dataset:
    """64 train or 32 eval questions "What is A + B?" (A, B in 10..99), from separate seeds."""
    draw = random.Random(0 if split == "train" else 1)
    pairs = [
        (draw.randint(10, 99), draw.randint(10, 99)) for _ in range(64 if split == "train" else 32)
    ]
    return datasets.Dataset.from_list(
        [{"question": f"What is {a} + {b}?", "answer": a + b} for a, b in pairs]
    )
