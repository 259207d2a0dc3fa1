"""`agentgrpo run --async` end to end on the tiny model, and its resume."""

from __future__ import annotations

import json

import pytest

from tests.support.cli import agentgrpo_here


@pytest.mark.slow  # two whole CLI runs
def test_an_async_run_trains_logs_staleness_and_resumes(tiny_model_dir, tmp_path, caplog):
    out = tmp_path / "out"
    common = (
        "run", "env:Counter", "--model", str(tiny_model_dir), "--output-dir", str(out),
        "--per-device-train-batch-size", "4", "--num-generations", "2",
        "--max-completion-length", "24", "--warm-start-steps", "0", "--save-steps", "1",
        "--chat-template", "chatml_tools", "--async", "--max-staleness", "2",
    )  # fmt: skip
    first = agentgrpo_here(*common, "--max-steps", "2")
    assert first.returncode == 0, first.stdout + first.stderr
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [entry for entry in logged if "reward" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    assert all(0 <= entry["sample/staleness_max"] <= 2 for entry in steps)
    records = (out / "episodes" / "step-00002.jsonl").read_text().splitlines()
    assert all("policy_versions" in row for line in records for row in json.loads(line)["rows"])

    resumed = agentgrpo_here(*common, "--max-steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "queued group(s) left by the earlier run" in caplog.text  # logged as a warning
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in logged if "reward" in entry] == [1, 2, 3]
