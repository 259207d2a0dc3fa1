"""Agent episodes: a user's OpenAI-client agent, played against the engine's chat endpoint.

Each test drives a real `openai` client over real HTTP to the endpoint the engine serves on
127.0.0.1; the generator is the scripted backend (the real-model path is in
`test_agents_real.py`), so every recorded token can be checked against what was "sampled".
"""

from __future__ import annotations

import asyncio
import json
import threading

import anyio
import httpx
import openai
import pytest

from environments import Counter
from environments.contract import class_tools
from rollout import EpisodeConfig, Finish, RolloutEngine, ScriptedBackend
from rollout.agents import Agent, AgentError
from rollout.agents.session import SessionContext
from rollout.template_source import load_template
from rollout.types import ParsedTurn
from tests.support.episodes import (
    COUNTER_ROW,
    COUNTER_TURNS,
    scripted_backend,
    scripted_episode,
    tool_call,
)

COUNTER_TOOLS = [tool.schema for tool in class_tools(Counter).values()]


def agent_engine(tokenizer, agent, turns=COUNTER_TURNS, backend=None, **config) -> RolloutEngine:
    config.setdefault("max_completion_length", 512)
    return RolloutEngine(
        backend or scripted_backend(tokenizer, turns),
        tokenizer,
        chat_template="chatml_tools",
        config=EpisodeConfig(**config),
        player=(agent if isinstance(agent, Agent) else Agent(agent)).player,
    )


def play(engine: RolloutEngine, rows=(COUNTER_ROW,), num_generations=1):
    return anyio.run(engine.run, list(rows), num_generations)


async def counter_agent(client: openai.AsyncOpenAI, row: dict) -> float:
    """Counter, played by an agent: the same conversation the engine's episode holds."""
    value = 0
    messages = [{"role": "user", "content": f"{row['prompt']}\nThe counter is at 0."}]
    while True:
        reply = await client.chat.completions.create(
            model="any", messages=messages, tools=COUNTER_TOOLS
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return 1.0 if value == row["target"] else 0.0
        for call in message.tool_calls:
            value += json.loads(call.function.arguments)["step"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})


def test_an_agent_episode_holds_the_tokens_the_engine_records(tokenizer):
    [episode] = play(agent_engine(tokenizer, counter_agent))
    engine_episode = scripted_episode(tokenizer, COUNTER_TURNS)
    assert episode.rows == engine_episode.rows  # ids, loss mask and sampler logprobs alike
    assert episode.finish is Finish.STOP
    assert episode.agent_rewards == {"counter_agent": 1.0}
    assert (episode.stats.turns, episode.stats.tool_calls) == (3, 2)
    assert [(c.name, dict(c.arguments), c.result) for c in episode.tool_calls] == [
        ("increment", {"step": 3}, "3"),
        ("increment", {"step": 4}, "7"),
    ]
    assert episode.messages[-1] == {"role": "assistant", "content": "Done."}


def test_a_sync_agent_gets_a_sync_client_and_records_the_same(tokenizer):
    def plain(client: openai.OpenAI, row: dict) -> float:
        assert isinstance(client, openai.OpenAI)
        messages = [{"role": "user", "content": f"{row['prompt']}\nThe counter is at 0."}]
        value = 0
        while True:
            message = (
                client.chat.completions.create(model="m", messages=messages, tools=COUNTER_TOOLS)
                .choices[0]
                .message
            )
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return float(value == row["target"])
            for call in message.tool_calls:
                value += json.loads(call.function.arguments)["step"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})

    [episode] = play(agent_engine(tokenizer, plain))
    assert episode.rows == scripted_episode(tokenizer, COUNTER_TURNS).rows
    assert episode.agent_rewards == {"plain": 1.0}


def test_replies_carry_token_ids_and_logprobs_on_request(tokenizer):
    seen = {}

    async def agent(client, row):
        reply = await client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Hi"}],
            logprobs=True,
            extra_body={"return_token_ids": True},
        )
        seen["reply"] = reply.model_dump()
        return 0.0

    [episode] = play(agent_engine(tokenizer, agent, turns=["Hello there."]))
    [row] = episode.rows
    reply = seen["reply"]
    assert reply["prompt_token_ids"] == row.prompt_ids
    assert reply["choices"][0]["token_ids"] == row.completion_ids
    logprobs = [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]
    assert logprobs == row.sampler_logprobs
    assert reply["choices"][0]["message"]["content"] == "Hello there."
    assert reply["usage"]["completion_tokens"] == len(row.completion_ids)


def test_an_agent_that_rewrites_history_forks_a_new_row(tokenizer):
    async def forgetful(client, row):
        messages = [{"role": "user", "content": "Count to 7."}]
        first = await client.chat.completions.create(
            model="m", messages=messages, tools=COUNTER_TOOLS
        )
        call = first.choices[0].message.tool_calls[0]
        # The agent summarises instead of sending the tool exchange back.
        summary = [{"role": "user", "content": f"Count to 7. The counter is at 3 ({call.id})."}]
        await client.chat.completions.create(model="m", messages=summary, tools=COUNTER_TOOLS)
        return 1.0

    [episode] = play(agent_engine(tokenizer, forgetful))
    first, second = episode.rows
    assert all(m == 1 for m in first.loss_mask) and all(m == 1 for m in second.loss_mask)
    assert "The counter is at 3" in tokenizer.decode(second.prompt_ids)
    assert "Count to 7.<|im_end|>" in tokenizer.decode(first.prompt_ids)
    assert episode.forks == 1
    before, after = len(first.prompt_ids) + len(first.completion_ids), len(second.prompt_ids)
    assert after < before  # the summary is shorter than the exchange: a compaction, recorded
    [compaction] = episode.stats.compactions
    assert (compaction.policy, compaction.tokens_before, compaction.tokens_after) == (
        "agent",
        before,
        after,
    )


def test_parallel_requests_of_one_agent_are_rows_of_their_own(tokenizer):
    backend = scripted_backend(tokenizer, ["Sub-answer."], delay_s=0.05)

    async def fan_out(client, row):
        base = [{"role": "user", "content": "Split the work."}]
        first = await client.chat.completions.create(model="m", messages=base)
        history = [*base, first.choices[0].message.model_dump(exclude_none=True)]
        asks = [[*history, {"role": "user", "content": f"Part {k}."}] for k in range(2)]
        await asyncio.gather(*(client.chat.completions.create(model="m", messages=m) for m in asks))
        return 1.0

    [episode] = play(agent_engine(tokenizer, fan_out, backend=backend))
    assert len(episode.rows) == 2  # one continued the first row; the other forked
    texts = [tokenizer.decode(r.prompt_ids + r.completion_ids) for r in episode.rows]
    assert sum("Part 0." in t for t in texts) == 1 and sum("Part 1." in t for t in texts) == 1
    assert episode.stats.turns == 3
    assert episode.stats.compactions == ()  # a longer conversation beside it compacts nothing


def test_an_agent_that_raises_ends_its_episode_as_an_error_and_the_round_goes_on(tokenizer):
    async def flaky(client, row):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        if row["n"] == 1:
            raise KeyError("the agent's own bug")
        return 1.0

    episodes = play(agent_engine(tokenizer, flaky, turns=["ok"]), rows=[{"n": 0}, {"n": 1}])
    assert [e.finish for e in episodes] == [Finish.STOP, Finish.ERROR]
    assert episodes[1].error == 'KeyError: "the agent\'s own bug"'
    assert episodes[1].agent_rewards is None
    assert episodes[0].agent_rewards == {"flaky": 1.0}


def test_an_agent_past_its_timeout_ends_as_an_error(tokenizer):
    async def slow(client, row):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        await anyio.sleep(30)
        return 1.0

    # 5 s leaves the first request time to be answered on a loaded machine; then it sleeps past
    [episode] = play(agent_engine(tokenizer, Agent(slow, timeout_s=5), turns=["ok"]), rows=[{}])
    assert episode.finish is Finish.ERROR
    assert "timeout" in episode.error


def test_an_agent_that_never_asks_the_model_is_a_clear_error(tokenizer):
    async def lazy(client, row):
        return 1.0

    with pytest.raises(AgentError, match=r"agent lazy \(.*test_agents.py:\d+\) returned without"):
        play(agent_engine(tokenizer, lazy), rows=[{}])


def test_a_request_past_max_turns_is_refused_and_the_episode_ends_there(tokenizer):
    async def endless(client, row):
        messages = [{"role": "user", "content": "Go."}]
        while True:
            reply = await client.chat.completions.create(model="m", messages=messages)
            messages += [
                reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "Again."},
            ]

    [episode] = play(agent_engine(tokenizer, endless, turns=["Once more."], max_turns=3), rows=[{}])
    assert episode.finish is Finish.MAX_TURNS
    assert episode.error is None and episode.stats.turns == 3
    assert len(episode.rows) == 1


def test_the_token_budget_caps_replies_and_then_refuses(tokenizer):
    replies = []

    async def chatty(client, row):
        messages = [{"role": "user", "content": "Talk."}]
        while True:
            reply = await client.chat.completions.create(model="m", messages=messages)
            replies.append(reply.choices[0].finish_reason)
            messages += [
                reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "More."},
            ]

    turns = ["A fairly long answer that goes on and on for a good number of tokens, " * 2]
    [episode] = play(agent_engine(tokenizer, chatty, turns=turns, max_completion_length=48), [{}])
    assert episode.finish is Finish.LENGTH
    [row] = episode.rows  # the request after the cut reply was refused, not forked
    assert len(row.completion_ids) == 48  # the second reply was cut at the budget
    assert replies == ["stop", "length"]


def test_requests_the_endpoint_cannot_honour_get_a_clear_400(tokenizer):
    errors = []

    async def picky(client, row):
        ok = [{"role": "user", "content": "x"}]
        for extra in ({"n": 2}, {"stop": ["\n"]}):
            try:
                await client.chat.completions.create(model="m", messages=ok, **extra)
            except openai.BadRequestError as error:
                errors.append(error.body["message"])
        image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
        try:
            await client.chat.completions.create(model="m", messages=image)
        except openai.BadRequestError as error:
            errors.append(error.body["message"])
        models = await client.models.list()
        assert [m.id for m in models.data] == [tokenizer.name_or_path]
        await client.chat.completions.create(model="m", messages=ok)
        return 0.0

    [episode] = play(agent_engine(tokenizer, picky, turns=["ok"]), rows=[{}])
    assert episode.finish is Finish.STOP and episode.stats.turns == 1
    assert [e.split(" ")[0] for e in errors] == [
        "n=2",
        "stop",
        "messages[0].content",
    ]


def test_a_streamed_request_gets_the_whole_reply_as_events_and_records_the_same(tokenizer):
    chunks = []

    async def streaming_counter(client: openai.AsyncOpenAI, row: dict) -> float:
        value = 0
        messages = [{"role": "user", "content": f"{row['prompt']}\nThe counter is at 0."}]
        while True:
            stream = await client.chat.completions.create(
                model="any", messages=messages, tools=COUNTER_TOOLS, stream=True,
                stream_options={"include_usage": True}, extra_body={"return_token_ids": True},
            )  # fmt: skip
            reply = [chunk async for chunk in stream]
            chunks.append(reply)
            calls = reply[0].choices[0].delta.tool_calls or []
            content = reply[0].choices[0].delta.content or ""
            messages.append(
                {"role": "assistant", "content": content, "tool_calls": [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": c.function.arguments}}
                    for c in calls]} if calls else {"role": "assistant", "content": content}
            )  # fmt: skip
            if not calls:
                return 1.0 if value == row["target"] else 0.0
            for call in calls:
                value += json.loads(call.function.arguments)["step"]
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})

    [episode] = play(agent_engine(tokenizer, streaming_counter))
    assert episode.rows == scripted_episode(tokenizer, COUNTER_TURNS).rows
    assert episode.agent_rewards == {"streaming_counter": 1.0}
    [row] = episode.rows
    sampled = [i for i, mask in zip(row.completion_ids, row.loss_mask, strict=True) if mask]
    first, finish, usage = zip(*[reply for reply in chunks], strict=True)
    assert [f.choices[0].finish_reason for f in finish] == ["tool_calls", "tool_calls", "stop"]
    assert [i for f in first for i in f.choices[0].model_extra["token_ids"]] == sampled
    assert first[0].model_extra["prompt_token_ids"] == row.prompt_ids
    assert [u.usage.completion_tokens for u in usage] == [
        len(f.choices[0].model_extra["token_ids"]) for f in first
    ]


def test_a_session_is_gone_once_its_episode_ends(tokenizer):
    urls = []

    async def leaky(client, row):
        urls.append(str(client.base_url))
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return 0.0

    engine = agent_engine(tokenizer, leaky, turns=["ok"])

    async def after_the_episode():
        async with engine._serving():
            await engine._play_one(engine.context, {}, 0, 0, 0)
            async with httpx.AsyncClient() as http:
                response = await http.post(f"{urls[0]}chat/completions", json={"messages": []})
        return response

    response = anyio.run(after_the_episode)
    assert response.status_code == 404
    assert "episode it belonged to has ended" in response.json()["error"]["message"]


def test_an_agent_declaring_reward_names_fills_one_column_each(tokenizer):
    async def graded(client, row):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return {"correct": 1.0, "format": 0.5}

    agent = Agent(graded, reward_names=("correct", "format"))
    [episode] = play(agent_engine(tokenizer, agent, turns=["ok"]), rows=[{}])
    assert episode.agent_rewards == {"correct": 1.0, "format": 0.5}
    assert agent.columns == ("correct", "format")


def test_an_agents_reward_weights_weigh_its_columns_one_each():
    async def graded(client, row):
        return {"correct": 1.0, "format": 0.5}

    assert Agent(graded, reward_names=("correct", "format")).weights == (1.0, 1.0)
    agent = Agent(graded, reward_names=("correct", "format"), reward_weights=(2.0, 0.5))
    assert agent.weights == (2.0, 0.5)
    with pytest.raises(ValueError, match=r"1 reward_weights for 2 reward columns"):
        Agent(graded, reward_names=("correct", "format"), reward_weights=(2.0,))


def test_an_agent_error_the_agent_raises_itself_stops_the_run(tokenizer):
    async def misconfigured(client, row):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        raise AgentError("this agent's set-up is wrong")

    with pytest.raises(AgentError, match="set-up is wrong"):
        play(agent_engine(tokenizer, misconfigured, turns=["ok"]), rows=[{}])


@pytest.mark.parametrize(
    ("returned", "names", "match"),
    [
        ("1.0", (), "must return the episode's reward"),
        ({"a": 1.0}, (), "must return the episode's reward"),
        ({"wrong": 1.0}, ("right",), r"dict with the keys \['right'\]"),
    ],
)
def test_an_agent_returning_something_else_is_a_clear_error(tokenizer, returned, names, match):
    async def odd(client, row):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return returned

    with pytest.raises(AgentError, match=match):
        play(agent_engine(tokenizer, Agent(odd, reward_names=names), turns=["ok"]), rows=[{}])


def test_an_agent_cannot_come_with_an_environment_or_tools(tokenizer):
    with pytest.raises(ValueError, match="without environment_factory or tools"):
        RolloutEngine(
            ScriptedBackend(lambda c: [0], [0]),
            tokenizer,
            environment_factory=Counter,
            chat_template="chatml_tools",
            player=Agent(counter_agent).player,
        )


def test_a_model_call_the_parser_cannot_read_stays_in_the_text_and_is_counted(tokenizer):
    seen = {}

    async def agent(client, row):
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], tools=COUNTER_TOOLS
        )
        seen["message"] = reply.choices[0].message
        return 0.0

    broken = "<tool_call>{not json}</tool_call>"
    [episode] = play(agent_engine(tokenizer, agent, turns=[broken]), rows=[{}])
    assert seen["message"].content == broken and not seen["message"].tool_calls
    assert episode.stats.tool_errors == {"parse": 1}


def test_group_members_play_concurrently_each_with_its_own_session(tokenizer):
    urls = set()

    async def agent(client, row):
        urls.add(str(client.base_url))
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return 1.0

    backend = scripted_backend(tokenizer, ["ok"], delay_s=0.2)
    episodes = play(
        agent_engine(tokenizer, agent, backend=backend), rows=[{}, {}], num_generations=3
    )
    assert len(urls) == 6 and len(episodes) == 6
    assert all(e.finish is Finish.STOP for e in episodes)
    # Each request sampled with its own seed, derived from the group's seed and the episode.
    seeds = [params.seed for _, params in backend.requests]
    assert len(set(seeds)) == 6


def test_tool_call_text_round_trips_through_the_reply(tokenizer):
    seen = {}

    async def agent(client, row):
        reply = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], tools=COUNTER_TOOLS
        )
        seen["reply"] = reply
        return 0.0

    [episode] = play(agent_engine(tokenizer, agent, turns=[tool_call("increment", step=2)]), [{}])
    choice = seen["reply"].choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("increment", {"step": 2})
    assert episode.stats.tool_calls == 1


def _post(client, body: bytes | dict, url: str | None = None) -> httpx.Response:
    """POST `body` (raw bytes or a JSON object) to the chat route of `client`'s session."""
    target = url or f"{client.base_url}chat/completions"
    if isinstance(body, dict):
        return httpx.post(target, json=body, timeout=60)
    return httpx.post(target, content=body, timeout=60)


def test_wrong_typed_fields_get_a_400_naming_them_and_the_run_goes_on(tokenizer):
    user = {"role": "user", "content": "x"}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    bad = {
        "tool_call_id": [user, {"role": "tool", "tool_call_id": {"a": 1}, "content": "r"}],
        "role": [{"role": ["user"], "content": "x"}],
        "tool_calls": [{"role": "assistant", "content": "", "tool_calls": "f"}, user],
        "id": [{"role": "assistant", "content": "", "tool_calls": [{**call, "id": {}}]}, user],
    }
    answers = {}

    def agent(client, row):
        for field, messages in bad.items():
            answers[field] = _post(client, {"messages": messages})
        for field, value in {"n": True, "max_tokens": True, "logprobs": "yes"}.items():
            answers[field] = _post(client, {"messages": [user], field: value})
        answers["utf-8"] = _post(client, b'{"messages": [{"role": "user", "content": "\xff"}]}')
        answers["deep"] = _post(client, b"[" * 100_000 + b"]" * 100_000)
        answers["n: null"] = _post(client, {"messages": [user], "n": None})
        return 0.0

    [episode] = play(agent_engine(tokenizer, agent, turns=["ok"]), rows=[{}])
    assert episode.finish is Finish.STOP and episode.stats.turns == 1
    assert answers.pop("n: null").status_code == 200
    messages = {field: answer.json()["error"]["message"] for field, answer in answers.items()}
    assert {answer.status_code for answer in answers.values()} == {400}
    assert all(field in messages[field] for field in ("tool_call_id", "role", "tool_calls", "n"))
    assert "tool_calls[].id must be a string, not dict" in messages["id"]
    assert "'max_tokens' must be a whole number" in messages["max_tokens"]
    assert "'logprobs' must be true or false" in messages["logprobs"]
    assert "not UTF-8" in messages["utf-8"] and "nested over 100 levels" in messages["deep"]


def test_an_agent_whose_requests_were_all_refused_is_told_so(tokenizer):
    async def refused(client, row):
        for _ in range(2):
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model="m", messages=[], n=2)
        return 0.0

    with pytest.raises(AgentError, match=r"returned after 2 request\(s\) .* none answered \(2 ref"):
        play(agent_engine(tokenizer, refused, turns=["ok"]), rows=[{}])


def test_session_urls_hold_a_secret_no_other_process_can_guess(tokenizer):
    answers, urls = [], []

    def agent(client, row):
        mine = str(client.base_url)
        urls.append(mine)
        secret = mine.rstrip("/").split("/")[-2]
        for guess in ("s0", "s1", secret[:-1]):
            url = mine.replace(secret, guess) + "chat/completions"
            answers.append(_post(client, {"messages": [{"role": "user", "content": "x"}]}, url))
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return 0.0

    play(agent_engine(tokenizer, agent, turns=["ok"]), rows=[{}, {}])
    assert [answer.status_code for answer in answers] == [404] * 6
    secrets = [url.rstrip("/").split("/")[-2] for url in urls]
    assert len(set(secrets)) == 2 and all(len(secret) >= 32 for secret in secrets)


def test_a_request_surely_over_the_limits_is_refused_before_it_is_tokenized(tokenizer):
    async def verbose(client, row):
        huge = [{"role": "user", "content": "word " * 1_000_000}]  # 5 MB
        await client.chat.completions.create(model="m", messages=huge)

    engine = agent_engine(tokenizer, verbose, turns=["ok"], max_prompt_length=256)
    # 256 prompt and 512 completion tokens; its only request refused, the agent is at fault.
    with pytest.raises(AgentError, match=r"1 refused, the last with: the conv.* surely over 768"):
        play(engine, rows=[{}])


def test_a_request_over_max_request_bytes_gets_a_413_unread(tokenizer):
    answers = []

    def agent(client, row):
        big = {"messages": [{"role": "user", "content": "x" * 4000}]}
        answers.append(_post(client, big))
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return 0.0

    engine = agent_engine(tokenizer, agent, turns=["ok"])
    engine.player.endpoint.max_request_bytes = 1000
    [episode] = play(engine, rows=[{}])
    assert episode.finish is Finish.STOP
    assert answers[0].status_code == 413
    assert "over max_request_bytes=1000" in answers[0].json()["error"]["message"]


def test_requests_are_rendered_and_tokenized_off_the_event_loop(tokenizer):
    threads = []
    template = load_template(tokenizer, "chatml_tools")
    probe = "{%- set _ = probe() -%}"

    async def agent(client, row):
        threads.append(("loop", threading.get_ident()))
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return 0.0

    engine = RolloutEngine(
        scripted_backend(tokenizer, ["ok"]),
        tokenizer,
        chat_template=probe + template,
        chat_template_kwargs={"probe": lambda: threads.append(("render", threading.get_ident()))},
        player=Agent(agent).player,
    )
    play(engine, rows=[{}])
    [(_, loop), *rendered] = threads
    assert rendered and all(kind == "render" and ident != loop for kind, ident in rendered)


def test_sessions_asking_from_several_threads_share_one_renderer_per_tool_set(tokenizer):
    building, second_asked = threading.Event(), threading.Event()
    built = []

    def parser_for(schemas):
        built.append(schemas)
        building.set()
        second_asked.wait(timeout=2)  # the other thread's chance to build a renderer of its own
        return lambda text: ParsedTurn(text)

    template = load_template(tokenizer, "chatml_tools")
    context = SessionContext(
        scripted_backend(tokenizer, ["ok"]), tokenizer, template, parser_for, EpisodeConfig()
    )
    found = []

    def ask(asked=None):
        if asked is not None:
            asked.set()
        found.append(context.renderer_and_parser(COUNTER_TOOLS)[0])

    first = threading.Thread(target=ask)
    first.start()
    assert building.wait(timeout=60)
    second = threading.Thread(target=ask, args=(second_asked,))
    second.start()
    first.join(timeout=60)
    second.join(timeout=60)
    assert len(found) == 2 and found[0] is found[1]  # a row continues under its own renderer
    assert len(built) == 1
