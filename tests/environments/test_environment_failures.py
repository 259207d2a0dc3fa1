"""An environment whose `__init__`, `reset` or `close` fails: one error naming class and method.

`reset`'s error is the first cause and the one raised; a `close` that then fails too is attached
to it as a note, and `agentgrpo run` prints both on one `error:` line and one indented line.
"""

from __future__ import annotations

import json
import textwrap

import anyio
import pytest

from agentgrpo.cli import main
from environments import (
    Counter,
    EnvironmentCloseError,
    EnvironmentDoneError,
    EnvironmentInitError,
    EnvironmentResetError,
    create_environment,
)
from rollout import EpisodeConfig, RolloutEngine
from tests.support.episodes import scripted_backend, tool_call

ROW = {"prompt": "Reach 1.", "target": 1}


class BrokenInit(Counter):
    def __init__(self):
        raise RuntimeError("no licence")


class BrokenReset(Counter):
    def reset(self, target: int) -> str:
        raise ValueError("bad target")


class BrokenResetAndClose(BrokenReset):
    def close(self) -> None:
        raise OSError("socket already gone")


class BrokenClose(Counter):
    def close(self) -> None:
        raise OSError("socket already gone")


class SurrogateReset(Counter):
    def reset(self, target: int) -> str:
        return "Reach \udc80 fast."  # e.g. bytes decoded with errors="surrogateescape"


class BrokenDone(Counter):
    @property
    def done(self) -> bool:
        raise KeyError("state")


def play(tokenizer, factory, turns=("Done.",)) -> None:
    engine = RolloutEngine(
        scripted_backend(tokenizer, list(turns)),
        tokenizer,
        environment_factory=factory,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=64, max_turns=2),
    )
    anyio.run(engine.run, [ROW])


def test_an_init_that_raises_names_the_class_and_init(tokenizer):
    with pytest.raises(EnvironmentInitError) as caught:
        play(tokenizer, BrokenInit)
    assert str(caught.value) == "BrokenInit.__init__() raised RuntimeError: no licence"
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_factory_that_raises_is_named_as_the_factory():
    def make_game() -> Counter:
        raise RuntimeError("no licence")

    with pytest.raises(EnvironmentInitError, match=r"factory .*make_game\(\) raised RuntimeE"):
        create_environment(make_game)


def test_a_close_that_raises_after_a_good_episode_names_the_class_and_close(tokenizer):
    with pytest.raises(EnvironmentCloseError) as caught:
        play(tokenizer, BrokenClose)
    assert str(caught.value) == "BrokenClose.close() raised OSError: socket already gone"


def test_when_reset_and_close_both_fail_resets_error_is_raised_with_close_as_a_note(tokenizer):
    with pytest.raises(EnvironmentResetError) as caught:
        play(tokenizer, BrokenResetAndClose)
    assert str(caught.value).startswith("BrokenResetAndClose.reset() raised ValueError: bad target")
    assert caught.value.__notes__ == [
        "Closing the environment then failed too: "
        "BrokenResetAndClose.close() raised OSError: socket already gone"
    ]


def test_reset_text_with_a_lone_surrogate_names_the_class_and_reset(tokenizer):
    with pytest.raises(EnvironmentResetError) as caught:  # before: the tokenizer's TypeError
        play(tokenizer, SurrogateReset)
    assert str(caught.value).startswith(
        "SurrogateReset.reset() returned text with a lone surrogate '\\udc80' at index 6"
    )


def test_a_done_property_that_raises_names_the_class_and_done(tokenizer):
    with pytest.raises(EnvironmentDoneError) as caught:  # before: the KeyError itself
        play(tokenizer, BrokenDone, turns=[tool_call("increment", step=1), "Done."])
    assert str(caught.value) == "BrokenDone.done raised KeyError: 'state'"
    assert isinstance(caught.value.__cause__, KeyError)


# ---------------------------------------------------------------------- the command line

ENVS = """
import threading

from environments import Counter


class BrokenInit(Counter):
    def __init__(self):
        raise RuntimeError("no licence")


class BrokenClose(Counter):
    def close(self) -> None:
        raise OSError("socket already gone")


class BrokenResetAndClose(BrokenClose):
    def reset(self, target: int) -> str:
        raise ValueError("bad target")


class HungReset(Counter):
    def reset(self, target: int) -> str:
        threading.Event().wait(60)  # far past --environment-timeout-s
        return super().reset(target)
"""


@pytest.fixture
def run_error(capsys, monkeypatch, tmp_path, tiny_model_dir):
    """`agentgrpo run envs.py:NAME` for one short step of the tiny model; its stderr lines."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "envs.py").write_text(textwrap.dedent(ENVS))
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROW) + "\n")

    def run(name: str, *options: str) -> list[str]:
        status = main(
            ["run", f"envs.py:{name}", "--model", str(tiny_model_dir), "--dataset", "rows.jsonl",
             "--max-steps", "1", "--per-device-train-batch-size", "2", "--num-generations", "2",
             "--max-completion-length", "8", "--chat-template", "chatml_tools",
             "--output-dir", str(tmp_path / "out"), *options]
        )  # fmt: skip
        err = capsys.readouterr().err
        assert status == 2 and "Traceback" not in err, err
        lines = err.splitlines()
        [at] = [i for i, line in enumerate(lines) if "error: " in line]
        return [lines[at][lines[at].index("error: ") :], *lines[at + 1 :]]

    return run


def test_run_with_an_init_that_raises_prints_one_error_naming_class_and_init(run_error):
    assert run_error("BrokenInit") == [
        "error: BrokenInit.__init__() raised RuntimeError: no licence"
    ]


def test_run_with_a_close_that_raises_prints_one_error_naming_class_and_close(run_error):
    assert run_error("BrokenClose") == [
        "error: BrokenClose.close() raised OSError: socket already gone"
    ]


def test_run_with_reset_and_close_failing_prints_resets_error_then_closes(run_error):
    first, note = run_error("BrokenResetAndClose")
    assert first.startswith("error: BrokenResetAndClose.reset() raised ValueError: bad target")
    assert note == (
        "  Closing the environment then failed too: "
        "BrokenResetAndClose.close() raised OSError: socket already gone"
    )


def test_run_with_a_reset_that_hangs_prints_one_error_naming_class_and_reset(run_error):
    [line, note] = run_error("HungReset", "--environment-timeout-s", "0.5")
    assert line.startswith(
        "error: HungReset.reset() did not return within 0.5 s (environment_timeout_s)"
    )
    assert note.endswith(
        "HungReset.close() was not called: the method that timed out may still run."
    )
