"""The completions table of `log_completions`: the latest round, one row per completion.

Its columns are TRL's: `step`, `prompt`, `completion` (as the reward functions saw them: text,
or lists of messages), one column of raw rewards per reward function, the columns reward
functions added with `log_extra`, and `advantage`. At each log the trainer prints it (a rich
panel when `rich` is installed, else a plain text table; `num_completions_to_print` rows drawn
at random, all by default) and hands it as a table to the `report_to` integrations that take
tables (wandb, trackio), as a pandas DataFrame.
"""

from __future__ import annotations

import importlib.util
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentgrpo.reporting.run_log import format_message

_PLAIN_CELL_CHARS = 40
_TABLE_INTEGRATIONS = ("wandb", "trackio")


@dataclass(frozen=True)
class CompletionsTable:
    """The rows of one round, every process's, in episode order.

    Attributes:
        step: The global step the table is logged at.
        prompts: One prompt per completion.
        completions: The completions.
        rewards: Reward function name to one raw reward per completion (NaN: not applicable).
        advantages: One advantage per completion.
        extra: `log_extra` column name to one value per completion (None where not logged).
    """

    step: int
    prompts: Sequence[Any]
    completions: Sequence[Any]
    rewards: Mapping[str, Sequence[float]]
    advantages: Sequence[float]
    extra: Mapping[str, Sequence[Any]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    def columns(self) -> dict[str, list[Any]]:
        """TRL's table: step, prompt, completion, each reward, each extra column, advantage."""
        return {
            "step": [self.step] * len(self),
            "prompt": list(self.prompts),
            "completion": list(self.completions),
            **{name: list(values) for name, values in self.rewards.items()},
            **{name: list(values) for name, values in self.extra.items()},
            "advantage": list(self.advantages),
        }

    def frame(self, unique_prompts: bool = False) -> Any:
        """`columns()` as a pandas DataFrame; with `unique_prompts`, each prompt's first row."""
        import pandas as pd

        frame = pd.DataFrame(self.columns())
        if unique_prompts:
            frame = frame[~frame["prompt"].astype(str).duplicated()]
        return frame

    def rows(self, count: int | None = None) -> list[int]:
        """The indices of the rows to print, in order.

        All of them when `count` is None or at least the table's length, none when `count` <= 0,
        else `count` drawn at random (seeded by the step, so a run is reproducible).
        """
        if count is None or count >= len(self):
            return list(range(len(self)))
        if count <= 0:
            return []
        return sorted(random.Random(self.step).sample(range(len(self)), count))


def print_table(table: CompletionsTable, count: int | None = None) -> None:
    """Print `table.rows(count)`: a rich panel if `rich` is installed, else plain text."""
    indices = table.rows(count)
    if not indices:
        return
    if importlib.util.find_spec("rich") is not None:
        _print_rich(table, indices)
    else:
        print(plain_table(table, indices))


def _headers(table: CompletionsTable) -> list[str]:
    """The printed columns, in TRL's console order (advantage before the extra columns)."""
    return ["Prompt", "Completion", *table.rewards, "Advantage", *table.extra]


def _cells(table: CompletionsTable, i: int) -> list[str]:
    rewards = [f"{values[i]:.2f}" for values in table.rewards.values()]
    extra = [cell_text(values[i]) for values in table.extra.values()]
    prompt, completion = cell_text(table.prompts[i]), cell_text(table.completions[i])
    return [prompt, completion, *rewards, f"{table.advantages[i]:.2f}", *extra]


def cell_text(value: Any) -> str:
    r"""A prompt, completion or extra value as text: messages one per line, by role.

    >>> cell_text([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}])
    'user: Hi\nassistant: Yo'
    >>> cell_text(0.5)
    '0.5'
    """
    if isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
        return "\n".join(format_message(message) for message in value)
    return str(value)


def plain_table(table: CompletionsTable, indices: Sequence[int]) -> str:
    """The rows as a fixed-width text table, each cell on one line and cut to 40 characters."""
    grid = [_headers(table)] + [[_one_line(c) for c in _cells(table, i)] for i in indices]
    widths = [max(len(row[k]) for row in grid) for k in range(len(grid[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in grid]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join([f"Step {table.step}", *(line.rstrip() for line in lines)])


def _one_line(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _PLAIN_CELL_CHARS else text[: _PLAIN_CELL_CHARS - 3] + "..."


def _print_rich(table: CompletionsTable, indices: Sequence[int]) -> None:
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    shown = Table(show_header=True, expand=True)
    numbers = {*table.rewards, "Advantage"}
    for header in _headers(table):
        shown.add_column(header, justify="right" if header in numbers else "left")
    for i in indices:
        shown.add_row(*(Text(cell) for cell in _cells(table, i)))  # text, not rich markup
        shown.add_section()
    Console().print(Panel(shown, expand=False, title=f"Step {table.step}"))


def table_integrations(report_to: Sequence[str] | str | None) -> list[Any]:
    """The installed, active `report_to` integrations that log tables: wandb (with a run), trackio.

    Each is the imported module, with `Table(dataframe=...)` and `log({...})`.
    """
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    backends = []
    for name in _TABLE_INTEGRATIONS:
        if name in names and importlib.util.find_spec(name) is not None:
            module = importlib.import_module(name)
            if name != "wandb" or getattr(module, "run", None) is not None:
                backends.append(module)
    return backends


def log_to_integrations(
    table: CompletionsTable, report_to: Sequence[str] | str | None, unique_prompts: bool
) -> None:
    """Log the table as `completions` to each of `table_integrations(report_to)`.

    With it goes `train/global_step`, the key transformers' callbacks log each step's metrics
    under: a tracker numbers its log calls itself (trackio 0, 1, 2, ...), so this key is what
    ties the table to the metrics of its step.
    """
    backends = table_integrations(report_to)
    if backends:
        frame = table.frame(unique_prompts)
        for backend in backends:
            backend.log(
                {"completions": backend.Table(dataframe=frame), "train/global_step": table.step}
            )
