"""The rollout engine against a scripted backend: tokens, masks, failures, stops, concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading

import anyio
import pytest

from environments import Counter, EnvironmentResetError, EnvironmentSpecError
from rollout import (
    Episode,
    EpisodeConfig,
    EpisodeRow,
    EpisodeStats,
    Finish,
    GenerationBackend,
    PlaySetup,
    PromptTooLongError,
    RolloutEngine,
    SamplingParams,
    ScriptedBackend,
    TemplateDriftError,
    ToolTemplateError,
)
from rollout.prompts import with_observation
from tests.support.episodes import (
    COUNTER_ROW,
    COUNTER_TURNS,
    Workbench,
    counter_segments,
    scripted_backend,
    single_row,
    tool_call,
)

pytestmark = pytest.mark.anyio

call = tool_call
scripted = scripted_backend


def engine(tokenizer, backend, **kwargs) -> RolloutEngine:
    kwargs.setdefault("environment_factory", Counter)
    config = kwargs.pop("config", EpisodeConfig(max_completion_length=512, max_turns=5))
    return RolloutEngine(backend, tokenizer, chat_template="chatml_tools", config=config, **kwargs)


ROW = COUNTER_ROW


async def test_tool_response_tokens_are_masked_out_of_the_loss_token_by_token(tokenizer):
    [episode] = await engine(tokenizer, scripted(tokenizer, COUNTER_TURNS)).run([ROW])
    segments = counter_segments(tokenizer)
    assert single_row(episode).completion_ids == [t for ids, _ in segments for t in ids]
    assert single_row(episode).loss_mask == [m for ids, m in segments for _ in ids]
    assert episode.finish is Finish.STOP
    assert episode.env_reward == 1.0
    assert (episode.stats.turns, episode.stats.tool_calls, episode.stats.tool_failures) == (3, 2, 0)


async def test_sampler_logprobs_stay_with_their_tokens_and_are_zero_where_masked(tokenizer):
    backend = scripted(tokenizer, [call("increment", step=7), "Done."])
    [episode] = await engine(tokenizer, backend).run([ROW])
    sampled = [
        lp
        for lp, m in zip(
            single_row(episode).sampler_logprobs, single_row(episode).loss_mask, strict=True
        )
        if m
    ]
    turns = [call("increment", step=7), "Done."]
    turn_lengths = [len(tokenizer.encode(t, add_special_tokens=False)) + 1 for t in turns]
    assert sampled == [-(k + 1) / 100 for n in turn_lengths for k in range(n)]
    assert all(
        lp == 0.0
        for lp, m in zip(
            single_row(episode).sampler_logprobs, single_row(episode).loss_mask, strict=True
        )
        if not m
    )


async def test_the_generator_sees_exactly_the_tokens_the_episode_keeps(tokenizer):
    backend = scripted(tokenizer, [call("increment", step=3), call("increment", step=4), "Ok."])
    [episode] = await engine(tokenizer, backend).run([ROW])
    last_context, _ = backend.requests[-1]
    kept = single_row(episode).prompt_ids + single_row(episode).completion_ids
    assert kept[: len(last_context)] == last_context


async def test_the_prompt_is_the_templates_rendering_with_the_reset_observation(tokenizer):
    backend = scripted(tokenizer, ["Ok."])
    [episode] = await engine(tokenizer, backend).run([ROW])
    text = tokenizer.decode(single_row(episode).prompt_ids)
    assert text.startswith("<|im_start|>system\nYou can call these tools:\n")
    assert '"name": "increment"' in text
    assert text.endswith(
        "<|im_start|>user\nMake the counter reach 7.\nThe counter is at 0.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("bad_turn", "kind", "message"),
    [
        (
            '<tool_call>{"name": "increment", "arguments": {"step": 3</tool_call>',
            "parse",
            "could not parse",
        ),
        (call("incrementt", step=3), "unknown_tool", "unknown tool 'incrementt'"),
        (call("increment"), "bad_arguments", "missing required argument 'step'"),
        (call("increment", step="three"), "bad_arguments", "'step'"),
        (call("increment", stp=3), "bad_arguments", "unexpected argument 'stp'"),
    ],
)
async def test_a_bad_tool_call_becomes_an_error_message_and_the_episode_goes_on(
    tokenizer, bad_turn, kind, message
):
    backend = scripted(tokenizer, [bad_turn, call("increment", step=7), "Done."])
    [episode] = await engine(tokenizer, backend).run([ROW])
    assert episode.finish is Finish.STOP
    assert episode.stats.tool_errors == {kind: 1}
    assert episode.stats.tool_calls == 2
    error_reply = episode.messages[2]
    assert error_reply["role"] == "tool" and message in error_reply["content"]
    assert episode.env_reward == 1.0


class Flaky(Workbench):
    _released = threading.Event()  # each test sets its own, once the episode is over

    def block(self, x: int) -> int:
        """Block a thread until the test lets go (at most 60 s).

        Args:
            x: Ignored.
        """
        self._released.wait(60)
        return x


@pytest.mark.parametrize(
    ("tool", "kind", "message"),
    [
        ("explode", "exception", "RuntimeError: boom"),
        ("hang", "timeout", "timed out"),
        ("block", "timeout", "timed out"),
    ],
)
async def test_a_tool_that_raises_or_hangs_is_reported_to_the_model(
    tokenizer, monkeypatch, tool, kind, message
):
    monkeypatch.setattr(Flaky, "_released", threading.Event())
    config = EpisodeConfig(max_completion_length=512, max_turns=5, tool_timeout_s=0.3)
    backend = scripted(tokenizer, [call(tool, x=1), "Sorry."])
    try:
        with anyio.fail_after(30):  # "does not hang" only: the hung tools wait 60 s
            [episode] = await engine(
                tokenizer, backend, environment_factory=Flaky, config=config
            ).run([ROW])
        assert not Flaky._released.is_set()  # the episode ended while "block" still blocked
    finally:
        Flaky._released.set()
    assert episode.finish is Finish.STOP
    assert episode.stats.tool_errors == {kind: 1}
    assert message in episode.messages[2]["content"]


async def test_several_calls_in_one_turn_all_run_and_answer_in_order(tokenizer):
    turn = call("increment", step=3) + "\n" + call("increment", step=4)
    [episode] = await engine(tokenizer, scripted(tokenizer, [turn, "Done."])).run([ROW])
    replies = [m["content"] for m in episode.messages if m["role"] == "tool"]
    assert sorted(replies) == ["3", "7"]
    assert episode.stats.tool_calls == 2 and episode.env_reward == 1.0


async def test_max_turns_cuts_the_episode_off(tokenizer):
    config = EpisodeConfig(max_completion_length=512, max_turns=2)
    backend = scripted(tokenizer, [call("increment", step=1)])
    [episode] = await engine(tokenizer, backend, config=config).run([ROW])
    assert episode.finish is Finish.MAX_TURNS and episode.finish.truncated
    assert episode.stats.turns == 2
    assert episode.messages[-1]["role"] == "tool"
    assert single_row(episode).loss_mask[-1] == 1  # the last tool turn is recorded, not tokenised


@pytest.mark.parametrize("rounds", [0, 1])
async def test_calls_past_the_tool_round_limit_are_not_run_and_end_the_episode(rounds, tokenizer):
    # TRL's max_tool_calling_iterations: that many turns' calls run; the next turn's do not.
    config = EpisodeConfig(max_completion_length=512, max_turns=5, max_tool_rounds=rounds)
    backend = scripted(tokenizer, [call("increment", step=3)])
    [episode] = await engine(tokenizer, backend, config=config).run([ROW])
    assert episode.finish is Finish.MAX_TURNS
    assert (episode.stats.turns, episode.stats.tool_calls) == (rounds + 1, rounds)
    assert episode.environment.value == 3 * rounds  # the last call changed nothing
    assert episode.messages[-1]["role"] == "assistant" and episode.messages[-1]["tool_calls"]
    assert single_row(episode).loss_mask[-1] == 1


async def test_the_token_budget_counts_tool_tokens_and_is_passed_to_the_generator(tokenizer):
    config = EpisodeConfig(max_completion_length=60, max_turns=10)
    backend = scripted(tokenizer, [call("increment", step=1)])
    [episode] = await engine(tokenizer, backend, config=config).run([ROW])
    assert episode.finish is Finish.LENGTH
    assert len(single_row(episode).completion_ids) <= 60
    budgets = [params.max_tokens for _, params in backend.requests]
    assert budgets[0] == 60
    assert budgets[1] == 60 - (len(backend.requests[1][0]) - len(single_row(episode).prompt_ids))


async def test_a_turn_cut_by_the_budget_ends_the_episode_with_length(tokenizer):
    config = EpisodeConfig(max_completion_length=5, max_turns=10)
    [episode] = await engine(
        tokenizer, scripted(tokenizer, ["A long answer that goes on."]), config=config
    ).run([ROW])
    assert episode.finish is Finish.LENGTH
    assert single_row(episode).loss_mask == [1] * 5


class StopsAtSeven(Counter):
    def increment(self, step: int) -> int:
        """Add step; the episode ends when the target is reached.

        Args:
            step: Value to add.
        """
        value = super().increment(step)
        self.done = value == self.target
        return value


async def test_an_environment_that_sets_done_ends_the_episode(tokenizer):
    backend = scripted(tokenizer, [call("increment", step=7), "never sampled"])
    [episode] = await engine(tokenizer, backend, environment_factory=StopsAtSeven).run([ROW])
    assert episode.finish is Finish.ENV_DONE and not episode.finish.truncated
    assert len(backend.requests) == 1


class Seeded(Counter):
    def reset(self, target: int, seed: int) -> str:
        self.seed = seed
        return super().reset(target)

    def close(self) -> None:
        self.closed = True


async def test_group_members_share_row_and_seed_and_every_environment_is_closed(tokenizer):
    rows = [ROW, {"prompt": "Reach 2.", "target": 2}]
    backend = scripted(tokenizer, ["Ok."])
    episodes = await engine(tokenizer, backend, environment_factory=Seeded).run(rows, 3, seed=10)
    assert [(e.group, e.index) for e in episodes] == [
        (g, i) for i, g in enumerate([0, 0, 0, 1, 1, 1])
    ]
    assert [e.environment.seed for e in episodes] == [10, 10, 10, 11, 11, 11]
    assert [e.row["target"] for e in episodes] == [7, 7, 7, 2, 2, 2]
    assert all(e.environment.closed for e in episodes)
    assert len({id(e.environment) for e in episodes}) == 6


# Concurrency is proven by ordering, not by wall-clock bounds a loaded machine may miss: a tool
# waits for something only another episode can do, so serialised episodes would wait for ever
# (no tool timeout here), and the test's own generous deadline turns that into a failure.
NO_TOOL_TIMEOUT = EpisodeConfig(max_completion_length=512, max_turns=5, tool_timeout_s=None)


async def test_sixteen_episodes_with_slow_tools_run_concurrently(tokenizer):
    calls: list[int] = []
    all_calls_started = anyio.Event()

    class Rendezvous(Counter):
        async def increment(self, step: int) -> int:
            """Add step, once the calls of all 16 episodes have started.

            Args:
                step: Value to add.
            """
            calls.append(step)
            if len(calls) == 16:
                all_calls_started.set()
            await all_calls_started.wait()
            return super().increment(step)

    backend = scripted(tokenizer, [call("increment", step=7), "Done."])
    eng = engine(tokenizer, backend, environment_factory=Rendezvous, config=NO_TOOL_TIMEOUT)
    with anyio.move_on_after(60) as deadline:
        episodes = await eng.run([ROW] * 16)
    assert not deadline.cancelled_caught, f"{len(calls)} of 16 calls ran at once: serialised"
    assert all(e.env_reward == 1.0 for e in episodes)


async def test_a_slow_episode_does_not_stall_the_others(tokenizer):
    fast_finished = anyio.Event()

    class Mixed(Counter):
        async def increment(self, step: int) -> int:
            """Add step; when the target is 9, only once the other episode has finished.

            Args:
                step: Value to add.
            """
            if self.target == 9:
                await fast_finished.wait()
            return super().increment(step)

    backend = scripted(tokenizer, [call("increment", step=1), call("increment", step=1), "Done."])
    finished: list[int] = []
    eng = engine(tokenizer, backend, environment_factory=Mixed, config=NO_TOOL_TIMEOUT)

    async def run(row):
        await eng.run([row])
        finished.append(row["target"])
        if row["target"] == 2:
            fast_finished.set()

    with anyio.fail_after(60):  # a stalled fast episode would leave the slow one waiting
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, {"prompt": "slow", "target": 9})
            tg.start_soon(run, {"prompt": "fast", "target": 2})
    assert finished == [2, 9]


async def test_a_failing_reset_names_the_environment_and_the_row(tokenizer):
    with pytest.raises(EnvironmentResetError, match=r"Counter.*'target'"):
        await engine(tokenizer, scripted(tokenizer, ["Ok."])).run([{"prompt": "no target"}])


async def test_a_prompt_over_the_limit_is_refused_with_its_length(tokenizer):
    config = EpisodeConfig(max_prompt_length=10)
    with pytest.raises(PromptTooLongError, match="over the limit"):
        await engine(tokenizer, scripted(tokenizer, ["Ok."]), config=config).run([ROW])


def test_a_template_that_drops_tools_is_refused_at_start_up(tokenizer):
    with pytest.raises(ToolTemplateError, match="chatml_tools"):
        RolloutEngine(scripted(tokenizer, ["Ok."]), tokenizer, environment_factory=Counter)


async def test_a_template_that_rewrites_history_forks_the_episode_onto_a_new_row(tokenizer):
    # Like templates that strip past reasoning: an assistant's text shows only in the last turn.
    drifting = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
        "{% elif m.role != 'assistant' or loop.last %}{{ m.content }}{% endif %}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
        "{% endfor %}<|im_end|>\n{% endfor %}"
        "{% if tools %}{{ tools | tojson }}{% endif %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    backend = scripted(tokenizer, ["Let me think. " + call("increment", step=7), "Done."])
    eng = RolloutEngine(
        backend,
        tokenizer,
        environment_factory=Counter,
        chat_template=drifting,
        tool_call_parser="hermes",
    )
    [episode] = await eng.run([ROW])
    first, second = episode.rows
    renderer = eng.context.renderer
    assert second.prompt_ids == renderer.encode(
        renderer.render(episode.messages[:3], generation_prompt=True)
    )
    assert tokenizer.decode(second.completion_ids) == "Done.<|im_end|>"
    assert first.loss_mask == [1] * len(first.completion_ids)  # the tool turn went to row 2
    assert second.loss_mask == [1] * len(second.completion_ids)
    with pytest.raises(TemplateDriftError, match="never saw"):  # the strict form still refuses
        renderer.tool_turn_ids("", episode.messages[:2], episode.messages[2:3], "<|im_end|>")


async def test_plain_tool_functions_work_without_an_environment(tokenizer):
    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: First factor.
            b: Second factor.
        """
        return a * b

    backend = scripted(tokenizer, [call("multiply", a=6, b=7), "42"])
    eng = RolloutEngine(backend, tokenizer, tools=[multiply], chat_template="chatml_tools")
    [episode] = await eng.run([{"prompt": "What is 6 times 7?"}])
    assert episode.messages[2] == {"role": "tool", "name": "multiply", "content": "42"}
    assert episode.env_reward is None and episode.environment is None


def test_two_plain_tools_of_one_name_are_refused(tokenizer):
    def add(a: int) -> int:
        """Add one.

        Args:
            a: The number.
        """
        return a + 1

    def add_two(a: int) -> int:
        """Add two.

        Args:
            a: The number.
        """
        return a + 2

    add_two.__name__ = "add"
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        RolloutEngine(scripted(tokenizer, []), tokenizer, tools=[add, add_two])


async def test_a_slow_reset_does_not_stall_the_other_episodes(tokenizer):
    fast_finished = threading.Event()

    class SlowStart(Counter):
        def reset(self, target: int) -> str:
            # Blocking, in the environment's own code (e.g. starting a sandbox): with target 9,
            # until the other episode has finished, which it can only do if this did not stall it.
            if target == 9:
                fast_finished.wait(60)
            return super().reset(target)

    eng = engine(tokenizer, scripted(tokenizer, ["Ok."]), environment_factory=SlowStart)
    finished: list[tuple[int, Finish]] = []

    async def run(row):
        [episode] = await eng.run([row])
        finished.append((row["target"], episode.finish))
        if row["target"] == 2:
            fast_finished.set()

    with anyio.fail_after(120):  # "does not hang" only: the slow reset gives up after 60 s
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, {"prompt": "slow", "target": 9})
            tg.start_soon(run, {"prompt": "fast", "target": 2})
    assert finished == [(2, Finish.STOP), (9, Finish.STOP)]


async def test_the_environment_is_closed_even_when_the_episode_fails(tokenizer):
    closed = []

    class Recorded(Counter):
        def close(self) -> None:
            closed.append(self)

    def broken(context):
        raise ConnectionError("the generation server went away")

    eng = engine(tokenizer, ScriptedBackend(broken, [0]), environment_factory=Recorded)
    with pytest.raises(ConnectionError, match="went away"):
        await eng.run([ROW] * 3)
    assert len(closed) == 3


class IncrementEnv:  # TRL-style: the environment owns the task and scores itself
    def reset(self, **kwargs) -> str | None:
        self.counter, self.target = 0, 7
        return "Increment the counter to 7." if kwargs.get("say", True) else None

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """Increment the counter.

        Args:
            step: Value to add.
        """
        self.counter += step
        return self.counter


async def test_without_a_prompt_column_the_reset_text_is_the_prompt(tokenizer):
    backend = scripted(tokenizer, [call("increment", step=7), "Done."])
    [episode] = await engine(tokenizer, backend, environment_factory=IncrementEnv).run([{}])
    assert episode.messages[0] == {"role": "user", "content": "Increment the counter to 7."}
    assert episode.env_reward == 1.0


async def test_without_a_prompt_column_a_silent_reset_starts_from_an_empty_user_message(tokenizer):
    # TRL's environment-owned data: the placeholder prompt is one empty user message.
    eng = engine(tokenizer, scripted(tokenizer, ["Ok."]), environment_factory=IncrementEnv)
    [episode] = await eng.run([{"say": False}])
    assert episode.messages[0] == {"role": "user", "content": ""}
    assert episode.messages[1]["content"] == "Ok."


async def test_each_group_is_handed_over_as_soon_as_its_episodes_end(tokenizer):
    fast_group_handed = anyio.Event()

    class SlowForNine(Counter):
        async def increment(self, step: int) -> int:
            """Add step; when the target is 9, only once the other group was handed over.

            Args:
                step: Value to add.
            """
            if self.target == 9:
                await fast_group_handed.wait()
            return super().increment(step)

    backend = scripted(tokenizer, [call("increment", step=1), "Done."])
    handed: list[int] = []

    async def on_group(episodes):
        handed.append(episodes[0].row["target"])
        assert [e.group for e in episodes] == [episodes[0].group] * 2
        if handed[-1] == 2:
            fast_group_handed.set()

    rows = [{"prompt": "slow", "target": 9}, {"prompt": "fast", "target": 2}]
    eng = engine(tokenizer, backend, environment_factory=SlowForNine, config=NO_TOOL_TIMEOUT)
    with anyio.fail_after(60):  # groups handed over only at the end would leave 9 waiting
        await eng.run(rows, num_generations=2, on_group=on_group)
    assert handed == [2, 9]


async def test_a_string_prompt_without_tools_is_raw_text_not_a_chat(tokenizer):
    backend = scripted(tokenizer, ["blue."])
    eng = RolloutEngine(backend, tokenizer, chat_template="chatml_tools")
    [episode] = await eng.run([{"prompt": "The sky is"}])
    assert single_row(episode).prompt_ids == tokenizer.encode("The sky is")
    assert episode.finish is Finish.STOP


def test_the_scripted_backend_is_a_generation_backend_that_needs_a_stop_id(tokenizer):
    backend = scripted(tokenizer, ["Done."])
    assert isinstance(backend, GenerationBackend)
    assert backend.stop_token_ids == {tokenizer.eos_token_id}
    with pytest.raises(ValueError, match="stop_token_ids is empty"):
        ScriptedBackend(lambda context: [], [])


class OneCompletionPlayer:
    """An episode player other than an agent: one completion of the row's prompt, no template."""

    def __init__(self, setup: PlaySetup):
        self.setup = setup
        self.events: list[str] = []

    @contextlib.asynccontextmanager
    async def serving(self):
        self.events.append("serving")
        yield
        self.events.append("served")

    async def play(self, row, seed, group, index) -> Episode:
        prompt_ids = self.setup.tokenizer.encode(row["prompt"])
        params = SamplingParams(self.setup.config.max_completion_length, seed=seed)
        completion = await self.setup.backend.generate(prompt_ids, params)
        self.events.append(f"played {group}.{index} seed {seed}")
        ids = completion.token_ids
        return Episode(
            rows=(EpisodeRow(prompt_ids, ids, [1] * len(ids), completion.logprobs),),
            messages=[],
            finish=Finish.STOP,
            stats=EpisodeStats(turns=1, tool_calls=0, tool_errors={}),
            row=row,
            group=group,
            index=index,
        )

    def close(self) -> None:
        self.events.append("closed")


async def test_the_engine_plays_each_episode_with_the_player_it_is_given(tokenizer):
    backend = scripted(tokenizer, ["blue."])
    eng = RolloutEngine(
        backend, tokenizer, chat_template="chatml_tools", player=OneCompletionPlayer
    )
    rows = [{"prompt": "The sky is"}, {"prompt": "Grass is"}]
    episodes = await eng.run(rows, num_generations=2, seed=5)
    eng.close()
    assert [(e.row["prompt"], e.group, e.index) for e in episodes] == [
        ("The sky is", 0, 0),
        ("The sky is", 0, 1),
        ("Grass is", 1, 2),
        ("Grass is", 1, 3),
    ]
    assert tokenizer.decode(single_row(episodes[3]).completion_ids) == "blue.<|im_end|>"
    events = eng.player.events
    assert events[0] == "serving" and events[-2:] == ["served", "closed"]
    assert sorted(events[1:-2]) == [
        "played 0.0 seed 5",
        "played 0.1 seed 5",
        "played 1.2 seed 6",
        "played 1.3 seed 6",
    ]


def test_a_player_cannot_come_with_an_environment_or_tools(tokenizer):
    with pytest.raises(ValueError, match="pass player= without environment_factory or tools"):
        engine(tokenizer, scripted(tokenizer, ["ok"]), player=OneCompletionPlayer)


# User code the engine must not misread


class Quiz:
    """Its reset sets state named like its tool: every call would fail."""

    def reset(self, answer: int = 4) -> str:
        self.answer, self.submit = answer, None
        return "What is 2 + 2?"

    def submit(self, answer: int) -> str:
        """Submit your answer.

        Args:
            answer: The answer.
        """
        return "Submitted."


async def test_an_attribute_that_hides_a_tool_stops_the_run_naming_class_tool_and_attribute(
    tokenizer,
):
    backend = scripted(tokenizer, [call("submit", answer=4)])
    eng = engine(tokenizer, backend, environment_factory=Quiz)
    with pytest.raises(EnvironmentSpecError) as caught:
        await eng.run([{"prompt": "Answer."}])
    assert str(caught.value).startswith(
        "Quiz.submit is a tool, but the instance attribute self.submit (a NoneType, set in "
        "__init__ or reset) hides it"
    )


class Lookup(Counter):
    async def lookup(self, key: str) -> str:
        """Look a key up, awaiting a request that something else cancels.

        Args:
            key: The key.
        """
        request = asyncio.create_task(asyncio.sleep(10))
        asyncio.get_running_loop().call_later(0.01, request.cancel)
        await request
        return "found"


async def test_an_async_tool_whose_inner_task_was_cancelled_is_an_exception_the_model_reads(
    tokenizer,
):
    backend = scripted(tokenizer, [call("lookup", key="a"), "Done."])
    [episode] = await engine(tokenizer, backend, environment_factory=Lookup).run([ROW])
    assert episode.finish is Finish.STOP
    assert episode.stats.tool_errors == {"exception": 1}
    assert episode.messages[2]["content"] == "Error: lookup() raised CancelledError"


class SizedCounter(Counter):
    def __init__(self, size: int) -> None:
        self.size = size


async def test_a_factory_may_supply_the_arguments_its_class_requires(tokenizer):
    factory = functools.partial(SizedCounter, size=3)
    backend = scripted(tokenizer, COUNTER_TURNS)
    [episode] = await engine(tokenizer, backend, environment_factory=factory).run([ROW])
    assert (episode.environment.size, episode.env_reward) == (3, 1.0)


async def test_reset_text_after_a_prompt_of_content_parts_is_one_more_text_part(tokenizer):
    parts = [{"type": "text", "text": "Make the counter reach 7."}]
    row = {"prompt": [{"role": "user", "content": parts}], "target": 7}
    [episode] = await engine(tokenizer, scripted(tokenizer, ["Ok."])).run([row])
    assert episode.messages[0]["content"] == [
        *parts,
        {"type": "text", "text": "\n"},
        {"type": "text", "text": "The counter is at 0."},
    ]


def test_reset_text_after_a_prompt_with_an_image_keeps_the_image():
    picture = object()  # stands for a PIL image: parts are kept as they are
    parts = [{"type": "image", "image": picture}, {"type": "text", "text": "What colour?"}]
    [message] = with_observation([{"role": "user", "content": parts}], "Answer in one word.")
    assert message["content"] == [
        *parts,
        {"type": "text", "text": "\n"},
        {"type": "text", "text": "Answer in one word."},
    ]
