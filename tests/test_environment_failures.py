"""An environment whose `__init__`, `reset` or `close` fails: one error naming class and method.

`reset`'s error is the first cause and the one raised; a `close` that then fails too is attached
to it as a note, and `agentgrpo run` prints both on one `error:` line and one indented line.
"""

from __future__ import annotations

import json
import textwrap

import anyio
import pytest
from conftest import scripted_backend

from agentgrpo.cli import main
from environments import (
    Counter,
    EnvironmentCloseError,
    EnvironmentInitError,
    EnvironmentResetError,
    create_environment,
)
from rollout import EpisodeConfig, RolloutEngine

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


def play(tokenizer, factory) -> None:
    engine = RolloutEngine(
        scripted_backend(tokenizer, ["Done."]),
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


# ---------------------------------------------------------------------- the command line

ENVS = """
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
"""


@pytest.fixture
def run_error(capsys, monkeypatch, tmp_path, tiny_model_dir):
    """`agentgrpo run envs.py:NAME` for one short step of the tiny model; its stderr lines."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "envs.py").write_text(textwrap.dedent(ENVS))
    (tmp_path / "rows.jsonl").write_text(json.dumps(ROW) + "\n")

    def run(name: str) -> list[str]:
        status = main(
            ["run", f"envs.py:{name}", "--model", str(tiny_model_dir), "--dataset", "rows.jsonl",
             "--max-steps", "1", "--per-device-train-batch-size", "2", "--num-generations", "2",
             "--max-completion-length", "8", "--chat-template", "chatml_tools",
             "--output-dir", str(tmp_path / "out")]
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
