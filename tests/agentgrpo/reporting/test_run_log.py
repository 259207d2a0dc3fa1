"""What a run leaves for its user: the PNG chart, metrics.jsonl, episode samples, the summary."""

from __future__ import annotations

import json
from types import SimpleNamespace

from datasets import Dataset
from PIL import Image
from transformers import PrinterCallback, ProgressCallback, TrainerControl, TrainerState

from agentgrpo.reporting.plot import COLOURS, line_chart
from agentgrpo.reporting.run_log import (
    MetricsLog,
    ProgressBar,
    attach_run_callbacks,
    format_episode,
    read_metrics,
    summary_table,
)
from environments import Counter
from tests.support.episodes import scripted_episode, tool_call
from tests.support.trainer import short_run_config, tiny_trainer


def read_png(path) -> tuple[int, int, set[tuple[int, int, int]]]:
    """(width, height, the RGB colours in it) of a PNG file, read by Pillow."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        rgb = image.convert("RGB")
        return (
            rgb.width,
            rgb.height,
            {colour for _, colour in rgb.getcolors(rgb.width * rgb.height)},
        )


def rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))


def test_a_line_chart_is_a_png_of_the_size_asked_with_each_series_in_its_colour(tmp_path):
    path = tmp_path / "chart.png"
    series = {
        "reward": [(1, 0.1), (2, 0.4), (3, 0.9)],
        "tools/call_frequency": [(1, 1.0), (3, 0.5)],
    }
    line_chart(path, series, title="reward (%)", x_label="step", width=300, height=200)
    width, height, colours = read_png(path)
    assert (width, height) == (300, 200)
    assert {rgb(COLOURS[0]), rgb(COLOURS[1])} <= colours


def test_a_chart_is_deterministic(tmp_path):
    series = {"a": [(0, 0.0), (10, 2.5)]}
    line_chart(tmp_path / "1.png", series, title="t", x_label="x")
    line_chart(tmp_path / "2.png", series, title="t", x_label="x")
    assert (tmp_path / "1.png").read_bytes() == (tmp_path / "2.png").read_bytes()


def test_a_single_point_is_a_dot_and_an_empty_series_is_only_named(tmp_path):
    path = tmp_path / "chart.png"
    line_chart(path, {"one": [(5, 0.5)], "none": []}, title="t", x_label="x", y_range=(0, 1))
    assert rgb(COLOURS[0]) in read_png(path)[2]
    line_chart(path, {"none": [], "nan": [(1, float("nan"))]}, title="t", x_label="x")
    assert read_png(path)[:2] == (640, 400)


def test_an_episode_reads_as_text_with_tool_calls_and_results_marked(tokenizer):
    episode = scripted_episode(tokenizer, [tool_call("increment", step=3), "Done.\nBye."])
    text = format_episode(episode, 1.0)
    assert text.splitlines() == [
        "=== episode 0.0 | reward +1.000 | finish stop | turns 2 | tool calls 1 (0 failed)",
        "user: Make the counter reach 7.",
        "      The counter is at 0.",
        'assistant: [call increment {"step": 3}]',
        "[tool increment] -> 3",
        "assistant: Done.",
        "           Bye.",
    ]


def test_a_call_the_model_garbled_shows_the_raw_text_and_the_error(tokenizer):
    episode = scripted_episode(tokenizer, ["<tool_call>{oops</tool_call>", "Done."])
    text = format_episode(episode, 0.0)
    assert "(1 failed)" in text
    assert "assistant: <tool_call>{oops</tool_call>" in text
    assert "[tool error] -> Error: could not parse tool call" in text


def callback_args(tmp_path, step: int = 0):
    args = SimpleNamespace(output_dir=str(tmp_path), disable_tqdm=False)
    state = TrainerState(global_step=step, max_steps=3, epoch=0.0)
    return args, state, TrainerControl()


def test_metrics_log_appends_json_lines_and_charts_reward(tmp_path):
    log = MetricsLog()
    args, state, control = callback_args(tmp_path)
    log.on_train_begin(args, state, control)
    for step, reward in [(1, 0.25), (2, 1.5)]:
        state.global_step = step
        log.on_log(args, state, control, logs={"reward": reward, "tools/call_frequency": 0.5})
    log.on_train_end(args, state, control)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "epoch": 0.0, "reward": 0.25, "tools/call_frequency": 0.5},
        {"step": 2, "epoch": 0.0, "reward": 1.5, "tools/call_frequency": 0.5},
    ]
    assert {rgb(COLOURS[0]), rgb(COLOURS[1])} <= read_png(tmp_path / "reward.png")[2]


def test_a_resumed_run_keeps_the_log_up_to_its_checkpoint(tmp_path):
    lines = [{"step": s, "reward": 0.1 * s} for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    MetricsLog().on_train_begin(*callback_args(tmp_path, step=2))
    assert [e["step"] for e in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    MetricsLog().on_train_begin(*callback_args(tmp_path, step=0))  # a fresh run starts over
    assert read_metrics(tmp_path / "metrics.jsonl") == []


def test_the_progress_bar_shows_reward_tool_calls_and_step_time(tmp_path, capsys):
    bar = ProgressBar()
    args, state, control = callback_args(tmp_path)
    bar.on_train_begin(args, state, control)
    state.global_step = 1
    bar.on_step_end(args, state, control)
    logs = {"reward": 0.5, "tools/call_frequency": 1.25, "step_time": 2.0}
    bar.on_log(args, state, control, logs=logs)
    assert bar.bar.n == 1
    bar.on_train_end(args, state, control)
    assert "reward 0.500 | 1.25 calls/episode | 2.0 s/step" in capsys.readouterr().err


def test_the_summary_table_gives_first_last_and_best(tmp_path):
    entries = [
        {"step": 1, "reward": 0.2, "tools/call_frequency": 0.5, "tools/failure_frequency": 0.4},
        {"step": 2, "reward": 0.9, "tools/call_frequency": 1.0, "tools/failure_frequency": 0.1},
        {"step": 3, "reward": 0.6, "tools/call_frequency": 0.75, "tools/failure_frequency": 0.2},
        {"step": 3, "train_runtime": 125.0, "train_loss": 0.1},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    assert summary_table(path).splitlines() == [
        "metric                       first      last      best",
        "reward                         0.2       0.6       0.9",
        "tools/call_frequency           0.5      0.75         -",
        "tools/failure_frequency        0.4       0.2       0.1",
        "steps 3 | train time 2m 05s",
    ]


def test_a_run_with_the_run_callbacks_leaves_metrics_a_chart_and_episodes(tokenizer, tmp_path):
    episodes = dict(max_completion_length=12, max_turns=2, chat_template="chatml_tools")
    # GRPOConfig's own learning rate, and tqdm's bars on
    args = short_run_config(tmp_path, **episodes, learning_rate=1e-6, disable_tqdm=False)
    rows = Dataset.from_list([{"prompt": "Make the counter reach 3.", "target": 3}] * 8)
    trainer = tiny_trainer(tokenizer, args=args, train_dataset=rows, environment_factory=Counter)
    attach_run_callbacks(trainer)
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert not {ProgressCallback.__name__, PrinterCallback.__name__} & set(names)
    trainer.train()
    entries = read_metrics(tmp_path / "metrics.jsonl")
    assert [e["step"] for e in entries if "reward" in e] == [1, 2]
    assert "train_runtime" in entries[-1]
    samples = sorted(p.name for p in (tmp_path / "episodes").glob("*.txt"))
    assert samples == ["step-00001.txt", "step-00002.txt"]
    assert (tmp_path / "episodes" / "step-00002.txt").read_text().count("=== episode") == 4
    read_png(tmp_path / "reward.png")
    assert "steps 2" in summary_table(tmp_path / "metrics.jsonl")
