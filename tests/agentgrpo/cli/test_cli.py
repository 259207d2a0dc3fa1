"""The `agentgrpo` command: real subprocesses, the tiny model end to end, and every user error."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentgrpo.cli import main
from agentgrpo.cli.commands import _run_settings
from agentgrpo.cli.options import RUN_DEFAULTS
from environments import Counter
from tests.support.cli import agentgrpo, agentgrpo_here, eval_figures, tiny_run


def test_envs_lists_every_builtin_with_one_line_each_then_the_environment_sources():
    result = agentgrpo_here("envs")
    assert result.returncode == 0, result.stderr
    builtins, installed, sources = result.stdout.strip().split("\n\n")
    assert installed.startswith("installed environment packages")  # test_init_command's
    lines = builtins.splitlines()
    assert [line.split()[0] for line in lines] == [
        "env:Counter",
        "env:Arithmetic",
        "env:GuessNumber",
        "env:Chain",
        "env:ColourSquare",
        "env:Trail",
        "env:Questions",
        "env:TicTacToe",
    ]
    assert all(len(line.split()) > 2 for line in lines)
    forms = [line.split()[0] for line in sources.splitlines()[1:]]
    expected = (
        "env:Name",
        "package.module:Class",
        "path/file.py:Class",
        "gym:ENV_ID",
        "openenv:module:Class",
    )
    for form in expected:
        assert form in forms
    assert "gym:FrozenLake-v1" in sources
    assert "rg:TASK" in sources  # reasoning-gym's tasks, or how to install them


def test_run_help_documents_every_option():
    result = agentgrpo_here("run", "--help")
    assert result.returncode == 0
    for option in ("--model", "--config", "--dataset", "--reward", "--max-steps", "--use-vllm"):
        assert option in result.stdout
    assert "--warm-start-steps" in result.stdout and "--num-generations" in result.stdout


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "run" in capsys.readouterr().out


@pytest.mark.process
def test_python_dash_m_and_the_console_script_agree():
    script = Path(sys.executable).with_name("agentgrpo")
    if not script.exists():
        pytest.skip("the console script is not installed next to this python")
    direct = subprocess.run([str(script), "envs"], capture_output=True, text=True, timeout=120)
    assert direct.returncode == 0 and direct.stdout == agentgrpo("envs").stdout


# ---------------------------------------------------------------------- user errors


def test_unknown_environment_suggests_the_nearest(user_error):
    assert "did you mean 'Counter'" in user_error("run", "env:Countr")


def test_unknown_option_suggests_the_nearest(user_error):
    message = user_error("run", "env:Counter", "--lerning-rate", "1e-5")
    assert "--lerning-rate" in message and "did you mean --learning-rate" in message


def test_bad_option_value_names_the_option(user_error):
    assert "--use-vllm takes true or false" in user_error("run", "env:Counter", "--use-vllm", "x")
    message = user_error("run", "env:Counter", "--num-generations", "1")
    assert "num_generations" in message


def test_unknown_config_key_suggests_the_nearest(user_error, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("learning_rat: 1.0e-5\n")
    message = user_error("run", "env:Counter", "--config", str(config))
    assert "learning_rat" in message and "did you mean learning_rate" in message


def test_class_without_reset(user_error, tmp_path):
    (tmp_path / "envs.py").write_text(
        "class NoReset:\n    def act(self) -> str:\n        return ''\n"
    )
    assert "no reset() method" in user_error("run", "envs.py:NoReset")


def test_tool_without_type_hints_or_docstring(user_error, tmp_path):
    (tmp_path / "envs.py").write_text(
        textwrap.dedent(
            """
            class Untyped:
                def reset(self, **row):
                    return None

                def act(self, value):
                    return value
            """
        )
    )
    message = user_error("run", "envs.py:Untyped")
    assert "act" in message and ("type hint" in message or "docstring" in message)


def test_missing_dataset(user_error, tmp_path):
    (tmp_path / "envs.py").write_text(
        "class NoRows:\n    def reset(self, **row):\n        return 'Say hi.'\n"
        "    def reward(self) -> float:\n        return 0.0\n"
    )
    message = user_error("eval", "envs.py:NoRows")
    assert "no dataset()" in message and "--dataset" in message
    missing = user_error("run", "env:Counter", "--dataset", str(tmp_path / "nope.jsonl"))
    assert "not found" in missing


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        ("None", "Rows.dataset() returned NoneType; return a datasets.Dataset or a list of dicts"),
        ("(r for r in [{'n': 1}])", "Rows.dataset() returned generator; return"),
        (
            "datasets.DatasetDict(train=datasets.Dataset.from_list([{'n': 1}]))",
            "Rows.dataset() returned a DatasetDict of the splits ['train']; return one split",
        ),
    ],
)
def test_a_dataset_method_returning_something_else_than_rows_is_named(
    user_error, tmp_path, returned, expected
):
    (tmp_path / "envs.py").write_text(
        "import datasets\n\nclass Rows:\n    def reset(self, **row):\n        return 'Hi.'\n"
        "    def reward(self) -> float:\n        return 0.0\n"
        f"    @classmethod\n    def dataset(cls, split='train'):\n        return {returned}\n"
    )
    assert expected in user_error("eval", "envs.py:Rows")


def write_rows_environment(folder: Path, dataset: str) -> None:
    """`folder/envs.py` with class `Rows`, a Counter whose `dataset` body is `dataset`."""
    (folder / "envs.py").write_text(
        "import datasets\nfrom environments import Counter\n\nclass Rows(Counter):\n"
        f"    @classmethod\n{textwrap.indent(textwrap.dedent(dataset), '    ')}"
    )


LISTED = """\
def dataset(cls, split='train'):
    rows = [{'prompt': [{'role': 'user', 'content': 'Reach 3.'}], 'target': 3} for _ in range(4)]
    return [rows[0], *({**row, 'level': n} for n, row in enumerate(rows[1:]))]
"""


@pytest.mark.parametrize("cut", [["--num-episodes", "2"], ["--dataset-size", "2"]])
def test_rows_given_as_a_list_of_dicts_are_cut_to_the_episodes_asked_for(
    tiny_model_dir, tmp_path, monkeypatch, capsys, cut
):
    monkeypatch.chdir(tmp_path)
    write_rows_environment(tmp_path, LISTED)
    status = main(
        ["eval", "envs.py:Rows", "--model", str(tiny_model_dir), "--chat-template",
         "chatml_tools", "--max-completion-length", "8", *cut]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    assert "(2 rows, split 'eval'," in out and eval_figures(out)["episodes"] == "2"


def test_run_cuts_a_list_of_dicts_to_dataset_size_keeping_each_row_as_written(tmp_path):
    from agentgrpo.cli import sources
    from environments import resolve_environment

    write_rows_environment(tmp_path, LISTED)
    source = resolve_environment(f"{tmp_path / 'envs.py'}:Rows")
    rows = sources.rows(source, None, "train", 3)
    assert rows == source.dataset()[:3]  # not a datasets.Dataset: no key filled, none dropped


def test_a_dataset_method_that_takes_no_split_is_not_said_to_give_one(
    tiny_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    write_rows_environment(tmp_path, LISTED.replace("cls, split='train'", "cls"))
    status = main(
        ["eval", "envs.py:Rows", "--model", str(tiny_model_dir), "--chat-template",
         "chatml_tools", "--max-completion-length", "8", "--num-episodes", "1"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    assert "(1 rows, no split: Rows's dataset() takes none," in out and "'eval'" not in out


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("return {'train': []}[split]", "raised KeyError: 'eval'"),
        ("raise RuntimeError('cannot reach the data server')", "raised RuntimeError: cannot reach"),
        ("raise ValueError(f'unknown split {split}')", "raised ValueError: unknown split eval"),
    ],
)
def test_a_dataset_method_that_raises_is_named_as_called_with_its_error(
    user_error, tmp_path, body, expected
):
    write_rows_environment(tmp_path, f"def dataset(cls, split='train'):\n    {body}\n")
    message = user_error("eval", "envs.py:Rows")
    assert message.startswith(f"error: Rows.dataset(split='eval') {expected}")
    assert "--dataset FILE.jsonl" in message


@pytest.mark.parametrize("empty", ["[]", "datasets.Dataset.from_dict({'prompt': []})"])
def test_a_dataset_method_that_returns_no_rows_is_refused_naming_the_split(
    user_error, tmp_path, tiny_model_dir, empty
):
    write_rows_environment(tmp_path, f"def dataset(cls, split='train'):\n    return {empty}\n")
    message = user_error("eval", "envs.py:Rows", "--model", str(tiny_model_dir))
    assert message.startswith("error: Rows.dataset(split='eval') returned no rows; return at")


def test_unknown_reward_function(user_error):
    assert "did you mean" in user_error(
        "eval", "env:Counter", "--reward", "agentgrpo.rewards:acuracy_reward"
    )


def test_eval_against_a_server_that_does_not_answer(user_error, tiny_model_dir):
    message = user_error(
        "eval", "env:Counter", "--model", str(tiny_model_dir),
        "--server-url", "http://127.0.0.1:9", "--server-timeout", "1",
    )  # fmt: skip
    assert "http://127.0.0.1:9" in message


# ---------------------------------------------------------------------- options


def test_settings_merge_command_line_over_file_over_defaults(tmp_path):
    from agentgrpo.cli import build_parser

    config = tmp_path / "run.yaml"
    config.write_text("learning_rate: 1.0e-4\nmax_steps: 7\nmodel: some/model\nreward: m:f\n")
    parser, _ = build_parser()
    argv = ["run", "env:Counter", "--config", str(config), "--max-steps", "3", "--use-vllm"]
    settings = _run_settings(parser.parse_args(argv), Counter)
    config_fields = settings["config"]
    assert config_fields["max_steps"] == 3  # command line beats the file
    assert config_fields["learning_rate"] == 1e-4  # the file beats the run defaults
    assert config_fields["num_generations"] == RUN_DEFAULTS["num_generations"]
    assert config_fields["use_vllm"] is True
    assert settings["model"] == "some/model" and settings["reward"] == ["m:f"]
    assert "warm_start_steps" not in config_fields  # a model of the user's own: no warm start
    default = _run_settings(parser.parse_args(["run", "env:Counter"]), Counter)
    assert default["config"]["chat_template"] == "chatml_tools"
    assert default["config"]["warm_start_steps"] > 0  # Counter has demonstrations()
    assert default["config"]["save_warm_start"] is True  # to evaluate it beside the result
    assert config_fields["save_warm_start"] is False  # no warm start, nothing to save


def test_run_reads_a_chat_template_file_as_doctor_does(tmp_path, monkeypatch):
    from agentgrpo.cli import build_parser

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    parser, _ = build_parser()
    argv = ["run", "env:Counter", "--chat-template", "mine.jinja"]
    settings = _run_settings(parser.parse_args(argv), Counter)
    assert settings["config"]["chat_template"] == (tmp_path / "mine.jinja").read_text()


def test_long_episodes_turn_gradient_checkpointing_on_unless_told_otherwise():
    from agentgrpo.cli import build_parser
    from environments import resolve_environment

    parser, _ = build_parser()
    frozen_lake = resolve_environment("gym:FrozenLake-v1")  # 1,420 tokens an episode
    settings = [
        _run_settings(parser.parse_args(argv), source)["config"]["gradient_checkpointing"]
        for argv, source in [
            (["run", "env:Counter"], Counter),  # 8 x 64 tokens
            (["run", "x", "--max-completion-length", "513"], Counter),  # 8 x 513 > 4096
            (["run", "x", "--max-completion-length", "512"], Counter),
            (["run", "gym:FrozenLake-v1"], frozen_lake),
            (["run", "x", "--gradient-checkpointing", "false"], frozen_lake),
            (["run", "x", "--gradient-checkpointing", "true"], Counter),
        ]
    ]
    assert settings == [False, True, False, True, False, True]


# ---------------------------------------------------------------------- end to end


def test_run_then_eval_on_the_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    result = tiny_run(
        "env:Counter", tiny_model_dir, out,
        "--max-steps", "2", "--per-device-train-batch-size", "4", "--num-generations", "2",
        "--max-completion-length", "24", "--warm-start-steps", "2", "--save-steps", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warm start 2/2" in result.stdout
    assert "environment  env:Counter (320 rows)" in result.stdout
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [entry for entry in logged if "reward" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    assert all("tools/call_frequency" in entry for entry in steps)
    assert (out / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (out / "episodes").iterdir())
    assert (out / "checkpoint-2").is_dir() and (out / "model" / "config.json").is_file()
    assert f"warm start   2 steps, saved to {out / 'warm_start'}" in result.stdout
    assert (out / "warm_start" / "config.json").is_file()
    assert f"the warm start alone: agentgrpo eval env:Counter --model {out / 'warm_start'}" in (
        result.stdout
    )
    saved_template = json.loads((out / "model" / "tokenizer_config.json").read_text())
    assert (
        "tool_call" in str(saved_template.get("chat_template", ""))
        or (out / "model" / "chat_template.jinja").is_file()
    )

    episodes_file = tmp_path / "eval.txt"
    result = agentgrpo_here(
        "eval", "env:Counter", "--model", str(out / "model"), "--num-episodes", "4",
        "--max-completion-length", "24", "--episodes-file", str(episodes_file),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    figures = eval_figures(result.stdout)
    assert figures["episodes"] == "4"
    for name in ("success_rate", "mean_reward", "tool_call_rate", "tool_error_rate", "mean_turns"):
        assert 0.0 <= float(figures[name]) <= 2.0
    assert float(figures["tool_calls"]) >= float(figures["tool_call_rate"])  # >= 1 where any
    assert episodes_file.read_text().count("reward") >= 4


@pytest.mark.slow
@pytest.mark.process
def test_default_run_on_smollm2(tmp_path, smollm2_path):
    """The main job as a user runs it, cut to a few steps: the embedded model, its warm start."""
    out = tmp_path / "run"
    result = agentgrpo(
        "run", "env:Counter", "--max-steps", "1", "--warm-start-steps", "4",
        "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "model        the embedded SmolLM2-135M-Instruct" in result.stdout
    assert "warm start 4/4" in result.stdout
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged if "reward" in entry] == [1]
    assert (out / "model" / "model.safetensors").is_file()
    # Nothing of DeepSpeed or vLLM runs here, so neither says a word (accelerate imports
    # DeepSpeed, whose accelerator guess warned on every CPU run).
    said = (result.stdout + result.stderr).lower()
    assert "deepspeed" not in said and "vllm" not in said and "accelerator" not in said
