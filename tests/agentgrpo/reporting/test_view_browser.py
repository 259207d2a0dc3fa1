"""`agentgrpo view` in a real headless browser (Debian's Chromium through selenium).

The run folder is real: `agentgrpo run` trains the tiny Llama taught to call Counter's tool for
two steps, greedily on the row it was taught, so its episodes hold sampled calls (mask 1) and
the tool turns between them (mask 0). The page is served by `agentgrpo view` as a user starts
it, and written with `--html`; the browser opens it, finds the charts, clicks each episode and
reads back the colour of every token, which must be the episode's loss mask, token by token.
"""

from __future__ import annotations

import json
import selectors
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from agentgrpo.reporting.run_log import episode_file, read_episodes, recorded_steps
from tests.support.cli import agentgrpo_here
from tests.support.episodes import COUNTER_ROW

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (CHROMIUM and CHROMEDRIVER),
        reason="needs Debian's chromium and chromium-driver (`apt-get install chromium "
        "chromium-driver`; `make install` does it as root)",
    ),
]


@pytest.fixture(scope="module")
def real_run(tool_calling_tiny_model, tokenizer, tmp_path_factory) -> Path:
    """The output folder of a real two-step `agentgrpo run` of a tiny model that calls tools."""
    model_dir = tmp_path_factory.mktemp("tool-calling-tiny")
    tool_calling_tiny_model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = model_dir / "rows.jsonl"
    rows.write_text((json.dumps(COUNTER_ROW) + "\n") * 4)
    out = tmp_path_factory.mktemp("view") / "run"
    result = agentgrpo_here(
        "run", "env:Counter", "--model", str(model_dir), "--output-dir", str(out),
        "--dataset", str(rows), "--temperature", "0", "--max-steps", "2",
        "--per-device-train-batch-size", "4", "--num-generations", "2",
        "--max-completion-length", "128", "--max-turns", "3", "--warm-start-steps", "0",
        "--chat-template", "chatml_tools", "--save-strategy", "no",
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert recorded_steps(out) == [1, 2]
    masks = [m for r in read_episodes(out, 2) for row in r.episode.rows for m in row.loss_mask]
    assert 0 in masks and 1 in masks  # tool turns between sampled calls
    return out


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1400,1600")
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def wait_for(condition: Callable[[], Any], timeout_s: float = 60) -> Any:
    """Poll `condition` until it returns something true; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        assert time.monotonic() < deadline, "the page did not get there in time"
        time.sleep(0.2)
    return value


def run_script(browser, script: str) -> Any:
    return browser.execute_script(script)


def table_episodes(browser, pane: str = "pane-a") -> list[int]:
    """The episodes listed in a pane, as their index in the step's record file."""
    return run_script(
        browser,
        f"return [...document.querySelectorAll('#{pane} table.episodes tbody tr')]"
        ".map(tr => Number(tr.dataset.episode))",
    )


def open_episode(browser, index: int, pane: str = "pane-a") -> dict[str, Any]:
    """Click an episode's row; what its detail shows: token classes, texts and titles by row."""
    browser.find_element("css selector", f"#{pane} tr[data-episode='{index}']").click()
    wait_for(lambda: browser.find_elements("css selector", f"#{pane} .detail .tokens"))
    return run_script(
        browser,
        f"""const rows = [...document.querySelectorAll('#{pane} .detail .row')];
        const spans = (row, which) => [...row.querySelectorAll(`.tokens.${{which}} .tok`)];
        return rows.map(row => ({{
          prompt: spans(row, 'prompt').map(s => s.className),
          classes: spans(row, 'completion').map(s => s.className),
          texts: spans(row, 'completion').map(s => s.textContent),
          titles: spans(row, 'completion').map(s => s.title),
        }}));""",
    )


def check_every_episode(browser, run_dir: Path, step: int, tokenizer) -> None:
    """Each listed episode's tokens are coloured by its loss mask, row by row, in order."""
    records = read_episodes(run_dir, step)
    assert sorted(table_episodes(browser)) == list(range(len(records)))
    for index, record in enumerate(records):
        shown = open_episode(browser, index)
        assert len(shown) == len(record.episode.rows)
        for row, seen in zip(record.episode.rows, shown, strict=True):
            assert seen["classes"] == [f"tok m{mask}" for mask in row.loss_mask]
            assert seen["prompt"] == ["tok p"] * len(row.prompt_ids)
            texts = [tokenizer.decode([t]).replace("\n", "↵\n") for t in row.completion_ids]
            assert seen["texts"] == texts
            for mask, title, logprob in zip(
                row.loss_mask, seen["titles"], row.sampler_logprobs, strict=True
            ):
                assert title.startswith("sampled · logprob" if mask else "tool / environment")
                if mask:
                    assert abs(float(title.split()[3]) - logprob) <= 1e-3 * max(1, abs(logprob))


def charts(browser) -> dict[str, str]:
    return run_script(
        browser,
        "return Object.fromEntries([...document.querySelectorAll('figure.chart')]"
        ".map(f => [f.id, f.innerHTML]))",
    )


@pytest.mark.process
def test_the_served_page_shows_the_run_and_follows_it(real_run, browser, tokenizer, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(real_run, run_dir)
    server = subprocess.Popen(
        [sys.executable, "-m", "agentgrpo", "view", str(run_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = first_line_url(server)
        browser.get(url)
        wait_for(lambda: table_episodes(browser))
        shown = charts(browser)
        assert set(shown) == {"chart-reward", "chart-tools", "chart-failures"}
        assert all(svg.lstrip().startswith("<svg") for svg in shown.values())
        assert "mean reward" in shown["chart-reward"]
        assert run_script(browser, "return document.querySelector('#pane-a select').value") == "2"
        check_every_episode(browser, run_dir, 2, tokenizer)

        shutil.copy(episode_file(run_dir, 2), episode_file(run_dir, 3))
        with (run_dir / "metrics.jsonl").open("a") as file:
            file.write(json.dumps({"step": 3, "reward": 0.123, "tools/call_frequency": 3.0}) + "\n")
        options = "return [...document.querySelectorAll('#pane-a option')].map(o => o.value)"
        wait_for(lambda: run_script(browser, options) == ["1", "2", "3"], timeout_s=30)
        wait_for(lambda: charts(browser)["chart-reward"] != shown["chart-reward"], timeout_s=30)
    finally:
        server.send_signal(signal.SIGINT)
        output, _ = server.communicate(timeout=60)
    assert server.returncode == 0, output
    assert "stopped" in output and "Traceback" not in output


def first_line_url(server: subprocess.Popen, timeout_s: float = 120) -> str:
    """The URL `agentgrpo view` prints when it starts serving."""
    with selectors.DefaultSelector() as selector:
        selector.register(server.stdout, selectors.EVENT_READ)
        assert selector.select(timeout_s), "agentgrpo view printed nothing"
    line = server.stdout.readline()
    assert line.startswith("agentgrpo view: http://127.0.0.1:"), line + server.stdout.read()
    return line.split()[2]


@pytest.mark.process
def test_the_html_file_opens_filters_and_compares_steps(real_run, browser, tokenizer, tmp_path):
    from selenium.webdriver.support.ui import Select

    page = tmp_path / "page.html"
    result = agentgrpo_here("view", str(real_run), "--html", str(page))
    assert result.returncode == 0, result.stdout + result.stderr
    browser.get(page.as_uri())
    wait_for(lambda: table_episodes(browser))
    assert len(charts(browser)) == 3
    check_every_episode(browser, real_run, 2, tokenizer)

    records = read_episodes(real_run, 2)
    browser.find_element("id", "failed-only").click()
    failed = [i for i, r in enumerate(records) if r.episode.stats.tool_failures]
    assert sorted(table_episodes(browser)) == failed
    browser.find_element("id", "failed-only").click()
    finish = Select(browser.find_element("id", "finish"))
    finish.select_by_value(str(records[0].episode.finish))
    ended_so = [i for i, r in enumerate(records) if r.episode.finish == records[0].episode.finish]
    assert sorted(table_episodes(browser)) == ended_so
    finish.select_by_value("")
    best = max(r.reward for r in records)
    browser.find_element("id", "reward-min").send_keys(str(best))
    assert sorted(table_episodes(browser)) == [i for i, r in enumerate(records) if r.reward >= best]
    browser.find_element("id", "reward-min").clear()

    browser.find_element("id", "compare").click()
    wait_for(lambda: table_episodes(browser, "pane-b"))
    assert run_script(browser, "return document.querySelector('#pane-b select').value") == "1"
    first_step = read_episodes(real_run, 1)
    assert sorted(table_episodes(browser, "pane-b")) == list(range(len(first_step)))
    [row] = open_episode(browser, 0, pane="pane-b")
    assert row["classes"] == [f"tok m{mask}" for mask in first_step[0].episode.rows[0].loss_mask]
