"""The agent endpoint's overhead per request, against calling the generation backend directly.

An agent (`agent:FILE:function`) reaches the policy through `ChatEndpoint`
(`rollout.agents.endpoint`): the openai client serialises the request, it crosses the loopback
interface, aiohttp parses it, the session renders the conversation and checks it continues the
episode's tokens, the backend generates, the reply is parsed for tool calls, serialised and read
back by the client. This script times the same requests three ways, one episode at a time, on the
same backend:

- `direct`: `backend.generate(prompt_ids, params)` with each request's recorded prompt ids and
  sampling parameters (what the engine's own loop costs at the least);
- `session`: `AgentSession.complete` called in-process (rendering, recording, parsing; no HTTP);
- `endpoint`: the agent's `openai.AsyncOpenAI` client through the endpoint, as in a run.

Every episode is 3 tool calls and an answer. The backend is the real `TransformersBackend`
(`--model`, default the embedded SmolLM2-135M-Instruct; `--tiny` for the tests' tiny Llama)
sampling exactly as many tokens as the scripted turn (its only stop id is outside the
vocabulary), whose ids it then returns with the real logprobs; `--scripted` swaps in
`ScriptedBackend`, which spends no compute, so every millisecond left is overhead. Modes
alternate over `--repeats` rounds; the script prints medians, the overhead per request in ms and
as a ratio, and the load average.

Run: `python bench/endpoint.py` (`--scripted` for the overhead alone, `--episodes N`; about 5
minutes on 2 idle cores with the default model).
"""

from __future__ import annotations

import os
import sys

# bench/rollout.py would shadow the rollout package: take bench/ off the path. The repository
# root is appended last, for tests/support/tiny_model.py (for --tiny) in the `tests` package.
sys.path.remove(os.path.dirname(os.path.realpath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))

import argparse
import dataclasses
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import openai
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from agentgrpo.models.default_model import default_model_path
from rollout import (
    Completion,
    EpisodeConfig,
    Pictures,
    SamplingParams,
    ScriptedBackend,
    TransformersBackend,
    get_parser,
    load_template,
)
from rollout.agents.endpoint import ChatEndpoint, chat_request
from rollout.agents.session import AgentSession, SessionContext

TOOL_ROUNDS = 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
Ask = Callable[[list[dict[str, Any]]], Awaitable[dict[str, Any]]]


class Script:
    """Turn k of an episode: `add(a=k, b=1)` for k < TOOL_ROUNDS, then an answer.

    The turn is read from the ChatML headers of the context: the prompt opens 3 (system, user,
    assistant), every tool round 2 more (tool, assistant).
    """

    def __init__(self, tokenizer: Any):
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        calls = [json.dumps({"name": "add", "arguments": {"a": k, "b": 1}}) for k in range(3)]
        texts = [f"<tool_call>{call}</tool_call>" for call in calls] + ["The sum is 3."]
        self.turns = [[*tokenizer.encode(t, add_special_tokens=False), self.eos] for t in texts]

    def __call__(self, context: list[int]) -> list[int]:
        return self.turns[min((context.count(self.im_start) - 3) // 2, TOOL_ROUNDS)]


class RealComputeScriptedText:
    """Samples `len(turn)` real tokens, then answers with the scripted turn's ids.

    Records every request's prompt and parameters, so `direct` can replay exactly them.
    """

    def __init__(self, backend: TransformersBackend, script: Script):
        self.backend = backend
        self.script = script
        self.context_limit = backend.context_limit
        self.requests: list[tuple[list[int], SamplingParams]] = []

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, pictures: Pictures | None = None
    ) -> Completion:
        self.requests.append((list(prompt_ids), params))
        ids = self.script(prompt_ids)[: params.max_tokens]
        sampled = await self.backend.generate(
            prompt_ids, dataclasses.replace(params, max_tokens=len(ids))
        )
        assert len(sampled.token_ids) == len(ids), "the real backend stopped early"
        return Completion(ids, sampled.logprobs, stopped=ids[-1] == self.script.eos)


async def play(ask: Ask, index: int) -> None:
    """One episode of the bench agent: tool calls answered until the model answers in text."""
    messages = [
        {"role": "system", "content": "Use the add tool."},
        {"role": "user", "content": f"What is {index} + 1 + 1 + 1?"},
    ]
    while True:
        message = await ask(messages)
        messages.append(message)
        if not message.get("tool_calls"):
            return
        for call in message["tool_calls"]:
            args = json.loads(call["function"]["arguments"])
            result = str(args["a"] + args["b"])
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


async def through_endpoint(context: SessionContext, episodes: int) -> float:
    endpoint = ChatEndpoint()
    started = time.perf_counter()
    async with endpoint.serving():
        for index in range(episodes):
            url = endpoint.open(AgentSession(context, sample_seed=index))
            async with openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=0) as client:

                async def ask(messages: list[dict[str, Any]], client: Any = client) -> dict:
                    reply = await client.chat.completions.create(
                        model="policy", messages=messages, tools=TOOLS
                    )
                    return reply.choices[0].message.model_dump(exclude_none=True)

                await play(ask, index)
            endpoint.close_session(url)
    seconds = time.perf_counter() - started
    endpoint.close()
    return seconds


async def through_session(context: SessionContext, episodes: int) -> float:
    endpoint = ChatEndpoint()  # for its reply serialisation only; nothing is served
    started = time.perf_counter()
    for index in range(episodes):
        session = AgentSession(context, sample_seed=index)

        async def ask(messages: list[dict[str, Any]], session: AgentSession = session) -> dict:
            request = chat_request({"messages": messages, "tools": TOOLS})
            reply = await session.complete(request)
            return endpoint.completion_json(reply, request)["choices"][0]["message"]

        await play(ask, index)
    seconds = time.perf_counter() - started
    endpoint.close()
    return seconds


async def direct(backend: Any, requests: list[tuple[list[int], SamplingParams]]) -> float:
    started = time.perf_counter()
    for prompt_ids, params in requests:
        await backend.generate(prompt_ids, params)
    return time.perf_counter() - started


def backends(arguments: argparse.Namespace) -> tuple[Any, Any, str]:
    """The backend the sessions use, the one `direct` calls, and a description."""
    path = str(default_model_path()) if arguments.model is None else arguments.model
    tokenizer = AutoTokenizer.from_pretrained(path)
    script = Script(tokenizer)
    if arguments.scripted:
        backend = ScriptedBackend(script, [script.eos])
        return tokenizer, backend, "ScriptedBackend (no compute)"
    if arguments.tiny:
        from tests.support.tiny_model import tiny_llama

        model, name = tiny_llama(tokenizer), "the tests' tiny Llama"
    else:
        model, name = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), path
    model.eval()
    real = TransformersBackend(model, [model.config.vocab_size], tokenizer.pad_token_id or 0)
    return tokenizer, RealComputeScriptedText(real, script), f"TransformersBackend on {name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a local model folder (default: the embedded SmolLM2)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny Llama")
    parser.add_argument("--scripted", action="store_true", help="no compute: overhead alone")
    parser.add_argument("--episodes", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    arguments = parser.parse_args()
    torch.manual_seed(0)
    tokenizer, backend, described = backends(arguments)
    config = EpisodeConfig(max_completion_length=512, max_turns=TOOL_ROUNDS + 1)
    context = SessionContext(
        backend,
        tokenizer,
        load_template(tokenizer, "chatml_tools"),
        lambda schemas: get_parser("hermes"),
        config,
    )
    print(f"{described}; {arguments.episodes} episodes x {TOOL_ROUNDS + 1} requests, one at a time")
    print(f"load average at start: {os.getloadavg()}")
    times: dict[str, list[float]] = {"direct": [], "session": [], "endpoint": []}
    for repeat in range(arguments.repeats + 1):  # the first round warms up, and is dropped
        backend.requests.clear()
        endpoint_s = anyio.run(through_endpoint, context, arguments.episodes)
        requests = list(backend.requests)
        session_s = anyio.run(through_session, context, arguments.episodes)
        direct_s = anyio.run(direct, backend, requests)
        print(
            f"round {repeat}{' (warm-up)' if not repeat else ''}: endpoint {endpoint_s:.3f} s, "
            f"session {session_s:.3f} s, direct {direct_s:.3f} s",
            flush=True,
        )
        if repeat:
            times["endpoint"].append(endpoint_s)
            times["session"].append(session_s)
            times["direct"].append(direct_s)
    count = len(requests)
    median = {mode: statistics.median(values) for mode, values in times.items()}
    for mode, seconds in median.items():
        per = 1000 * seconds / count
        print(f"{mode:9s} {seconds:7.3f} s  {per:8.2f} ms/request  ({count} requests)")
    for mode in ("session", "endpoint"):
        extra = 1000 * (median[mode] - median["direct"]) / count
        ratio = median[mode] / median["direct"]
        print(f"{mode} overhead: {extra:+.2f} ms/request, {ratio:.3f}x direct")
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
