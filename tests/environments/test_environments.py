"""The Environment contract: resolving specs, discovering tools, and driving an episode."""

from __future__ import annotations

import asyncio
import functools
import math
import sys
import textwrap

import anyio
import numpy as np
import pytest

from environments import (
    BUILTIN_ENVIRONMENTS,
    Counter,
    Environment,
    EnvironmentCloseError,
    EnvironmentDoneError,
    EnvironmentResetError,
    EnvironmentRewardError,
    EnvironmentSpecError,
    check_environment,
    close_environment,
    environment_tools,
    is_done,
    read_reward,
    reset_environment,
    resolve_environment,
    tool_names,
)
from tools import Tool

ENV_FILE = """
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Settings:
    size: int = 3


class Grid:
    def reset(self, size: int) -> str:
        self.size = size
        return f"{size}x{size}"


class Outer:
    class Inner:
        def reset(self) -> None:
            pass


class NoReset:
    pass


def helper():
    pass
"""


class Everything:
    """One of each kind of member, to see which ones are tools."""

    done = False
    limit = 3

    def reset(self, **row) -> None:
        pass

    def look(self) -> str:
        """Look around."""
        return "a room"

    async def wait(self, seconds: float) -> str:
        """Wait a while.

        Args:
            seconds: How long to wait.
        """
        return "waited"

    def reward(self) -> float:
        return 0.0

    def close(self) -> None:
        pass

    @classmethod
    def demonstrations(cls, n: int, seed: int = 0) -> list:
        return []

    def _private(self) -> None:
        pass

    @classmethod
    def dataset(cls) -> list:
        return []

    @classmethod
    def build(cls) -> Everything:
        return cls()

    @staticmethod
    def version() -> str:
        return "1"

    @property
    def state(self) -> str:
        return "state"


class MoreOfEverything(Everything):
    def jump(self, height: int) -> int:
        """Jump.

        Args:
            height: How high.
        """
        return height


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(ENV_FILE)
    return path


# Resolution


def test_env_prefix_resolves_a_builtin():
    assert resolve_environment("env:Counter") is Counter
    assert list(BUILTIN_ENVIRONMENTS) == [
        "Counter",
        "Arithmetic",
        "GuessNumber",
        "Chain",
        "ColourSquare",
        "Trail",
        "Questions",
        "TicTacToe",
    ]


def test_module_spec_resolves_an_importable_class():
    assert resolve_environment("environments.counter:Counter") is Counter


def test_file_spec_resolves_a_class_from_an_absolute_path(env_file):
    grid = resolve_environment(f"{env_file}:Grid")
    assert grid.__name__ == "Grid"
    assert grid().reset(size=2) == "2x2"


def test_file_spec_resolves_relative_to_the_current_directory(env_file, monkeypatch):
    monkeypatch.chdir(env_file.parent.parent)
    assert resolve_environment(f"{env_file.parent.name}/my_env.py:Grid").__name__ == "Grid"
    monkeypatch.chdir(env_file.parent)
    assert resolve_environment("my_env.py:Grid").__name__ == "Grid"


def test_file_spec_loads_the_file_once_and_supports_dataclasses(env_file):
    first = resolve_environment(f"{env_file}:Grid")
    assert resolve_environment(f"{env_file}:Grid") is first
    inner = resolve_environment(f"{env_file}:Outer.Inner")  # dotted names too
    assert inner.__qualname__ == "Outer.Inner"


def test_files_with_the_same_name_in_different_folders_do_not_collide(tmp_path):
    for folder, reply in (("a", "from a"), ("b", "from b")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "env.py").write_text(
            f"class E:\n    def reset(self):\n        return {reply!r}\n"
        )
    a = resolve_environment(f"{tmp_path}/a/env.py:E")
    b = resolve_environment(f"{tmp_path}/b/env.py:E")
    assert a is not b
    assert (a().reset(), b().reset()) == ("from a", "from b")


def test_a_file_imports_the_modules_beside_it_as_python_file_py_would(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the test's own sys.path comes back
    (tmp_path / "beside_the_env_file.py").write_text("START = 'at 3'\n")
    (tmp_path / "sib.py").write_text(
        "from beside_the_env_file import START\n\n"
        "class E:\n    def reset(self):\n        return START\n"
    )
    assert resolve_environment(f"{tmp_path}/sib.py:E")().reset() == "at 3"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("Counter", "not an installed environment package (did you mean 'env:Counter'?)"),
        (":Counter", "both sides of ':'"),
        ("env:", "both sides of ':'"),
        ("env:Countr", "no built-in environment 'Countr' (did you mean 'Counter'?); built-ins"),
        ("env:counter", "did you mean 'Counter'?"),
        ("env:Chess", "built-ins: Arithmetic, Chain, ColourSquare, Counter, GuessNumber"),
        ("no_such_module_xyz:Env", "cannot import module 'no_such_module_xyz'"),
        ("environments.counter:Countr", "has no 'Countr' (did you mean 'Counter'?)"),
        ("environments.counter:random", "names a module, not a class"),
        ("environments:check_environment", "names a function, not a class"),
        ("environments:EnvironmentSpecError", "has no reset() method"),
    ],
)
def test_bad_specs_raise_one_clear_error(spec, expected):
    with pytest.raises(EnvironmentSpecError) as caught:
        resolve_environment(spec)
    assert expected in str(caught.value)


def test_unknown_builtin_points_to_the_file_form_for_a_file_named_env():
    with pytest.raises(EnvironmentSpecError, match=r"'env\.py:Grid'"):
        resolve_environment("env:Grid")


def test_missing_file_is_named_with_its_absolute_path(tmp_path):
    with pytest.raises(EnvironmentSpecError, match="environment file not found") as caught:
        resolve_environment(f"{tmp_path}/absent.py:Env")
    assert str(tmp_path / "absent.py") in str(caught.value)


def test_class_missing_from_a_file_suggests_the_nearest_and_lists_classes(env_file):
    with pytest.raises(EnvironmentSpecError) as caught:
        resolve_environment(f"{env_file}:Gird")
    message = str(caught.value)
    assert "has no 'Gird' (did you mean 'Grid'?)" in message
    assert "classes there: Grid, NoReset, Outer, Settings" in message


def test_file_objects_that_are_not_environments_are_refused(env_file):
    with pytest.raises(EnvironmentSpecError, match="names a function, not a class"):
        resolve_environment(f"{env_file}:helper")
    with pytest.raises(EnvironmentSpecError, match="class NoReset, which has no reset"):
        resolve_environment(f"{env_file}:NoReset")


def test_a_file_that_fails_to_run_is_reported_with_the_error(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(EnvironmentSpecError, match="raised ModuleNotFoundError") as caught:
        resolve_environment(f"{path}:Env")
    assert "no_such_dependency_xyz" in str(caught.value)
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


def test_a_module_whose_own_import_fails_is_not_reported_as_missing(tmp_path, monkeypatch):
    (tmp_path / "needs_missing_dep_xyz.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvironmentSpecError) as caught:
        resolve_environment("needs_missing_dep_xyz:Env")
    message = str(caught.value)
    assert "importing module 'needs_missing_dep_xyz' failed" in message
    assert "no_such_dependency_xyz" in message


# Tool discovery


def test_tools_are_the_public_plain_methods_minus_reserved_names():
    assert tool_names(Everything) == ["look", "wait"]


def test_inherited_tool_methods_are_tools_too():
    assert tool_names(MoreOfEverything) == ["jump", "look", "wait"]


def test_environment_tools_are_bound_to_the_live_instance():
    env = Counter()
    env.reset(target=2)
    tools = environment_tools(env)
    assert list(tools) == ["increment"]
    assert isinstance(tools["increment"], Tool)
    assert tools["increment"].fn(step=2) == 2
    assert env.value == 2
    parameters = tools["increment"].schema["function"]["parameters"]
    assert parameters["properties"]["step"] == {"type": "integer", "description": "Value to add."}


def test_each_instance_gets_tools_over_its_own_state():
    first, second = Counter(), Counter()
    first.reset(target=1)
    second.reset(target=1)
    environment_tools(first)["increment"].fn(step=5)
    assert (first.value, second.value) == (5, 0)


# check_environment


def test_conforming_classes_pass_the_check():
    check_environment(Counter)
    check_environment(Everything)
    check_environment(MoreOfEverything)


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVIRONMENTS))
def test_every_builtin_is_an_environment_by_the_protocol(name):
    assert isinstance(BUILTIN_ENVIRONMENTS[name](), Environment)


def test_an_object_without_reset_is_not_an_environment_by_the_protocol():
    class NoReset:
        def step(self) -> str:
            """Take a step."""
            return "moved"

    assert not isinstance(NoReset(), Environment)
    assert isinstance(Everything(), Environment)


def test_check_names_class_method_and_fix_for_a_tool_without_type_hints():
    class Shop:
        def reset(self) -> None:
            pass

        def buy(self, item) -> str:
            """Buy something.

            Args:
                item: What to buy.
            """
            return item

    with pytest.raises(EnvironmentSpecError) as caught:
        check_environment(Shop)
    message = str(caught.value)
    assert "Shop.buy is a tool" in message
    assert "'item' has no type hint" in message
    assert "leading underscore" in message


def test_check_names_class_and_method_for_a_tool_without_docstring():
    class Shop:
        def reset(self) -> None:
            pass

        def sell(self, item: str) -> str:
            return item

    with pytest.raises(EnvironmentSpecError, match=r"Shop\.sell is a tool.*no docstring"):
        check_environment(Shop)


def test_environment_tools_reports_a_bad_tool_the_same_way():
    class Shop:
        def reset(self) -> None:
            pass

        def sell(self, item: str) -> str:
            return item

    with pytest.raises(EnvironmentSpecError, match=r"Shop\.sell is a tool"):
        environment_tools(Shop())


def test_check_refuses_a_class_without_reset():
    class Idle:
        pass

    with pytest.raises(EnvironmentSpecError, match=r"Idle has no reset\(\) method"):
        check_environment(Idle)


def test_check_refuses_a_non_class():
    with pytest.raises(EnvironmentSpecError, match="expected an environment class"):
        check_environment(Counter())


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("@classmethod\ndef reset(cls): pass", "reset must be a plain instance method"),
        ("def reset(self, target, /): pass", "positional-only parameters ['target']"),
        ("def reset(self): pass\ndef done(self): return True", "done is a method"),
        ("def reset(self): pass\ndef dataset(self): return []", "dataset must be a @classmethod"),
        ("def reset(self): pass\nclose = None", "close must be a method"),
        ("async def reset(self): pass", "reset() is async; make it a plain method"),
        ("def reset(self): pass\nasync def close(self): pass", "close() is async; make it a"),
        (
            "def reset(self): pass\ndef reward(self): return 1.0\ndef get_reward(self): return 1",
            "defines both reward() and get_reward(); keep one",
        ),
        (
            "def reset(self): pass\ndef demonstrations(self, n): return []",
            "demonstrations must be a @classmethod",
        ),
        (
            "def __init__(self, size, level=1): pass\ndef reset(self): pass",
            "__init__ requires 'size', but the engine makes each episode's instance with no "
            "arguments, as Broken(); give the parameters defaults, or pass a factory that "
            "supplies them, e.g. environment_factory=functools.partial(Broken, size=...)",
        ),
    ],
)
def test_check_refuses_misdefined_contract_members(body, expected):
    namespace: dict = {}
    exec("class Broken:\n" + textwrap.indent(body, "    "), namespace)
    with pytest.raises(EnvironmentSpecError) as caught:
        check_environment(namespace["Broken"])
    assert "Broken" in str(caught.value)
    assert expected in str(caught.value)


def test_a_class_made_by_a_factory_may_require_init_arguments():
    class Sized:
        def __init__(self, size: int) -> None:
            self.size = size

        def reset(self) -> None:
            pass

    check_environment(Sized, functools.partial(Sized, size=3))


@pytest.mark.parametrize(
    "cache", [functools.cache, functools.lru_cache(maxsize=8)], ids=["cache", "lru_cache"]
)
def test_a_cached_public_method_is_refused_naming_it_not_silently_left_out(cache):
    class Lookup:
        def reset(self) -> None:
            pass

        @cache
        def find(self, key: str) -> str:
            """Find a key.

            Args:
                key: The key.
            """
            return key

    with pytest.raises(EnvironmentSpecError, match=r"Lookup\.find is a public method.*lru_cache"):
        check_environment(Lookup)


def test_an_async_reset_is_refused_at_run_time_with_the_message_of_the_check():
    class Slow:
        async def reset(self) -> None:
            pass

    with pytest.raises(EnvironmentSpecError) as checked:
        check_environment(Slow)
    with pytest.raises(EnvironmentResetError) as at_run_time:
        reset_environment(Slow(), {"prompt": "Go."}, seed=0)
    assert str(at_run_time.value) == f"{checked.value}. Row: {{'prompt': 'Go.'}}"


def test_done_may_be_an_attribute_or_a_property():
    class Flagged:
        done = False

        def reset(self) -> None:
            pass

    class Computed:
        def reset(self) -> None:
            self.steps = 0

        @property
        def done(self) -> bool:
            return self.steps >= 1

    check_environment(Flagged)
    check_environment(Computed)
    env = Computed()
    env.reset()
    assert not is_done(env)
    env.steps = 1
    assert is_done(env)


# reset_environment


class Recorder:
    def reset(self, target: int, size: int = 2) -> str:
        self.got = {"target": target, "size": size}
        return "ready"


class SeededRecorder:
    def reset(self, target: int, seed: int | None = None) -> None:
        self.got = {"target": target, "seed": seed}


class TakesEverything:
    def reset(self, **row) -> None:
        self.got = row


def test_reset_receives_only_the_columns_it_names():
    env = Recorder()
    text = reset_environment(env, {"target": 4, "prompt": [{"role": "user"}], "id": 9}, seed=1)
    assert text == "ready"
    assert env.got == {"target": 4, "size": 2}


def test_reset_with_kwargs_receives_every_column_and_the_seed():
    env = TakesEverything()
    assert reset_environment(env, {"target": 4, "prompt": "p"}, seed=7) is None
    assert env.got == {"target": 4, "prompt": "p", "seed": 7}


def test_reset_receives_the_seed_when_it_has_a_seed_parameter():
    env = SeededRecorder()
    reset_environment(env, {"target": 4}, seed=123)
    assert env.got == {"target": 4, "seed": 123}


def test_reset_without_a_seed_parameter_is_not_given_one():
    env = Recorder()
    reset_environment(env, {"target": 4}, seed=123)
    assert env.got == {"target": 4, "size": 2}


def test_group_members_get_the_same_seed():
    group = [SeededRecorder() for _ in range(4)]
    for env in group:
        reset_environment(env, {"target": 3}, seed=42)
    assert {env.got["seed"] for env in group} == {42}


def test_a_rows_own_seed_column_is_passed_and_the_seed_argument_only_where_it_has_none():
    env = SeededRecorder()
    reset_environment(env, {"target": 1, "seed": 5}, seed=9)
    assert env.got["seed"] == 5  # the row names its game, as TRL passes reset(**row)
    reset_environment(env, {"target": 1, "seed": None}, seed=9)
    assert env.got["seed"] == 9
    reset_environment(env, {"target": 1}, seed=None)
    assert env.got["seed"] is None


def test_a_missing_required_column_names_class_parameter_and_row():
    with pytest.raises(EnvironmentResetError) as caught:
        reset_environment(Recorder(), {"prompt": "hello"}, seed=None)
    message = str(caught.value)
    assert "Recorder.reset() needs 'target', which the row lacks" in message
    assert "{'prompt': 'hello'}" in message


def test_a_reset_that_raises_is_chained_and_shows_class_and_row():
    class Fragile:
        def reset(self, target: int) -> None:
            raise KeyError("board")

    with pytest.raises(EnvironmentResetError) as caught:
        reset_environment(Fragile(), {"target": 3, "note": "x" * 500}, seed=None)
    message = str(caught.value)
    assert "Fragile.reset() raised KeyError: 'board'" in message
    assert "'target': 3" in message
    assert "..." in message
    assert len(message) < 300  # long values are cut
    assert isinstance(caught.value.__cause__, KeyError)


@pytest.mark.parametrize("returned", [3, ["text"], {"text": "hi"}])
def test_reset_must_return_text_or_none(returned):
    class Odd:
        def reset(self) -> object:
            return returned

    with pytest.raises(EnvironmentResetError, match=r"Odd\.reset\(\) returned .*must return str"):
        reset_environment(Odd(), {}, seed=None)


# read_reward, is_done, close_environment


def reward_of(env) -> float | None:
    return anyio.run(read_reward, env)


def test_reward_is_none_without_a_reward_method():
    class Plain:
        def reset(self) -> None:
            pass

    assert reward_of(Plain()) is None


@pytest.mark.parametrize(("returned", "expected"), [(1, 1.0), (0.25, 0.25), (True, 1.0)])
def test_reward_is_converted_to_float(returned, expected):
    class Scored:
        def reward(self) -> object:
            return returned

    value = reward_of(Scored())
    assert value == expected
    assert type(value) is float


def test_a_reward_that_raises_is_an_error_naming_the_class():
    class Judge:
        def reward(self) -> float:
            raise ZeroDivisionError("no moves")

    with pytest.raises(EnvironmentRewardError, match=r"Judge\.reward\(\) raised ZeroDivision"):
        reward_of(Judge())


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        (math.nan, "must be finite"),
        (math.inf, "must be finite"),
        ("1.0", "a string"),
        (None, "return a float"),
        ([1.0], "return a float"),
        pytest.param(10**400, "return a float", id="float-overflows"),
        pytest.param(10**5000, "returned a int that cannot be shown", id="past-repr-digits"),
    ],
)
def test_a_reward_that_is_not_a_finite_number_is_an_error(returned, expected):
    class Judge:
        def reward(self) -> object:
            return returned

    with pytest.raises(EnvironmentRewardError) as caught:
        reward_of(Judge())
    assert "Judge.reward() returned" in str(caught.value)
    assert expected in str(caught.value)


def test_an_async_reward_is_awaited():
    class Judge:
        async def reward(self) -> float:
            return 1.0

    assert reward_of(Judge()) == 1.0


def test_trl_style_get_reward_is_read_like_reward():
    class IncrementEnv:
        def get_reward(self) -> float:
            return 0.5

    assert reward_of(IncrementEnv()) == 0.5


def test_defining_both_reward_and_get_reward_is_an_error():
    class Both:
        def reward(self) -> float:
            return 1.0

        def get_reward(self) -> float:
            return 1.0

    with pytest.raises(EnvironmentSpecError, match="both reward"):
        reward_of(Both())


def test_an_async_reward_whose_inner_task_was_cancelled_is_a_reward_error():
    class Judge:
        async def reward(self) -> float:
            scoring = asyncio.create_task(asyncio.sleep(10))
            asyncio.get_running_loop().call_later(0.01, scoring.cancel)
            await scoring
            return 1.0

    with pytest.raises(EnvironmentRewardError, match=r"Judge\.reward\(\) raised CancelledError"):
        reward_of(Judge())


def test_a_done_whose_truth_cannot_be_told_is_an_error_naming_the_class():
    class Grid:
        done = np.array([True, False])

    with pytest.raises(EnvironmentDoneError, match=r"Grid\.done is a ndarray whose truth"):
        is_done(Grid())


def test_done_defaults_to_false_and_follows_the_attribute():
    env = Counter()
    assert is_done(env) is False
    env.done = True
    assert is_done(env) is True


def test_close_is_called_when_defined_and_skipped_otherwise():
    calls = []

    class Closable:
        def close(self) -> None:
            calls.append("closed")

    close_environment(Closable())
    close_environment(Counter())  # no close(): nothing to do
    assert calls == ["closed"]


def test_a_close_that_raises_names_the_class_and_the_method():
    class Leaky:
        def close(self) -> None:
            raise OSError("socket")

    with pytest.raises(EnvironmentCloseError, match=r"Leaky.close\(\) raised OSError: socket"):
        close_environment(Leaky())


# Counter


def test_counter_rewards_exactly_reaching_the_target():
    env = Counter()
    assert reset_environment(env, {"target": 7, "prompt": []}, seed=0) == "The counter is at 0."
    increment = environment_tools(env)["increment"].fn
    assert reward_of(env) == 0.0
    assert increment(step=4) == 4
    assert increment(step=3) == 7
    assert reward_of(env) == 1.0
    assert increment(step=1) == 8
    assert reward_of(env) == 0.0


def test_counter_reset_starts_over():
    env = Counter()
    env.reset(target=2)
    env.increment(step=2)
    env.reset(target=3)
    assert (env.value, env.target) == (0, 3)


def test_counter_exposes_only_increment():
    assert tool_names(Counter) == ["increment"]
    schema = environment_tools(Counter())["increment"].schema["function"]
    assert schema["parameters"]["required"] == ["step"]


def test_counter_dataset_has_prompt_and_target_columns():
    rows = Counter.dataset()
    assert rows.column_names == ["prompt", "target"]
    assert len(rows) >= 200
    for row in rows:
        assert 1 <= row["target"] <= 9
        [message] = row["prompt"]
        assert message["role"] == "user"
        assert str(row["target"]) in message["content"]
        assert "increment" in message["content"]


def test_counter_dataset_is_deterministic():
    assert Counter.dataset().to_list() == Counter.dataset("train").to_list()
    assert Counter.dataset("eval").to_list() == Counter.dataset("eval").to_list()


def test_counter_eval_split_is_held_out_by_phrasing():
    def phrasings(split):
        return {
            row["prompt"][0]["content"].replace(str(row["target"]), "N")
            for row in Counter.dataset(split)
        }

    train, held_out = phrasings("train"), phrasings("eval")
    assert len(train) > 1
    assert len(held_out) > 1
    assert not train & held_out
    assert 0 < len(Counter.dataset("eval")) < len(Counter.dataset("train"))


def test_counter_dataset_refuses_an_unknown_split():
    with pytest.raises(ValueError, match="not 'test'"):
        Counter.dataset("test")


def test_counter_targets_cover_one_to_nine():
    assert set(Counter.dataset()["target"]) == set(range(1, 10))
