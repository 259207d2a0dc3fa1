"""`agentgrpo view`'s page over a run's output folder: one self-contained HTML file.

`RunView(run_dir)` reads the folder as the run writes it (`view_data`) and gives:

- `page(live)`: the HTML page, its CSS, script, charts and data inline (nothing is fetched from
  the network). Static (`live=False`, `agentgrpo view --html`), it embeds every recorded step;
  live, served by `view_server`, it embeds none and asks the server for each step it shows,
  and for `index` every few seconds to follow a run in progress;
- `index(metrics_key)`: the recorded steps with a key that changes when a step's file does,
  a note on the metrics (none yet, or lines skipped) and the charts when `metrics.jsonl`
  changed since `metrics_key`;
- `step(n)`: one step's episodes (with the pictures a vision-language model saw, inline),
  their summary, a note on lines skipped and the text of their tokens.

The charts are matplotlib SVG (`plot.line_chart_svg`): reward, tool calls and turns per episode,
and failed tool calls by kind, by step. Steps and charts are cached until their file changes.
A `RunView` may be used from several threads.
"""

from __future__ import annotations

import html
import json
import re
import threading
from importlib import resources
from pathlib import Path
from typing import Any

from agentgrpo.reporting import view_data
from agentgrpo.reporting.plot import line_chart_svg
from agentgrpo.reporting.run_log import METRICS_FILE, episode_file, recorded_steps
from rollout.types import Finish

CHART_TITLES = {
    "reward": "reward",
    "tools": "tool calls and turns per episode",
    "failures": "failed tool calls (share of calls)",
}
"""The page's charts, by the name `view_data.chart_series` gives their curves."""

_CHART_WIDTH, _CHART_HEIGHT = 520, 300  # pixels; the page scales them to fit


class RunView:
    """A run's output folder as the page's data, re-read when its files change.

    Args:
        run_dir: The run's output folder (checked with `view_data.check_run_folder`).
        tokenizer: A folder holding the tokenizer to show token texts with; None: the one the
            run saved (`model/`, else its latest checkpoint), looked for again until found.
    """

    def __init__(self, run_dir: str | Path, tokenizer: str | Path | None = None):
        self.run_dir = view_data.check_run_folder(run_dir)
        self._lock = threading.Lock()
        self._steps: dict[int, tuple[str | None, dict[str, Any]]] = {}
        self._charts: tuple[str, dict[str, str], str] | None = None
        self._tokens: view_data.TokenTexts | None = None
        if tokenizer is not None:
            self._tokens = view_data.TokenTexts.load(Path(tokenizer))

    def index(self, metrics_key: str | None = None) -> dict[str, Any]:
        """The recorded steps, the token note and, if `metrics.jsonl` changed, the charts.

        Keys: `steps` (each `{"step": n, "key": k}`, in order), `metrics_key`, `tokenizer`
        (the token note), `metrics` (a note: the folder has no `metrics.jsonl`, or lines of it
        were skipped; "" when neither), and `charts` (chart name -> SVG text) unless
        `metrics_key` is the current one.
        """
        with self._lock:
            steps = [
                {"step": n, "key": view_data.file_key(episode_file(self.run_dir, n))}
                for n in recorded_steps(self.run_dir)
            ]
            key, charts, note = self._chart_svgs()
            index: dict[str, Any] = {
                "steps": steps,
                "metrics_key": key,
                "tokenizer": self._token_texts().note,
                "metrics": note,
            }
            if metrics_key != key:
                index["charts"] = charts
            return index

    def step(self, step: int) -> dict[str, Any]:
        """A step's `step`, `key`, `summary`, `episodes`, `note` and `tokens` (id -> text).

        `note` names the lines of the step's file that are not episode records and were
        skipped ("" when none were); the other episodes are shown.

        Raises:
            FileNotFoundError: The run has no episode record for that step.
            OSError: The file does not read.
        """
        with self._lock:
            path = episode_file(self.run_dir, step)
            key = view_data.file_key(path)
            if key is None:
                raise FileNotFoundError(f"no episodes recorded for step {step} in {path.parent}")
            cached = self._steps.get(step)
            if cached is None or cached[0] != key:
                cached = self._steps[step] = (key, self._read_step(step, key))
            payload = cached[1]
            ids = view_data.episode_token_ids(payload["episodes"])
            return payload | {"tokens": self._token_texts().of(sorted(ids))}

    def _read_step(self, step: int, key: str) -> dict[str, Any]:
        records, skipped = view_data.read_step(self.run_dir, step)
        folder = episode_file(self.run_dir, step).parent
        episodes = [
            view_data.episode_view(record) | {"images": view_data.episode_images(record, folder)}
            for record in records
        ]
        summary = view_data.step_summary(episodes)
        note = _skipped_note(skipped, episode_file(self.run_dir, step).name, "episodes")
        return {"step": step, "key": key, "summary": summary, "episodes": episodes, "note": note}

    def page(self, live: bool) -> str:
        """The whole HTML page; live pages read steps from the server, static ones embed them."""
        index = self.index()
        data: dict[str, Any] = {
            "live": live,
            "run": str(self.run_dir),
            "finishes": [str(finish) for finish in Finish],
            "steps": index["steps"],
            "metrics_key": index["metrics_key"],
            "tokenizer": index["tokenizer"],
            "metrics": index["metrics"],
            "step_data": {},
            "tokens": {},
        }
        if not live:
            for entry in index["steps"]:
                payload = self.step(entry["step"])
                data["tokens"] |= payload.pop("tokens")
                data["step_data"][entry["step"]] = payload
        return render_page(str(self.run_dir), index["charts"], data)

    def _chart_svgs(self) -> tuple[str, dict[str, str], str]:
        """The metrics file's key ("none" while there is none), the charts, and the note."""
        key = view_data.file_key(self.run_dir / METRICS_FILE) or "none"
        if self._charts is None or self._charts[0] != key:
            entries, skipped = view_data.read_metrics(self.run_dir)
            series = view_data.chart_series(entries)
            charts = {name: chart_svg(name, series[name]) for name in CHART_TITLES}
            self._charts = (key, charts, self._metrics_note(key, skipped))
        return self._charts

    def _metrics_note(self, key: str, skipped: list[str]) -> str:
        if key == "none":
            return (
                f"no {METRICS_FILE} in {self.run_dir} (the command line writes it; a run "
                "through the Python API does not): the charts are empty"
            )
        return _skipped_note(skipped, METRICS_FILE, "charts")

    def _token_texts(self) -> view_data.TokenTexts:
        if self._tokens is None or self._tokens.tokenizer is None:
            folder = view_data.find_tokenizer(self.run_dir)
            if folder is not None:
                self._tokens = view_data.TokenTexts.load(folder)
            elif self._tokens is None:
                note = (
                    f"no tokenizer saved in {self.run_dir} yet (model/ or checkpoint-*/): tokens "
                    "show their ids (--tokenizer FOLDER names one)"
                )
                self._tokens = view_data.TokenTexts(None, note)
        return self._tokens


def _skipped_note(skipped: list[str], file: str, shown_as: str) -> str:
    """What the page says about the lines of `file` that were skipped; "" when none were."""
    if not skipped:
        return ""
    shown = "; ".join(skipped[:3]) + ("; ..." if len(skipped) > 3 else "")
    return f"{len(skipped)} line(s) of {file} skipped, the {shown_as} show the rest: {shown}"


def chart_svg(name: str, series: view_data.Series) -> str:
    """One of the page's charts (`CHART_TITLES`) as inline SVG."""
    values = [y for points in series.values() for _, y in points]
    y_range = (min([0.0, *values]), max([1.0, *values]))
    return line_chart_svg(
        series,
        title=CHART_TITLES[name],
        x_label="step",
        y_range=y_range,
        width=_CHART_WIDTH,
        height=_CHART_HEIGHT,
    )


def render_page(run: str, charts: dict[str, str], data: dict[str, Any]) -> str:
    """The page's HTML: its template with the CSS, script, charts and `data` put inline.

    `data` goes in a `<script type="application/json">` element with every `<` escaped, so no
    text in it (a tool result holding `</script>`) can end the element early. The template's
    `{{name}}` markers are filled in one pass, so filled-in text is never read for markers.
    """
    files = resources.files("agentgrpo.reporting") / "view_page"
    figures = "\n".join(
        f'<figure class="chart" id="chart-{name}">{svg}</figure>' for name, svg in charts.items()
    )
    parts = {
        "{{title}}": html.escape(f"agentgrpo view: {run}"),
        "{{run}}": html.escape(run),
        "{{style}}": (files / "page.css").read_text(encoding="utf-8"),
        "{{charts}}": figures,
        "{{data}}": script_json(data),
        "{{script}}": (files / "page.js").read_text(encoding="utf-8"),
    }
    template = (files / "page.html").read_text(encoding="utf-8")
    return re.sub(r"\{\{\w+\}\}", lambda marker: parts[marker[0]], template)


def script_json(value: Any) -> str:
    """`value` as JSON text that is safe inside an HTML `<script>` element: no `<` in it.

    >>> text = script_json({"text": "</script>"})
    >>> "<" in text, json.loads(text)
    (False, {'text': '</script>'})
    """
    return json.dumps(value, allow_nan=False, separators=(",", ":")).replace("<", "\\u003c")
