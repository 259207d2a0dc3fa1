"""`report_to="trackio"`: a real run logs to trackio's local store, offline; a missing install says
which extra to install."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from agentgrpo import GRPOConfig, GRPOTrainer
from agentgrpo.cli import build_parser, main
from agentgrpo.cli.commands import _run_settings
from agentgrpo.reporting.trackers import check_trackers
from environments import Counter

# Run `agentgrpo ARGS` with every name lookup and internet connection refused and reported on
# stderr: trackio's local mode must neither upload nor start a dashboard.
OFFLINE_AGENTGRPO = textwrap.dedent(
    """
    import socket, sys

    def refuse(what):
        print(f"NETWORK ACCESS: {what}", file=sys.stderr, flush=True)
        raise OSError("no network in this test")

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            refuse(address)
        return unguarded_connect(sock, address)

    unguarded_connect, socket.socket.connect = socket.socket.connect, connect
    socket.getaddrinfo = lambda host, *args, **kwargs: refuse(host)
    from agentgrpo.cli import main
    sys.exit(main())
    """
)


def hide(monkeypatch, *modules: str) -> None:
    """Make `modules` look uninstalled: find_spec returns None and importing them fails."""
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("trackio") is None,
    reason="needs trackio: pip install 'agentgrpo[trackio]' (make install does)",
)
@pytest.mark.process
def test_a_run_reports_its_metrics_and_completions_to_trackio_offline(tiny_model_dir, tmp_path):
    out, store = tmp_path / "run", tmp_path / "trackio"
    # Of trackio's settings only TRACKIO_DIR: no Space, server or bucket from the environment.
    env = {name: v for name, v in os.environ.items() if not name.startswith("TRACKIO_")} | {
        "TRACKIO_DIR": str(store),
        "HF_HOME": str(tmp_path / "hf"),  # trackio's default store is under it: must stay empty
        "HF_HUB_OFFLINE": "1",
    }
    result = subprocess.run(
        [
            sys.executable, "-c", OFFLINE_AGENTGRPO, "run", "env:Counter",
            "--model", str(tiny_model_dir), "--output-dir", str(out), "--max-steps", "2",
            "--per-device-train-batch-size", "4", "--num-generations", "2",
            "--max-completion-length", "16", "--chat-template", "chatml_tools",
            "--save-strategy", "no", "--log-completions", "--report-to", "trackio",
        ],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "NETWORK ACCESS" not in result.stderr
    assert not (tmp_path / "hf").exists()

    # The project is the environment's name, the run its output folder (the CLI's defaults).
    with sqlite3.connect(store / "Counter.db") as db:
        logged = db.execute("SELECT run_name, step, metrics FROM metrics ORDER BY id").fetchall()
    assert {run for run, _, _ in logged} == {str(out)}
    entries = [json.loads(metrics) for _, _, metrics in logged]
    steps = [entry for entry in entries if "train/reward" in entry]
    tables = [entry for entry in entries if "completions" in entry]

    expected = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    expected = [entry for entry in expected if "reward" in entry]
    assert [e["train/global_step"] for e in steps] == [e["step"] for e in expected] == [1, 2]
    for entry, line in zip(steps, expected, strict=True):
        for name in ("reward", "loss", "tools/call_frequency", "tools/failure_frequency"):
            assert entry[f"train/{name}"] == pytest.approx(line[name]), name

    # One completions table per log, tied to its step; its rows are the round's 4 episodes.
    assert [table["train/global_step"] for table in tables] == [1, 2]
    for table in tables:
        assert table["completions"]["_type"] == "trackio.table"
        rows = table["completions"]["_value"]
        assert len(rows) == 4 and {row["step"] for row in rows} == {table["train/global_step"]}
        assert {"prompt", "completion", "Counter", "advantage"} <= set(rows[0])


def test_without_trackio_a_run_asking_for_it_names_the_extra(monkeypatch, capsys, tmp_path):
    hide(monkeypatch, "trackio")
    monkeypatch.chdir(tmp_path)
    install = "pip install 'agentgrpo[trackio]'"
    # The command line: one error line, before any model loads.
    assert main(["run", "env:Counter", "--report-to", "trackio"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and install in err
    # The library: GRPOTrainer fails at once, before it looks at the model.
    args = GRPOConfig(output_dir=str(tmp_path), report_to="trackio", use_cpu=True)
    with pytest.raises(ImportError, match="report_to='trackio' needs trackio") as raised:
        GRPOTrainer("no/such-model", lambda completions, **kw: [0.0] * len(completions), args)
    assert install in str(raised.value)


@pytest.mark.parametrize(
    ("tracker", "modules", "install"),
    [
        ("trackio", ["trackio"], "pip install 'agentgrpo[trackio]'"),
        ("wandb", ["wandb"], "pip install wandb"),
        ("tensorboard", ["tensorboard", "tensorboardX"], "pip install tensorboard"),
    ],
)
def test_a_missing_tracker_names_its_install_command(monkeypatch, tracker, modules, install):
    hide(monkeypatch, *modules)
    with pytest.raises(ImportError, match=f"report_to='{tracker}'") as raised:
        check_trackers(["none", tracker])
    assert install in str(raised.value)
    check_trackers(["mlflow", "none"])  # left to transformers' own check


def test_cli_runs_name_the_trackio_project_after_the_environment_and_the_run_after_its_folder():
    parser, _ = build_parser()
    default = _run_settings(parser.parse_args(["run", "env:Counter", "--output-dir", "o"]), Counter)
    assert default["config"]["project"] == "Counter" and default["config"]["run_name"] == "o"
    argv = ["run", "env:Counter", "--output-dir", "o", "--project", "p", "--run-name", "r"]
    given = _run_settings(parser.parse_args(argv), Counter)
    assert given["config"]["project"] == "p" and given["config"]["run_name"] == "r"
