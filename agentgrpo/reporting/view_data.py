"""A run's output folder read as the plain JSON data that `agentgrpo view` shows.

Everything here returns dicts and lists of JSON values (str, int, float, bool, None): the page
embeds them or the viewer's server sends them as they are. A non-finite float (a NaN reward)
becomes its text, `"nan"`, since JSON has no such number.

The files are read while a run may still be writing them: text after the last newline of a
JSON-lines file is a line still being written and is left for the next read, never an error.
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from agentgrpo.reporting.run_log import EPISODES_DIR, IMAGES_DIR, METRICS_FILE, episode_file
from rollout.match import SEAT_COLUMN
from rollout.record import TAG, EpisodeRecord, encode_value, record_from_dict
from rollout.types import Episode, EpisodeRow, ToolCallRecord

_REWARD_MEAN = re.compile(r"rewards/(.+)/mean")
_FAILURE_KIND = re.compile(r"tools/failure_frequency/(.+)")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

Series = dict[str, list[tuple[float, float]]]


def check_run_folder(path: str | Path) -> Path:
    """`path` if it is a run's output folder (it holds `metrics.jsonl` or `episodes/`).

    Raises:
        FileNotFoundError: Nothing is at `path`.
        ValueError: `path` is a file, or a folder without a run's files (the message names
            the run folders directly inside it, if any).
    """
    folder = Path(path)
    if not folder.exists():
        raise FileNotFoundError(
            f"{folder} does not exist; give the output folder of a run (`agentgrpo run "
            "--output-dir`, runs/<Env>-<time>/ by default)"
        )
    if not folder.is_dir():
        raise ValueError(f"{folder} is a file; give the output folder of a run")
    if not _is_run(folder):
        inside = sorted(str(child) for child in folder.iterdir() if _is_run(child))
        hint = f"; the runs in it: {', '.join(inside[:5])}" if inside else ""
        raise ValueError(
            f"{folder} is not a run's output folder: it has neither {METRICS_FILE} nor "
            f"{EPISODES_DIR}/ (a run writes them at its first step){hint}"
        )
    return folder


def _is_run(folder: Path) -> bool:
    return (folder / METRICS_FILE).is_file() or (folder / EPISODES_DIR).is_dir()


def complete_lines(path: Path) -> list[str]:
    """The lines of a text file that end in a newline, without it; blank lines left out.

    Text after the last newline is a line still being written, so it is not returned.
    """
    text = path.read_text(encoding="utf-8", errors="replace")
    return [line for line in text.split("\n")[:-1] if line.strip()]


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The entries of a run's `metrics.jsonl` (none without the file), and what was skipped.

    A complete line that is not a JSON object is skipped, not an error: the charts show the
    rest. Each skipped line gets a note naming the file, the line and what is wrong with it.
    """
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return [], []
    entries, skipped = [], []
    for number, line in enumerate(complete_lines(path), 1):
        try:
            entries.append(_json_object(path, number, line))
        except ValueError as error:
            skipped.append(str(error))
    return entries, skipped


def read_step(run_dir: Path, step: int) -> tuple[list[EpisodeRecord], list[str]]:
    """The episode records of a step's `episodes/step-N.jsonl`, in file order, and what was skipped.

    A complete line that is not an episode record (not JSON, or not a record this version
    reads) is skipped, not an error: the page shows the rest. Each skipped line gets a note
    naming the file, the line and what is wrong with it.

    Raises:
        FileNotFoundError: The step has no record file.
    """
    path = episode_file(run_dir, step)
    records, skipped = [], []
    for number, line in enumerate(complete_lines(path), 1):
        try:
            records.append(record_from_dict(_json_object(path, number, line)))
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            skipped.append(_record_problem(path, number, error))
    return records, skipped


def _record_problem(path: Path, number: int, error: Exception) -> str:
    """The note for a line that is not a record; `_json_object`'s own text when it says why."""
    text = str(error)
    if text.startswith(f"{path}, line {number}: "):
        return text
    return f"{path}, line {number}: not an episode record ({text})"


def _json_object(path: Path, number: int, line: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError as error:
        raise ValueError(f"{path}, line {number}: not JSON ({error})") from error
    if not isinstance(value, dict):
        raise ValueError(f"{path}, line {number}: not a JSON object")
    return value


def file_key(path: Path) -> str | None:
    """A text that changes whenever the file does (its modified time and size); None if absent."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return f"{stat.st_mtime_ns}-{stat.st_size}"


# ---------------------------------------------------------------------- episodes


def number(value: float | None) -> float | str | None:
    """A float as JSON holds it: itself when finite, else its text.

    >>> number(0.5), number(float("nan")), number(float("-inf")), number(None)
    (0.5, 'nan', '-inf', None)
    """
    if value is None or math.isfinite(value):
        return value
    return repr(float(value))


def episode_view(record: EpisodeRecord) -> dict[str, Any]:
    """One episode as the page shows it.

    Keys: `process`, `group`, `index`, `policy_version`, `reward`, `advantage`, `rewards`
    (by function), `finish`, `error`, `turns`, `tool_calls` (a count), `tool_errors` (failed
    calls by kind, kinds that happened only), `calls` (each tool call: `name`, `arguments` as
    JSON text, `result`, `error`), `task` (the dataset row's columns other than the prompt, as
    JSON text) and `rows` (each training row's `prompt_ids`, `completion_ids`, `loss_mask`,
    `logprobs`: the sampler logprob to 4 significant digits where the mask is 1, else 0, and
    `versions`: each token's weights version, -1 where the mask is 0, or None when unrecorded),
    `row_kinds` (what started each row, `row_kinds`), `responses` (the environment's replies)
    and `seat` (the seat of a game the episode is one side of, `rollout.match`; else None).
    """
    episode = record.episode
    return {
        "process": record.process,
        "group": episode.group,
        "index": episode.index,
        "policy_version": record.policy_version,
        "reward": number(record.reward),
        "advantage": number(record.advantage),
        "rewards": {name: number(value) for name, value in record.rewards.items()},
        "finish": str(episode.finish),
        "error": episode.error,
        "turns": episode.stats.turns,
        "tool_calls": episode.stats.tool_calls,
        "tool_errors": {kind: n for kind, n in episode.stats.tool_errors.items() if n},
        "calls": [_call_view(call) for call in episode.tool_calls],
        "task": _json_text({k: v for k, v in episode.row.items() if k != "prompt"}),
        "rows": [_row_view(row) for row in episode.rows],
        "row_kinds": row_kinds(episode),
        "responses": episode.stats.responses,
        "seat": episode.row.get(SEAT_COLUMN),
    }


def row_kinds(episode: Episode) -> list[str]:
    """What started each row: the task (a seat's side of a game), a fork, a summary, a compaction.

    >>> from rollout import Compaction, EpisodeRow, EpisodeStats, Finish
    >>> rows = tuple(EpisodeRow([1], [2], [1], [0.0]) for _ in range(4))
    >>> stats = EpisodeStats(3, 0, {}, (Compaction(2, 900, 300, "summarize", 2, 3),))
    >>> row_kinds(Episode(rows, [], Finish.STOP, stats, {}, 0, 0))
    ['task', 'fork', 'summary request', 'compacted (summarize): 900 -> 300 tokens']
    """
    seat = episode.row.get(SEAT_COLUMN)
    kinds = [f"seat {seat}'s side" if seat is not None else "task"]
    kinds += ["fork"] * (len(episode.rows) - 1)
    for c in episode.stats.compactions:
        kinds[c.row] = f"compacted ({c.policy}): {c.tokens_before} -> {c.tokens_after} tokens"
        if c.rows == 2:
            kinds[c.row - 1] = "summary request"
    return kinds


def episode_images(record: EpisodeRecord, folder: Path) -> list[str]:
    """The pictures a vision-language model saw in the episode, as `data:` URLs, in order.

    The record names each picture's PNG file, relative to its own `folder`
    (`rollout.record.ImageFolder`). A file that is missing, over `_MAX_IMAGE_BYTES`, or not
    inside `folder`'s `images` folder (a record is data, not a path to follow anywhere) is left
    out.
    """
    root = (folder / IMAGES_DIR).resolve()
    urls = []
    for tag in _image_tags(record.episode.messages):
        path = (folder / str(tag.get("path", ""))).resolve()
        if path.parent != root or not path.is_file() or path.stat().st_size > _MAX_IMAGE_BYTES:
            continue
        urls.append("data:image/png;base64," + base64.b64encode(path.read_bytes()).decode())
    return urls


_MAX_IMAGE_BYTES = 4 << 20


def _image_tags(value: Any) -> list[Mapping[str, Any]]:
    """The image tags in a decoded record value (`rollout.record`), depth first."""
    if isinstance(value, Mapping):
        if value.get(TAG) == "image":
            return [value]
        return [tag for item in value.values() for tag in _image_tags(item)]
    if isinstance(value, list | tuple):
        return [tag for item in value for tag in _image_tags(item)]
    return []


def _call_view(call: ToolCallRecord) -> dict[str, Any]:
    return {
        "name": call.name,
        "arguments": _json_text(call.arguments),
        "result": call.result,
        "error": call.error,
    }


def _row_view(row: EpisodeRow) -> dict[str, Any]:
    logprobs = [
        number(float(f"{logprob:.4g}")) if mask else 0
        for logprob, mask in zip(row.sampler_logprobs, row.loss_mask, strict=True)
    ]
    return {
        "prompt_ids": list(row.prompt_ids),
        "completion_ids": list(row.completion_ids),
        "loss_mask": list(row.loss_mask),
        "logprobs": logprobs,
        "versions": None if row.policy_versions is None else list(row.policy_versions),
    }


def _json_text(value: Any) -> str:
    return json.dumps(encode_value(value), ensure_ascii=False)


def step_summary(episodes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """What a step's episodes (as `episode_view` gives them) add up to.

    `reward` and each function's entry in `rewards` are means over the episodes with a finite
    value (None when none has one); `finish` counts episodes by finish reason; `tool_errors`
    counts failed calls by kind; `sampled_tokens` counts mask-1 tokens, `completion_tokens` all
    completion tokens, over every row.

    >>> step_summary([
    ...     {"reward": 1.0, "rewards": {"f": 1.0}, "finish": "stop", "tool_calls": 2,
    ...      "tool_errors": {"parse": 1}, "rows": [{"loss_mask": [1, 0, 1]}]},
    ...     {"reward": "nan", "rewards": {"f": 0.0}, "finish": "length", "tool_calls": 1,
    ...      "tool_errors": {}, "rows": [{"loss_mask": [1]}]},
    ... ])["reward"]
    1.0
    """
    masks = [row["loss_mask"] for episode in episodes for row in episode["rows"]]
    errors: Counter[str] = Counter()
    for episode in episodes:
        errors.update(episode["tool_errors"])
    functions = dict.fromkeys(name for e in episodes for name in e["rewards"])
    return {
        "episodes": len(episodes),
        "reward": _mean(e["reward"] for e in episodes),
        "rewards": {name: _mean(e["rewards"].get(name) for e in episodes) for name in functions},
        "finish": dict(Counter(e["finish"] for e in episodes)),
        "tool_calls": sum(e["tool_calls"] for e in episodes),
        "failed_calls": sum(errors.values()),
        "tool_errors": dict(errors),
        "sampled_tokens": sum(sum(mask) for mask in masks),
        "completion_tokens": sum(len(mask) for mask in masks),
    }


def _mean(values: Iterable[Any]) -> float | None:
    finite = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


# ---------------------------------------------------------------------- charts


def chart_series(entries: Sequence[Mapping[str, Any]]) -> dict[str, Series]:
    """The curves of the page's three charts, by chart, from `metrics.jsonl` entries.

    - `reward`: `mean reward`, each reward function's mean when there are several, and
      `eval reward` when the run evaluated;
    - `tools`: `tool calls per episode` and `turns per episode`;
    - `failures`: `failed calls (share)` (failed calls over calls) and each kind of failure
      that happened at least once.

    Each curve is (step, value) points from the entries that hold a number under its metric.
    """
    keys = dict.fromkeys(key for entry in entries for key in entry)
    functions = [m[1] for key in keys if (m := _REWARD_MEAN.fullmatch(key))]
    reward = {"mean reward": _points(entries, "reward")}
    if len(functions) > 1:
        reward |= {name: _points(entries, f"rewards/{name}/mean") for name in functions}
    if "eval_reward" in keys:
        reward["eval reward"] = _points(entries, "eval_reward")
    failures = {"failed calls (share)": _points(entries, "tools/failure_frequency")}
    for key in keys:
        kind = _FAILURE_KIND.fullmatch(key)
        points = _points(entries, key)
        if kind and any(y for _, y in points):
            failures[kind[1]] = points
    return {
        "reward": reward,
        "tools": {
            "tool calls per episode": _points(entries, "tools/call_frequency"),
            "turns per episode": _points(entries, "turns/mean"),
        },
        "failures": failures,
    }


def _points(entries: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    return [
        (float(entry["step"]), float(entry[key]))
        for entry in entries
        if isinstance(entry.get(key), int | float) and isinstance(entry.get("step"), int | float)
    ]


# ---------------------------------------------------------------------- token texts


def find_tokenizer(run_dir: Path) -> Path | None:
    """The folder of the tokenizer a run saved: its final `model/`, else its latest checkpoint.

    None when the run has saved neither yet (a run saves its tokenizer with each checkpoint).
    """
    checkpoints = sorted(
        (p for p in run_dir.glob("checkpoint-*") if p.name.split("-", 1)[1].isdigit()),
        key=lambda p: int(p.name.split("-", 1)[1]),
        reverse=True,
    )
    for folder in [run_dir / "model", *checkpoints]:
        if any((folder / name).is_file() for name in _TOKENIZER_FILES):
            return folder
    return None


class TokenTexts:
    """Each token id's text, decoded on its own by a tokenizer (None: no tokenizer, no texts).

    A token that is part of a character (a byte of a multi-byte UTF-8 character) decodes to
    the replacement character; the page shows the id beside every token anyway.

    Attributes:
        note: What the page says about the token texts: where the tokenizer came from, or why
            there is none.
    """

    def __init__(self, tokenizer: Any | None, note: str):
        self.tokenizer = tokenizer
        self.note = note
        self._texts: dict[int, str] = {}

    @classmethod
    def load(cls, folder: Path) -> TokenTexts:
        """The texts of the tokenizer saved in `folder`; none, and a note why, if it fails."""
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError) as error:
            return cls(None, f"the tokenizer in {folder} does not load ({error}); tokens show ids")
        return cls(tokenizer, f"tokens decoded one by one with the tokenizer in {folder}")

    def of(self, ids: Iterable[int]) -> dict[str, str]:
        """Each distinct id's text, keyed by the id as text (JSON keys are text); {} without one."""
        if self.tokenizer is None:
            return {}
        texts = {}
        for token in ids:
            if token not in self._texts:
                self._texts[token] = self.tokenizer.decode(
                    [token], skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
            texts[str(token)] = self._texts[token]
        return texts


def episode_token_ids(episodes: Iterable[Mapping[str, Any]]) -> set[int]:
    """Every token id in the rows of episodes as `episode_view` gives them."""
    return {
        token
        for episode in episodes
        for row in episode["rows"]
        for token in (*row["prompt_ids"], *row["completion_ids"])
    }
