"""`agentgrpo run agent:FILE:function` and `eval`: short runs of real agents on the tiny model.

Each agent writes every reply the endpoint sent it (with the token ids it asked for) to a file;
the test then finds exactly those tokens, mask 1, with their logprobs, in the episode records
the run wrote: what the server sampled is what was trained on.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.support.agents import assert_replies_were_trained_on
from tests.support.cli import agentgrpo_here
from tests.support.paths import REPO

# An agent with its own loop and tool, on the openai client; it logs each reply it gets.
OPENAI_AGENT = """
import json, os

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "required": ["a", "b"],
                   "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]


def log(reply):
    with open(os.environ["REPLIES"], "a") as f:
        f.write(json.dumps(reply.model_dump()) + "\\n")


async def solve(client, row):
    messages = [{"role": "user", "content": row["prompt"]}]
    for _ in range(3):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS, logprobs=True,
            extra_body={"return_token_ids": True})
        log(reply)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(str(row["answer"]) in (message.content or ""))
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = str(args["a"] + args["b"])
            except Exception as error:
                result = f"error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 0.0
"""

# The same task through the OpenAI Agents SDK, which runs the loop and the tool itself. The
# SDK is given a client that logs each reply's JSON as it arrives.
SDK_AGENT = '''
import json, os

import httpx
import openai
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool,
                    set_tracing_disabled)

set_tracing_disabled(True)


async def log(response):
    await response.aread()
    with open(os.environ["REPLIES"], "a") as f:
        f.write(response.text.strip() + "\\n")


async def solve(client, row):
    logged = openai.AsyncOpenAI(
        base_url=client.base_url, api_key="unused", max_retries=0,
        http_client=httpx.AsyncClient(event_hooks={"response": [log]}))

    @function_tool
    def add(a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: The first number.
            b: The number to add to it.
        """
        return a + b

    agent = Agent(
        name="adder", instructions="Use the add tool, then answer with the number.",
        tools=[add], model=OpenAIChatCompletionsModel(model="policy", openai_client=logged),
        model_settings=ModelSettings(extra_body={"return_token_ids": True}))
    result = await Runner.run(agent, row["prompt"], max_turns=3)
    return float(str(row["answer"]) in str(result.final_output))
'''


@pytest.fixture
def task(tmp_path) -> Path:
    rows = tmp_path / "rows.jsonl"
    with rows.open("w") as f:
        for a in range(8):
            f.write(json.dumps({"prompt": f"What is {a} + 3?", "answer": a + 3}) + "\n")
    return rows


@pytest.mark.parametrize("source", [OPENAI_AGENT, SDK_AGENT], ids=["openai", "agents-sdk"])
def test_a_short_run_trains_on_exactly_what_the_endpoint_sampled(
    source, task, tiny_model_dir, tmp_path, monkeypatch
):
    (tmp_path / "my_agent.py").write_text(textwrap.dedent(source))
    replies = tmp_path / "replies.jsonl"
    monkeypatch.setenv("REPLIES", str(replies))
    out = tmp_path / "out"
    result = agentgrpo_here(
        "run", "agent:my_agent.py:solve", "--dataset", str(task), "--model", str(tiny_model_dir),
        "--chat-template", "chatml_tools", "--output-dir", str(out), "--max-steps", "2",
        "--per-device-train-batch-size", "4", "--num-generations", "2",
        "--max-completion-length", "48", "--max-turns", "3",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "environment  agent:my_agent.py:solve (8 rows)" in result.stdout
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps if "rewards/solve/mean" in s] == [1, 2]
    trained = [s for s in steps if "reward" in s]
    assert all("tools/call_frequency" in s and "turns/fork_frequency" in s for s in trained)
    assert assert_replies_were_trained_on(replies, out / "episodes") >= 8

    replies.unlink()
    result = agentgrpo_here(
        "eval", "agent:my_agent.py:solve", "--dataset", str(task), "--model", str(out / "model"),
        "--chat-template", "chatml_tools", "--num-episodes", "3", "--max-completion-length", "48",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "episodes               3" in result.stdout
    assert len(replies.read_text().splitlines()) >= 3


def test_an_agent_spec_that_names_no_function(user_error, tmp_path):
    (tmp_path / "a.py").write_text("LIMIT = 3\n\ndef solve(client, row):\n    return 1.0\n")
    assert "did you mean" in user_error("run", "agent:a.py:solv", "--dataset", "x.jsonl")
    assert "names a int; an agent is a function" in user_error("run", "agent:a.py:LIMIT")


def test_an_agent_that_cannot_take_client_and_row(user_error, tmp_path):
    (tmp_path / "a.py").write_text("def solve(client):\n    return 1.0\n")
    assert "cannot be called as function(client, row)" in user_error("run", "agent:a.py:solve")


def test_an_agent_run_without_rows(user_error, tmp_path):
    (tmp_path / "a.py").write_text("async def solve(client, row):\n    return 1.0\n")
    message = user_error("run", "agent:a.py:solve")
    assert "agent solve has no task rows of its own; pass --dataset" in message


def test_the_example_agent_brings_its_own_rows(tiny_model_dir):
    """examples/calculator_agent.py: eval takes the held-out rows of its module's dataset()."""
    root = REPO
    result = agentgrpo_here(
        "eval", "agent:examples/calculator_agent.py:solve", "--model", str(tiny_model_dir),
        "--chat-template", "chatml_tools", "--num-episodes", "2", "--max-completion-length", "32",
        cwd=root,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(2 rows, split 'eval'" in result.stderr + result.stdout
    assert "episodes               2" in result.stdout


def test_an_agent_module_states_its_rows_and_episode_limits(monkeypatch):
    from agentgrpo.cli import sources

    monkeypatch.chdir(REPO)
    agent = sources.agent("examples/calculator_agent.py:solve")
    assert dict(agent.episode_limits) == {"max_completion_length": 192, "max_turns": 3}
    train, held_out = sources.rows(agent, None, "train"), sources.rows(agent, None, "eval")
    assert (len(train), len(held_out)) == (64, 32)
    assert not {r["question"] for r in held_out} <= {r["question"] for r in train}

    from agentgrpo.cli import build_parser
    from agentgrpo.cli.commands import _episode_line, _run_settings

    parser, _ = build_parser()
    settings = _run_settings(parser.parse_args(["run", "agent:x", "--max-turns", "2"]), agent)
    assert settings["config"]["max_completion_length"] == 192
    assert _episode_line(192, 2, settings) == (
        "up to 192 tokens, 2 turns (the agent's max_completion_length)"
    )


def test_an_agent_module_with_bad_episode_limits(user_error, tmp_path):
    (tmp_path / "a.py").write_text(
        "episode_limits = {'max_turns': 0}\n\nasync def solve(client, row):\n    return 1.0\n"
    )
    message = user_error("run", "agent:a.py:solve", "--dataset", "x.jsonl")
    assert "episode_limits['max_turns'] must be a whole number >= 1, not 0" in message


def test_doctor_sends_an_agent_to_eval(user_error):
    message = user_error("doctor", "agent:examples/calculator_agent.py:solve")
    assert "is an agent" in message and "agentgrpo eval agent:" in message
