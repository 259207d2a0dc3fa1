"""The gymnasium adapter, and GuessNumber, the built-in game it serves."""

from __future__ import annotations

import re
import string

import anyio
import gymnasium
import pytest
from gymnasium.spaces import Box, Discrete, Text
from gymnasium.utils.env_checker import check_env

from environments import (
    EnvironmentResetError,
    GuessNumber,
    GuessNumberGame,
    GymEnvironment,
    check_environment,
    class_tools,
    close_environment,
    environment_tools,
    gym_environment,
    read_reward,
    reset_environment,
    resolve_environment,
    tool_names,
)
from environments import guess_number as guess_number_module
from environments.guess_number import DEMO_HIGHS
from rollout import Finish
from tests.support.episodes import (
    assert_demonstrations_train_every_call,
    chatml_engine,
    scripted_backend,
    tool_call,
)
from tools import ToolErrorKind, call_tool

CLOSED: list[str] = []  # the names of the toy envs closed, in order


class Corridor(gymnasium.Env):
    """Walk right to the end of a corridor: Discrete actions, integer observations.

    Each step costs 0.1; reaching the end pays 1.0 and terminates. ``options={"length": n}``
    sets the length (default 3).
    """

    def __init__(self) -> None:
        self.action_space = Discrete(2)  # 0: left, 1: right
        self.observation_space = Discrete(10)
        self.length = 3
        self.position = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.length = (options or {}).get("length", 3)
        self.position = 0
        return self.position, {}

    def step(self, action):
        self.position = max(0, self.position + (1 if action == 1 else -1))
        at_end = self.position == self.length
        return self.position, (1.0 if at_end else -0.1), at_end, False, {}

    def close(self) -> None:
        CLOSED.append("corridor")


class Password(gymnasium.Env):
    """Say the secret word (drawn from the seed): Text actions and observations, 3 tries."""

    WORDS = ("apple", "river", "stone", "cloud")

    def __init__(self) -> None:
        self.action_space = Text(min_length=1, max_length=8, charset=string.ascii_lowercase)
        self.observation_space = Text(max_length=40, charset=string.printable)
        self.tries = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.secret = self.WORDS[int(self.np_random.integers(len(self.WORDS)))]
        self.tries = 0
        return "Say the password.", {}

    def step(self, action):
        self.tries += 1
        if action == self.secret:
            return "Right!", 1.0, True, False, {}
        return "Wrong.", 0.0, False, self.tries >= 3, {}


WalkCorridor = gym_environment(
    Corridor,
    name="WalkCorridor",
    action_tool="move",
    action_doc="Move one square.",
    argument_doc="0 to go left, 1 to go right.",
    observe=lambda position: f"You are on square {position}.",
    options=["length"],
)
SayPassword = gym_environment(
    Password, action_tool="say", argument="word", action_doc="Say a word.", prompt="Log in."
)


def started(cls: type, seed: int | None = 0, **row) -> GymEnvironment:
    env = cls()
    env.reset(seed=seed, **row)
    return env


def call(env: object, name: str, **arguments):
    """Call a tool the way the engine does: arguments checked against the schema."""
    return anyio.run(call_tool, environment_tools(env), name, arguments, None)


# The classes the adapter builds


@pytest.mark.parametrize("cls", [WalkCorridor, SayPassword, GuessNumber])
def test_adapted_classes_meet_the_contract(cls):
    check_environment(cls)
    assert issubclass(cls, GymEnvironment)


def test_a_discrete_action_space_gives_an_integer_argument():
    [tool] = class_tools(WalkCorridor).values()
    assert tool.name == "move" and tool_names(WalkCorridor) == ["move"]
    assert tool.schema["function"]["description"] == "Move one square."
    assert tool.schema["function"]["parameters"] == {
        "type": "object",
        "properties": {
            "action": {"type": "integer", "description": "0 to go left, 1 to go right."}
        },
        "required": ["action"],
    }


def test_a_text_action_space_gives_a_string_argument_named_as_asked():
    parameters = class_tools(SayPassword)["say"].schema["function"]["parameters"]
    assert parameters["properties"] == {
        "word": {"type": "string", "description": "Text of 1 to 8 characters."}
    }
    assert parameters["required"] == ["word"]


def test_the_argument_description_defaults_to_the_action_space_in_words():
    parameters = class_tools(GuessNumber)["guess"].schema["function"]["parameters"]
    assert parameters["properties"]["number"]["description"] == "An integer from 1 to 100."


def test_the_tool_takes_its_argument_by_position_or_by_name():
    env = started(SayPassword)
    assert env.say("x") == env.say(word="y") == "Wrong."


def test_class_name_docstring_and_module_are_the_callers():
    assert WalkCorridor.__name__ == "WalkCorridor"
    assert WalkCorridor.__module__ == __name__
    assert SayPassword.__name__ == "PasswordEnvironment"
    assert "Password" in SayPassword.__doc__.splitlines()[0]


# An episode


def test_reset_returns_the_observation_as_text_and_steps_accumulate_reward():
    env = WalkCorridor()
    assert env.reset(seed=0, length=2) == "You are on square 0."
    assert env.move(1) == "You are on square 1."
    assert not env.done
    assert env.move(1) == "You are on square 2. (episode over)"
    assert env.done and env.terminated and not env.truncated
    assert env.steps == 2
    assert env.reward() == pytest.approx(-0.1 + 1.0)


def test_row_columns_named_in_options_reach_the_env_and_others_are_ignored():
    env = WalkCorridor()
    reset_environment(env, {"prompt": "Walk.", "length": 1, "unused": True}, seed=0)
    assert env.move(1) == "You are on square 1. (episode over)"


def test_a_row_without_an_options_column_fails_reset_with_the_column_named():
    with pytest.raises(EnvironmentResetError, match="length"):
        reset_environment(WalkCorridor(), {"prompt": "Walk."}, seed=0)


def test_the_env_truncating_ends_the_episode_as_cut_off():
    env = started(SayPassword)
    assert [env.say("wrong") for _ in range(3)][-1] == "Wrong. (out of steps: episode over)"
    assert env.done and env.truncated and not env.terminated
    assert env.reward() == 0.0


def test_max_episode_steps_truncates_in_the_adapter():
    Short = gym_environment(Corridor, action_doc="Move.", observe=str, max_episode_steps=2)
    env = started(Short, length=5)
    assert env.act(1) == "1"
    assert env.act(1) == "2 (out of steps: episode over)"
    assert env.done and env.truncated


def test_reset_starts_a_new_episode_on_the_same_env():
    env = started(WalkCorridor, length=1)
    env.move(1)
    gym_env = env.env
    env.reset(seed=1, length=1)
    assert env.env is gym_env
    assert (env.done, env.steps, env.reward()) == (False, 0, 0.0)


def test_acting_before_reset_is_a_user_error():
    with pytest.raises(RuntimeError, match="reset"):
        WalkCorridor().move(1)


# Invalid actions are the model's mistakes: error text, and the env does not step


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (2, "action 2 is out of range: it must be from 0 to 1"),
        (-1, "action -1 is out of range: it must be from 0 to 1"),
        (True, "action must be an integer, got True"),
        (1.5, "action must be an integer, got 1.5"),
    ],
)
def test_an_invalid_discrete_action_raises_a_clear_error_without_stepping(action, message):
    env = started(WalkCorridor, length=3)
    with pytest.raises(ValueError, match=message):
        env.move(action)
    assert env.steps == 0 and env.env.unwrapped.position == 0


@pytest.mark.parametrize(
    ("word", "message"),
    [
        ("Apple", "word contains characters that are not allowed: 'A'"),
        ("", "word has 0 characters; it must have 1 to 8"),
        ("strawberry", "word has 10 characters; it must have 1 to 8"),
    ],
)
def test_an_invalid_text_action_raises_a_clear_error_without_stepping(word, message):
    env = started(SayPassword)
    with pytest.raises(ValueError, match=message):
        env.say(word)
    assert env.steps == 0


def test_the_model_reads_an_invalid_action_as_an_error_message():
    env = started(GuessNumber)
    result = call(env, "guess", number=101)
    assert result.error is ToolErrorKind.EXCEPTION
    assert result.content == (
        "Error: guess() raised ValueError: number 101 is out of range: it must be from 1 to 100"
    )
    result = call(env, "guess", number="50")
    assert result.error is ToolErrorKind.BAD_ARGUMENTS
    assert env.steps == 0


def test_acting_after_the_episode_is_over_is_an_error():
    env = started(WalkCorridor, length=1)
    env.move(1)
    with pytest.raises(ValueError, match="episode is over"):
        env.move(1)
    assert env.steps == 1


# Seeds, reward, close


def test_the_same_seed_gives_the_same_game_and_other_seeds_other_games():
    def secret(seed):
        env = started(GuessNumber, seed=seed)
        return env.env.unwrapped.secret

    assert secret(5) == secret(5)
    assert len({secret(seed) for seed in range(20)}) > 10
    words = {started(SayPassword, seed=seed).env.unwrapped.secret for seed in range(20)}
    assert len(words) > 1


def test_reward_is_read_like_any_environment_reward():
    env = started(WalkCorridor, length=1)
    env.move(1)
    assert anyio.run(read_reward, env) == 1.0


def test_close_closes_the_gym_env_and_a_later_reset_makes_a_new_one():
    CLOSED.clear()
    env = started(WalkCorridor, length=1)
    close_environment(env)
    assert CLOSED == ["corridor"] and env.env is None
    close_environment(env)  # closing twice is harmless
    assert CLOSED == ["corridor"]
    env.reset(seed=0, length=1)
    assert env.move(1).endswith("(episode over)")


def test_building_the_class_probes_one_env_and_closes_it():
    CLOSED.clear()
    gym_environment(Corridor, action_doc="Move.", observe=str)
    assert CLOSED == ["corridor"]


def test_a_registered_gymnasium_id_is_made_with_gymnasium_make():
    gymnasium.register("agentgrpo-test/Password-v0", entry_point=Password)
    try:
        Registered = gym_environment("agentgrpo-test/Password-v0", action_doc="Say a word.")
        env = started(Registered, seed=3)
        assert env.act(env.env.unwrapped.secret) == "Right! (episode over)"
        assert env.reward() == 1.0
    finally:
        del gymnasium.registry["agentgrpo-test/Password-v0"]


# Mistakes in building the class are loud


def test_unsupported_spaces_and_names_are_refused_when_the_class_is_built():
    class Continuous(Corridor):
        def __init__(self) -> None:
            super().__init__()
            self.action_space = Box(-1.0, 1.0)

    with pytest.raises(TypeError, match="supports Discrete"):
        gym_environment(Continuous, action_doc="Move.", observe=str)
    with pytest.raises(TypeError, match="pass observe="):
        gym_environment(Corridor, action_doc="Move.")
    for name in ("reset", "reward", "close", "done", "env", "dataset", "_hidden", "not valid"):
        with pytest.raises(ValueError, match="action_tool"):
            gym_environment(Password, action_doc="Say.", action_tool=name)
    with pytest.raises(ValueError, match="argument"):
        gym_environment(Password, action_doc="Say.", argument="self")
    with pytest.raises(ValueError, match="max_episode_steps"):
        gym_environment(Password, action_doc="Say.", max_episode_steps=0)


def test_a_non_text_observation_from_observe_is_refused():
    Bad = gym_environment(Corridor, action_doc="Move.", observe=lambda position: position)
    with pytest.raises(TypeError, match="observe"):
        Bad().reset(seed=0)


# Rows from a prompt


def test_a_prompt_gives_a_dataset_of_that_prompt_with_distinct_seeds():
    train, evaluation = SayPassword.dataset("train"), SayPassword.dataset("eval")
    assert (len(train), len(evaluation)) == (256, 64)
    assert {tuple(m["content"] for m in p) for p in train["prompt"]} == {("Log in.",)}
    assert len(set(train["seed"])) == 256
    assert not set(train["seed"]) & set(evaluation["seed"])
    with pytest.raises(ValueError, match="splits"):
        SayPassword.dataset("test")


def test_without_a_prompt_there_is_no_dataset():
    assert not hasattr(WalkCorridor, "dataset")


# GuessNumber


def test_guess_number_is_a_builtin_with_one_tool():
    assert resolve_environment("env:GuessNumber") is GuessNumber
    assert tool_names(GuessNumber) == ["guess"]
    assert GuessNumber.__doc__.splitlines()[0].startswith("Find a secret number")


def test_guess_number_answers_too_low_too_high_and_correct():
    env = started(GuessNumber, seed=11)
    secret = env.env.unwrapped.secret
    assert env.reset(seed=11) == "I'm thinking of a whole number from 1 to 100. You have 7 guesses."
    if secret > 1:
        assert env.guess(secret - 1) == f"Too low. It is from {secret} to 100."
    if secret < 100:
        assert env.guess(secret + 1) == f"Too high. It is from {secret} to {secret}."
    assert env.guess(secret) == "Correct! (episode over)"
    assert env.done and env.terminated and env.reward() == 1.0


def test_guess_number_is_cut_off_after_seven_wrong_guesses():
    env = started(GuessNumber, seed=2)
    wrong = 1 if env.env.unwrapped.secret != 1 else 2
    answers = [env.guess(wrong) for _ in range(7)]
    assert answers[-1].endswith("(out of steps: episode over)")
    assert env.done and env.truncated and env.reward() < 0.5  # lost: only what it ruled out


def test_a_lost_game_earns_half_the_share_of_the_range_its_answers_ruled_out():
    def lost(guesses: list[int], seed: int = 0) -> float:  # seed 0's secret is 86
        env = started(GuessNumber, seed=seed)
        assert env.env.unwrapped.secret == 86
        for guess in guesses:
            env.guess(guess)
        return env.reward()

    assert lost([]) == 0.0
    assert lost([100, 100, 100]) == pytest.approx(0.5 * 1 / 100)  # only 100 is ruled out
    assert lost([10, 5, 1]) == pytest.approx(0.5 * 10 / 100)  # 5 and 1 say nothing new
    assert lost([50, 75, 88, 81, 84, 85, 87]) == pytest.approx(0.5 * 99 / 100)  # 86 is left
    assert lost([50, 75, 88, 81, 84, 86]) == 1.0


def test_a_binary_search_always_wins_the_game():
    for seed in range(50):
        env, low, high = started(GuessNumber, seed=seed), 1, 100
        while not env.done:
            guess = (low + high) // 2
            answer = env.guess(guess)
            low, high = (guess + 1, high) if answer.startswith("Too low.") else (low, guess - 1)
        assert env.reward() == 1.0


def test_the_game_is_plain_gymnasium():
    check_env(GuessNumberGame(), skip_render_check=True)
    game = GuessNumberGame(low=5, high=9)
    observation, _ = game.reset(seed=0)
    assert game.observation_space.contains(observation)
    assert game.action_space == Discrete(5, start=5)
    assert game.max_guesses == 3
    with pytest.raises(ValueError, match="low <= high"):
        GuessNumberGame(low=3, high=2)


def test_guess_number_dataset_is_deterministic_and_its_eval_split_held_out():
    train, evaluation = GuessNumber.dataset("train"), GuessNumber.dataset("eval")
    assert (len(train), len(evaluation)) == (256, 64)
    assert set(train.column_names) == {"prompt", "seed"}
    assert train.to_list() == GuessNumber.dataset("train").to_list()
    phrasings = {
        split: {p[0]["content"] for p in rows["prompt"]}
        for split, rows in (("train", train), ("eval", evaluation))
    }
    assert len(phrasings["train"]) == 4 and len(phrasings["eval"]) == 2
    assert not phrasings["train"] & phrasings["eval"]
    assert not set(train["seed"]) & set(evaluation["seed"])
    with pytest.raises(ValueError, match="splits"):
        GuessNumber.dataset("test")


def seed_with_secret(env_class: type, secret: int) -> int:
    """A seed whose game of `env_class` hides `secret`."""
    return next(
        s for s in range(100_000) if started(env_class, seed=s).env.unwrapped.secret == secret
    )


def demo_size(conversation: list[dict]) -> int:
    """The top of a demonstration's game, read from its rules: "... from 1 to 64. ..."."""
    return int(re.search(r"from 1 to (\d+)\.", conversation[0]["content"]).group(1))


def test_guess_number_demonstrations_replay_exactly_against_the_real_game():
    conversations = GuessNumber.demonstrations(12, seed=4)
    assert len(conversations) == 12
    for conversation in conversations:
        assert conversation[0]["role"] == "user" and conversation[-1]["role"] == "assistant"
        assert "tool_calls" not in conversation[-1] and conversation[-1]["content"]
        calls = [m["tool_calls"] for m in conversation[:-1] if m["role"] == "assistant"]
        tool_messages = [m for m in conversation if m["role"] == "tool"]
        assert all(len(c) == 1 and c[0]["function"]["name"] == "guess" for c in calls)
        assert all(m["name"] == "guess" for m in tool_messages)
        guesses = [c[0]["function"]["arguments"]["number"] for c in calls]
        game = guess_number_module._demo_game(demo_size(conversation))
        env = game()
        env.reset(seed=seed_with_secret(game, guesses[-1]))
        results = [call(env, "guess", number=g) for g in guesses]
        assert [r.error for r in results] == [None] * len(guesses)
        assert [r.content for r in results] == [m["content"] for m in tool_messages]
        assert env.done and env.reward() == 1.0


def test_guess_number_demonstrations_search_games_of_other_sizes_than_the_task():
    sizes = [demo_size(conversation) for conversation in GuessNumber.demonstrations(32)]
    assert 100 not in sizes and set(sizes) <= set(DEMO_HIGHS)
    assert len(set(sizes)) >= 5  # the strategy on several sizes, not one game's guesses
    for conversation in GuessNumber.demonstrations(8):
        guesses = [m["tool_calls"][0]["function"]["arguments"]["number"]
                   for m in conversation if m.get("tool_calls")]  # fmt: skip
        assert guesses[0] == (1 + demo_size(conversation)) // 2  # the middle first
        assert "from 1 to 100" not in conversation[0]["content"]
    assert GuessNumber.demonstrations(3, seed=1) == GuessNumber.demonstrations(3, seed=1)
    assert GuessNumber.demonstrations(8, seed=1) != GuessNumber.demonstrations(8, seed=2)


# Through the real rollout engine


def test_a_group_plays_the_same_game_through_the_engine_and_every_env_is_closed(tokenizer):
    row = GuessNumber.dataset("eval")[0]
    secret = started(GuessNumber, seed=row["seed"]).env.unwrapped.secret  # the row's own game
    wrong = 1 if secret != 1 else 2
    turns = [tool_call("guess", number=wrong), tool_call("guess", number=secret), "never"]
    backend = scripted_backend(tokenizer, turns)
    engine = chatml_engine(backend, tokenizer, GuessNumber, max_completion_length=512, max_turns=5)
    episodes = anyio.run(engine.run, [row], 3, 10)
    for episode in episodes:
        assert episode.finish is Finish.ENV_DONE
        assert episode.env_reward == 1.0
        assert [m["content"] for m in episode.messages if m["role"] == "tool"] == [
            f"Too low. It is from {wrong + 1} to 100."
            if wrong < secret
            else f"Too high. It is from 1 to {wrong - 1}.",
            "Correct! (episode over)",
        ]
        assert episode.messages[0] == {
            "role": "user",
            "content": f"{row['prompt'][0]['content']}\n"
            "I'm thinking of a whole number from 1 to 100. You have 7 guesses.",
        }
        assert episode.environment.env is None  # closed


def test_demonstrations_lay_out_with_the_engines_template_for_the_warm_start(tokenizer):
    assert_demonstrations_train_every_call(tokenizer, GuessNumber)


def test_calls_of_one_turn_run_concurrently_but_step_the_env_one_at_a_time():
    env = started(WalkCorridor, length=50)

    async def eight_moves():
        async with anyio.create_task_group() as group:
            for _ in range(8):
                group.start_soon(call_tool, environment_tools(env), "move", {"action": 1}, None)

    anyio.run(eight_moves)
    assert env.steps == 8 and env.env.unwrapped.position == 8
