"""User mistakes on the `agentgrpo` command line: each is one `error:` line naming what to fix.

Every command runs in-process through `agentgrpo.cli.main`, as a user would type it; none of
these mistakes may reach a traceback, and none may exit the test process.
"""

from __future__ import annotations

import pytest

from agentgrpo.cli import build_parser, main
from agentgrpo.cli.commands import _run_settings
from agentgrpo.cli.options import UsageError, parse_value
from environments import Counter

FINITE = "a finite number (1e400 reads as inf)"


# ---------------------------------------------------------------------- typed options


@pytest.mark.parametrize(
    ("option", "text", "expected"),
    [
        ("--learning-rate", "abc", "--learning-rate takes a number, not 'abc'"),
        ("--beta", "abc", "--beta takes a number, not 'abc'"),
        ("--num-generations", "four", "--num-generations takes a whole number, not 'four'"),
        ("--max-turns", "x", "--max-turns takes a whole number or none, not 'x'"),
        ("--use-vllm", "maybe", "--use-vllm takes true or false, not 'maybe'"),
        ("--lr-scheduler-type", "cosin", "--lr-scheduler-type takes one of linear, cosine,"),
        ("--reward-weights", "1,a", "--reward-weights takes a list of numbers, not 'a'"),
        ("--liger-kernel-config", "x", "--liger-kernel-config takes a JSON object or none"),
    ],
)
def test_a_value_of_the_wrong_type_names_the_option_and_the_value(
    user_error, option, text, expected
):
    assert user_error("run", "env:Counter", option, text).startswith(f"error: {expected}")


@pytest.mark.parametrize(
    ("command", "option", "text"),
    [
        ("run", "--learning-rate", "inf"),
        ("run", "--learning-rate", "1e400"),
        ("run", "--beta", "nan"),
        ("run", "--temperature", "inf"),
        ("run", "--reward-weights", "1,nan"),
        ("eval", "--temperature", "inf"),
        ("eval", "--top-p", "nan"),
    ],
)
def test_nan_and_infinity_are_refused_as_option_values(user_error, command, option, text):
    message = user_error(command, "env:Counter", option, text)
    assert message.startswith(f"error: {option} takes {FINITE}, not")


def test_max_steps_takes_minus_one_for_epochs_or_a_positive_count(user_error):
    for steps in ("-5", "0"):
        message = user_error("run", "env:Counter", "--max-steps", steps)
        assert message == (
            f"error: --max-steps takes -1 (train by epochs) or a whole number >= 1, not '{steps}'"
        )
    assert parse_value("max_steps", "-1") == -1  # TRL's "use num_train_epochs" stays valid
    assert parse_value("max_steps", "3") == 3


@pytest.mark.parametrize(
    ("option", "text", "expected"),
    [
        ("--per-device-train-batch-size", "0", "takes a whole number >= 1, not '0'"),
        ("--gradient-accumulation-steps", "0", "takes a whole number >= 1, not '0'"),
        ("--steps-per-generation", "0", "takes a whole number >= 1, not '0'"),
        ("--generation-batch-size", "0", "takes a whole number >= 1, not '0'"),
        ("--num-iterations", "0", "takes a whole number >= 1, not '0'"),
        ("--warmup-steps", "-1", "takes a number >= 0, not '-1'"),
        ("--seed", "-1", "takes a whole number from 0 to 2**32 - 1, not '-1'"),
        ("--learning-rate", "-0.1", "takes a number >= 0, not '-0.1'"),
        ("--temperature", "-1", "takes a number >= 0, not '-1'"),
        ("--top-p", "2", "takes a number in (0, 1], not '2'"),
        ("--max-completion-length", "0", "takes a whole number >= 1, not '0'"),
    ],
)
def test_a_value_out_of_range_names_the_option_and_the_range(user_error, option, text, expected):
    assert user_error("run", "env:Counter", option, text) == f"error: {option} {expected}"


def test_values_trl_accepts_stay_accepted():
    assert parse_value("beta", "-0.5") == -0.5  # unusual, but TRL trains with it
    assert parse_value("logging_steps", "0.1") == 0.1  # a fraction of the run
    assert parse_value("temperature", "0") == 0.0  # greedy
    assert parse_value("save_total_limit", "none") is None
    assert parse_value("report_to", "none") == ["none"]
    assert parse_value("deepspeed", "ds.json") == "ds.json"  # a dict, or a file TRL reads


def test_typed_options_reach_the_config_as_their_types():
    parser, _ = build_parser()
    argv = ["run", "env:Counter", "--learning-rate", "1e-5", "--use-vllm", "--max-turns", "none"]
    config = _run_settings(parser.parse_args(argv), Counter)["config"]
    assert config["learning_rate"] == 1e-5 and config["use_vllm"] is True
    assert config["max_turns"] is None


# ---------------------------------------------------------------------- config file


def test_config_file_values_are_typed_like_options(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1e-5\nuse_vllm: yes\nmax_steps: 7\nreward: [m:f, n:g]\n")
    parser, _ = build_parser()
    settings = _run_settings(
        parser.parse_args(["run", "env:Counter", "--config", str(config)]), Counter
    )
    assert settings["config"]["learning_rate"] == 1e-5  # YAML reads `1e-5` as text
    assert settings["config"]["use_vllm"] is True and settings["config"]["max_steps"] == 7
    assert settings["reward"] == ["m:f", "n:g"]


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("learning_rate: abc", "learning_rate takes a number, not 'abc'"),
        ("max_steps: 1.5", "max_steps takes a whole number, not 1.5"),
        ("max_steps: -5", "max_steps takes -1 (train by epochs) or a whole number >= 1, not -5"),
        ("use_vllm: 3", "use_vllm takes true or false, not 3"),
        ("model: 5", "model takes text or none, not 5"),
        ("reward: [1]", "reward takes a list of texts, not 1"),
        ("learning_rate: .inf", f"learning_rate takes {FINITE}, not inf"),
        ("beta: .nan", f"beta takes {FINITE}, not nan"),
        ("temperature: 1e400", f"temperature takes {FINITE}, not '1e400'"),
        ("reward_weights: [1, .nan]", f"reward_weights takes {FINITE}"),
        ("env_args: [1, 2]", "env_args takes a JSON object or text or none, not [1, 2]"),
        ("env_args: '{\"a\": '", "env_args: --env-args takes a JSON object"),
    ],
)
def test_a_bad_config_file_value_names_the_file_and_the_key(user_error, tmp_path, line, expected):
    config = tmp_path / "run.yaml"
    config.write_text(line + "\n")
    message = user_error("run", "env:Counter", "--config", str(config))
    assert message.startswith(f"error: config file {config}: {expected}")


@pytest.mark.parametrize(
    ("option", "name", "what"),
    [
        ("--config", "run.yaml", "config file"),
        ("--chat-template", "t.jinja", "--chat-template file"),
    ],
)
def test_a_file_that_is_not_utf8_text_is_named(user_error, tmp_path, option, name, what):
    (tmp_path / name).write_bytes(b"\xff\xfe bad")
    message = user_error("run", "env:Counter", option, name)
    assert (
        message
        == f"error: {what} {name} is not UTF-8 text (byte 0: invalid start byte); save it as UTF-8"
    )


# ---------------------------------------------------------------------- model and output folder


@pytest.mark.parametrize("command", ["run", "eval"])
def test_a_model_folder_that_does_not_exist_is_named(user_error, tmp_path, command):
    (tmp_path / "runs").mkdir()
    for model in ("./missing", "runs/missing", str(tmp_path / "a" / "b")):
        message = user_error(command, "env:Counter", "--model", model)
        expected = (tmp_path / model).resolve()
        assert message == f"error: --model folder not found: {expected}"


def test_a_model_name_the_hub_cannot_provide_asks_for_a_local_folder(
    user_error, tmp_path, monkeypatch
):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for command in ("run", "eval"):
        message = user_error(command, "env:Counter", "--model", "no-such-model-xyz")
        assert f"there is no {tmp_path / 'no-such-model-xyz'}" in message
        assert "hub cannot be reached" in message and "pass a local model folder" in message


def test_a_model_path_that_is_not_a_model_folder(user_error, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"")
    assert "holds no config.json" in user_error("run", "env:Counter", "--model", "empty")
    assert "is a file" in user_error("eval", "env:Counter", "--model", "weights.bin")


def test_an_output_dir_that_is_a_file(user_error, tmp_path):
    (tmp_path / "notes.txt").write_text("")
    message = user_error("run", "env:Counter", "--output-dir", "notes.txt")
    assert message == (
        "error: --output-dir notes.txt is a file; name a folder (it is created if missing)"
    )
    inside = user_error("run", "env:Counter", "--output-dir", "notes.txt/run")
    assert "is inside notes.txt, a file" in inside


# ---------------------------------------------------------------------- eval's own options


@pytest.mark.parametrize(
    ("option", "text", "expected"),
    [
        ("--temperature", "abc", "takes a number, not 'abc'"),
        ("--temperature", "-1", "takes a number >= 0, not '-1'"),
        ("--num-episodes", "-1", "takes a whole number >= 1, not '-1'"),
        ("--num-episodes", "0", "takes a whole number >= 1, not '0'"),
        ("--max-turns", "0", "takes a whole number >= 1, not '0'"),
        ("--max-completion-length", "ten", "takes a whole number, not 'ten'"),
        ("--success-threshold", "high", "takes a number, not 'high'"),
        ("--seed", "1.5", "takes a whole number, not '1.5'"),
        ("--server-timeout", "0", "takes a number of seconds > 0, not '0'"),
    ],
)
def test_eval_options_name_the_option_and_the_value(user_error, option, text, expected):
    assert user_error("eval", "env:Counter", option, text) == f"error: {option} {expected}"


# ---------------------------------------------------------------------- argparse's own mistakes


def test_argparse_mistakes_are_error_lines_not_exits(user_error):
    assert user_error("run") == (
        "error: the following arguments are required: ENV; see `agentgrpo run --help`"
    )
    assert user_error("run", "env:Counter", "--model").startswith(
        "error: --model: expected one argument"
    )
    assert "invalid choice: 'rnu'" in user_error("rnu")


def test_parse_value_raises_a_usage_error():
    with pytest.raises(UsageError, match=r"^--beta takes a number, not 'abc'$"):
        parse_value("beta", "abc")


# ---------------------------------------------------------------------- the progress bar's line


def test_an_error_during_training_starts_on_a_line_of_its_own(
    tiny_model_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rewards.py").write_text(
        "def broken(completions, **kwargs):\n    raise RuntimeError('no reward today')\n"
    )
    status = main(
        [
            "run", "env:Counter", "--model", str(tiny_model_dir), "--reward", "rewards.py:broken",
            "--max-steps", "2", "--per-device-train-batch-size", "2", "--num-generations", "2",
            "--max-completion-length", "8", "--chat-template", "chatml_tools",
            "--output-dir", str(tmp_path / "out"),
        ]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2
    assert "0/2 [" in err  # the bar was drawn before the error
    lines = err.split("\n")
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("error: ") and "broken" in errors[0], err
