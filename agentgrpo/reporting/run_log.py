"""What a user sees during and after a run: a progress bar, a metrics log, a chart, sample episodes.

`attach_run_callbacks(trainer)` swaps transformers' progress and printer callbacks for these:

- `ProgressBar`: one tqdm bar over the optimizer steps, showing reward, tool calls per episode
  and seconds per step;
- `MetricsLog`: every log as a JSON line in `<output_dir>/metrics.jsonl`, and
  `<output_dir>/reward.png` charting mean reward and tool calls per episode against the step;
- `EpisodeSamples`: the latest round's first episodes as text in
  `<output_dir>/episodes/step-00010.txt`.

`EpisodeLog`, which `GRPOTrainer` adds itself (`log_episodes`), keeps every episode of every step
as data in `<output_dir>/episodes/step-00010.jsonl`; `read_episodes` reads them back.
`summary_table` turns `metrics.jsonl` into the table printed at the end of a run. Only the main
process writes anything. A write the output folder refuses (full disk, read-only file system, no
permission) stops the run with one `run_folder.OutputDirUnwritable` naming the folder and why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import time
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accelerate.utils import gather_object
from tqdm.auto import tqdm
from transformers import PrinterCallback, ProgressCallback, TrainerCallback
from transformers.trainer import DEFAULT_PROGRESS_CALLBACK

from agentgrpo.reporting.plot import line_chart
from agentgrpo.run_folder import explained_write_errors
from rollout import Episode, EpisodeRecord, read_records, record_line
from rollout.images import text_of
from rollout.record import ImageFolder

METRICS_FILE = "metrics.jsonl"
CHART_FILE = "reward.png"
EPISODES_DIR = "episodes"
IMAGES_DIR = "images"  # in the episodes folder: the PNG files the records name
_EPISODE_FILE = re.compile(r"step-(\d+)\.jsonl")
_CHARTED = {"reward": "mean reward", "tools/call_frequency": "tool calls per episode"}


def attach_run_callbacks(trainer: Any, per_step: int = 4) -> None:
    """Replace transformers' progress bar and log printer with this module's callbacks.

    The episode record (`EpisodeLog`) is not added here: the trainer writes it itself, unless
    `log_episodes` is off.

    Args:
        trainer: A `GRPOTrainer` (EpisodeSamples reads its `last_episodes`).
        per_step: How many of the latest round's episodes to write at each log.
    """
    for callback in (ProgressCallback, PrinterCallback, DEFAULT_PROGRESS_CALLBACK):
        trainer.remove_callback(callback)
    trainer.add_callback(ProgressBar())
    trainer.add_callback(MetricsLog())
    trainer.add_callback(EpisodeSamples(trainer, per_step=per_step))


# ---------------------------------------------------------------------- metrics.jsonl and chart


class MetricsLog(TrainerCallback):
    """Append each log to `<output_dir>/metrics.jsonl` and chart reward in `reward.png`.

    Each line is `{"step": global_step, "epoch": epoch, **logs}`, train and eval logs alike.
    A fresh run starts an empty log. A run resumed from a checkpoint appends to the history
    that led to it: the lines a killed run wrote after that checkpoint (and a last line the
    kill cut short) are dropped first, since training logs those steps again, so the log holds
    every step once. The file is rewritten only when a line must go, and then atomically, so a
    kill during the rewrite loses nothing.

    The chart plots `reward` and `tools/call_frequency` against the step on a 0..1 axis, widened
    if the values leave it. It is redrawn on a log at most every `chart_every_s` seconds (drawing is
    pure Python, a fraction of a second even for thousands of steps) and when training ends.
    """

    def __init__(self, chart_every_s: float = 30.0):
        self.chart_every_s = chart_every_s
        self._points: dict[str, list[tuple[float, float]]] = {name: [] for name in _CHARTED}
        self._charted_at: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        """Keep the log's lines up to the starting step, and read their points for the chart."""
        if not state.is_world_process_zero:
            return
        path = Path(args.output_dir) / METRICS_FILE
        text = path.read_text() if path.exists() else ""
        lines = text.splitlines()
        entries = [_entry(line) for line in lines]
        kept = [e for e in entries if e is not None and 0 < e["step"] <= state.global_step]
        if len(kept) < len(lines) or not text.endswith("\n"):  # also: a last line cut short
            _write_whole(args.output_dir, path, [json.dumps(entry) + "\n" for entry in kept])
        self._points = {name: [] for name in _CHARTED}
        for entry in kept:
            self._add_points(entry)

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Append the log as a line; redraw the chart if it is due."""
        if not state.is_world_process_zero or not logs:
            return
        entry = {"step": state.global_step, "epoch": state.epoch, **logs}
        path = Path(args.output_dir) / METRICS_FILE
        line = json.dumps(entry) + "\n"
        with explained_write_errors(args.output_dir):
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as file:
                file.write(line)
        self._add_points(entry)
        now = time.monotonic()
        if self._charted_at is None or now - self._charted_at >= self.chart_every_s:
            self._chart(Path(args.output_dir))

    def on_train_end(self, args, state, control, **kwargs):
        """Draw the final chart."""
        if state.is_world_process_zero:
            self._chart(Path(args.output_dir))

    def _add_points(self, entry: Mapping[str, Any]) -> None:
        for name, points in self._points.items():
            if isinstance(entry.get(name), int | float):
                points.append((float(entry["step"]), float(entry[name])))

    def _chart(self, output_dir: Path) -> None:
        values = [y for points in self._points.values() for _, y in points]
        with explained_write_errors(output_dir):
            line_chart(
                output_dir / CHART_FILE,
                {_CHARTED[name]: points for name, points in self._points.items()},
                title="reward and tool calls",
                x_label="step",
                y_range=(min([0.0, *values]), max([1.0, *values])),
            )
        self._charted_at = time.monotonic()


def _entry(line: str) -> dict[str, Any] | None:
    """A `metrics.jsonl` line's entry; None for a blank line or one cut short by a kill."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and "step" in entry else None


def read_metrics(log_path: str | Path) -> list[dict[str, Any]]:
    """The entries of a `metrics.jsonl`, in order (none if the file does not exist)."""
    path = Path(log_path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---------------------------------------------------------------------- episode samples


class EpisodeSamples(TrainerCallback):
    """At each train log after a new round, write its first episodes as readable text.

    The file is `<output_dir>/episodes/step-00010.txt` (the global step, five digits), holding
    `format_episode` of the first `per_step` of `trainer.last_episodes`: this process's share
    of the round, in group order, so one group's members are shown side by side. It is a
    readable view; `EpisodeLog` keeps every episode as data.
    """

    def __init__(self, trainer: Any, per_step: int = 4):
        self.trainer = trainer
        self.per_step = per_step

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Write the samples when the log carries a train round's metrics (`reward`)."""
        episodes = self.trainer.last_episodes[: self.per_step]
        if not state.is_world_process_zero or "reward" not in (logs or {}) or not episodes:
            return
        folder = Path(args.output_dir) / EPISODES_DIR
        text = "\n".join(format_episode(episode, reward) for episode, reward in episodes)
        with explained_write_errors(args.output_dir):
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"step-{state.global_step:05d}.txt").write_text(text)


class EpisodeLog(TrainerCallback):
    """Write each training round's episodes, as data, to `<output_dir>/episodes/step-00010.jsonl`.

    One `rollout.record` line per episode: token ids, loss mask, sampler logprobs, messages, tool
    calls with their results and error kinds, finish reason, per-function rewards, advantage and
    policy version. A round goes to the file of the first optimizer step it trains (the step
    after the trainer's `last_round_step`, when it was assembled); when a round serves several
    steps (`steps_per_generation` above `gradient_accumulation_steps`, or `num_iterations` > 1),
    the steps after it have no file.

    The file is written whole when that step ends, under a temporary name then renamed, so a
    crash loses at most the step in flight and never leaves half a file, and a resumed run that
    replays a step replaces the step's file instead of adding to it. At the start of training
    the files of steps after the starting step (left by a run in this folder that went further)
    are removed, as `MetricsLog` drops its lines; earlier steps' files are kept.

    In a multi-process run every process's lines are gathered to the main process, which writes
    one file per step: process 0's episodes, then process 1's, ... (`process` tells them apart;
    groups are numbered per process).
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        """Remove the files of steps after the starting step."""
        if state.is_world_process_zero:
            for step in recorded_steps(args.output_dir):
                if step > state.global_step:
                    with explained_write_errors(args.output_dir):
                        episode_file(args.output_dir, step).unlink()

    def on_step_end(self, args, state, control, **kwargs):
        """Write the round this step was the first to train, if it was."""
        records = self.trainer.last_records
        if not records or self.trainer.last_round_step + 1 != state.global_step:
            return
        folder = episode_file(args.output_dir, state.global_step).parent
        images = ImageFolder(folder / IMAGES_DIR, folder)
        lines = [record_line(record, images) for record in records]
        if args.world_size > 1:
            lines = gather_object(lines)
        if state.is_world_process_zero:
            _write_whole(args.output_dir, episode_file(args.output_dir, state.global_step), lines)


def episode_file(output_dir: str | Path, step: int) -> Path:
    """Where `EpisodeLog` writes the round first trained at `step`."""
    return Path(output_dir) / EPISODES_DIR / f"step-{step:05d}.jsonl"


def recorded_steps(output_dir: str | Path) -> list[int]:
    """The steps that have an episode record file in a run's output folder, in order."""
    folder = Path(output_dir) / EPISODES_DIR
    names = (p.name for p in folder.iterdir()) if folder.is_dir() else ()
    return sorted(int(m[1]) for name in names if (m := _EPISODE_FILE.fullmatch(name)))


def read_episodes(output_dir: str | Path, step: int) -> list[EpisodeRecord]:
    """The episodes of the round a run first trained at `step`, with their scores, as written.

    Each `EpisodeRecord` holds the `Episode` (equal to the one trained on; its `environment`
    is None), its per-function rewards, combined reward, advantage and policy version.

    Raises:
        FileNotFoundError: The run recorded no round at that step; names the steps it did.
    """
    path = episode_file(output_dir, step)
    if not path.exists():
        steps = recorded_steps(output_dir)
        raise FileNotFoundError(
            f"no episodes recorded for step {step} in {path.parent}; steps with episodes: "
            f"{', '.join(map(str, steps)) or 'none'}"
        )
    return read_records(path)


def _write_whole(output_dir: str | Path, path: Path, lines: list[str]) -> None:
    """Write the file at once: to `<name>.tmp`, then renamed over `path`.

    Raises:
        OutputDirUnwritable: The run's `output_dir` refuses the write (the message names it
            and why); the temporary file is removed and `path` left as it was.
    """
    temporary = path.with_name(path.name + ".tmp")
    with explained_write_errors(output_dir):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary.write_text("".join(lines), encoding="ascii")
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise


def format_episode(episode: Episode, reward: float) -> str:
    """An episode as text: a header line, then each message labelled by its role.

    The header gives the reward, why the episode ended, the model turns and the tool calls.
    Tool calls read `[call name {"arg": 1}]`, tool results `[tool name] -> result`; text over
    several lines is indented under its label.
    """
    stats = episode.stats
    header = (
        f"=== episode {episode.group}.{episode.index} | reward {reward:+.3f} | "
        f"finish {episode.finish} | turns {stats.turns} | "
        f"tool calls {stats.tool_calls} ({stats.tool_failures} failed)"
    )
    lines = [header, *(format_message(m) for m in episode.messages)]
    if episode.error:
        lines.append(f"error: {episode.error}")
    return "\n".join(lines) + "\n"


def format_message(message: Mapping[str, Any]) -> str:
    """A chat message as `role: text`, its tool calls as `[call ...]`, a tool result as `[tool]`.

    Content parts are shown as their text, each image as `[image]`.
    """
    role, content = message.get("role", "?"), _content_text(message.get("content") or "")
    if role == "tool":
        return _labelled(f"[tool {message.get('name', '?')}] ->", content)
    calls = [_format_call(call) for call in message.get("tool_calls") or []]
    return _labelled(f"{role}:", "\n".join([content, *calls] if content else calls))


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(
        "[image]" if part.get("type") == "image" else text_of([part]) for part in content
    )


def _format_call(call: Mapping[str, Any]) -> str:
    """`[call name {...}]` from an OpenAI-style call (`{"function": {...}}`) or a bare one."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments)
    return f"[call {function.get('name', '?')} {arguments}]"


def _labelled(label: str, text: str) -> str:
    """`label text`, with the text's later lines indented to line up under its first."""
    indent = "\n" + " " * (len(label) + 1)
    return f"{label} {indent.join(text.splitlines())}".rstrip()


# ---------------------------------------------------------------------- progress bar


_OPEN_BARS: weakref.WeakSet[tqdm] = weakref.WeakSet()
"""Bars `ProgressBar` opened and has not closed: a run that raised leaves its bar here."""


def end_progress_line() -> None:
    """Close the open progress bars, ending their line, so what is printed next starts afresh.

    A run that raises never reaches `on_train_end`; its bar's line has no newline yet.
    """
    for bar in list(_OPEN_BARS):
        bar.close()
        _OPEN_BARS.discard(bar)


class ProgressBar(TrainerCallback):
    """A tqdm bar over `max_steps`, its postfix showing reward, tool calls per episode and s/step.

    Seconds per step come from the trainer's `step_time` metric when logged, else from the wall
    time between steps. Off a terminal (CI logs), the postfix waits for the bar's next redraw
    instead of forcing one, so the log gets fewer lines. `disable_tqdm` turns the bar off.
    If training raises, `end_progress_line()` closes the bar before the error is printed.
    """

    def __init__(self):
        self.bar: tqdm | None = None
        self._step_ended_at: float | None = None
        self._wall_s_per_step: float | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        """Open the bar at the starting step (non-zero when resuming)."""
        if state.is_world_process_zero:
            self.bar = tqdm(
                total=state.max_steps,
                initial=state.global_step,
                unit="step",
                dynamic_ncols=True,
                disable=args.disable_tqdm,
            )
            _OPEN_BARS.add(self.bar)

    def on_step_end(self, args, state, control, **kwargs):
        """Advance to the global step and time it."""
        if self.bar is None:
            return
        now = time.monotonic()
        if self._step_ended_at is not None:
            self._wall_s_per_step = now - self._step_ended_at
        self._step_ended_at = now
        self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Show the log's reward, tool calls per episode and step time."""
        if self.bar is None or not logs or not isinstance(logs.get("reward"), int | float):
            return  # not a round's log, or one whose rewards were all None
        postfix = progress_postfix(logs, self._wall_s_per_step)
        self.bar.set_postfix_str(postfix, refresh=_on_terminal(self.bar))

    def on_train_end(self, args, state, control, **kwargs):
        """Close the bar."""
        if self.bar is not None:
            self.bar.close()
            _OPEN_BARS.discard(self.bar)
            self.bar = None


def progress_postfix(logs: Mapping[str, Any], wall_s_per_step: float | None = None) -> str:
    """The bar's postfix for a train log.

    >>> progress_postfix({"reward": 0.5, "tools/call_frequency": 1.25, "step_time": 3.21})
    'reward 0.500 | 1.25 calls/episode | 3.2 s/step'
    >>> progress_postfix({"reward": -1.0}, wall_s_per_step=0.5)
    'reward -1.000 | 0.5 s/step'
    """
    parts = [f"reward {logs['reward']:.3f}"]
    if "tools/call_frequency" in logs:
        parts.append(f"{logs['tools/call_frequency']:.2f} calls/episode")
    seconds = logs.get("step_time", wall_s_per_step)
    if seconds is not None:
        parts.append(f"{seconds:.1f} s/step")
    return " | ".join(parts)


def _on_terminal(bar: tqdm) -> bool:
    stream = getattr(bar, "fp", None) or sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


# ---------------------------------------------------------------------- end-of-run summary

# metric -> which end is better (max or min); None: neither, the best column stays empty.
_SUMMARY_METRICS = {
    "reward": max,
    "eval_reward": max,
    "tools/call_frequency": None,
    "tools/failure_frequency": min,
    "turns/mean": None,
    "completions/mean_length": None,
}


def summary_table(log_path: str | Path) -> str:
    """A fixed-width table of a run's key metrics, read from its `metrics.jsonl`.

    One row per metric that was logged (reward, eval_reward, tools/call_frequency,
    tools/failure_frequency, turns/mean, completions/mean_length): its first and last logged
    value and the best (highest reward, lowest failure frequency; "-" where neither end is
    better). Then the last step and, when the final log holds it, the total train time.
    """
    entries = read_metrics(log_path)
    lines = [f"{'metric':<24}{'first':>10}{'last':>10}{'best':>10}"]
    for name, best in _SUMMARY_METRICS.items():
        values = [e[name] for e in entries if isinstance(e.get(name), int | float)]
        if values:
            best_text = f"{best(values):>10.4g}" if best else f"{'-':>10}"
            lines.append(f"{name:<24}{values[0]:>10.4g}{values[-1]:>10.4g}{best_text}")
    steps = max((e.get("step", 0) for e in entries), default=0)
    footer = f"steps {steps}"
    runtimes = [e["train_runtime"] for e in entries if "train_runtime" in e]
    if runtimes:
        footer += f" | train time {_duration(runtimes[-1])}"
    return "\n".join([*lines, footer])


def _duration(seconds: float) -> str:
    """Seconds for a reader.

    >>> _duration(42.31), _duration(125), _duration(3725)
    ('42.3 s', '2m 05s', '1h 02m 05s')
    """
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s"
