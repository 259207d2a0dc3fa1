"""`agentgrpo run --model <a VLM folder>` on a task with pictures, and what the run keeps."""

from __future__ import annotations

import json

import pytest

from rollout.images import load_processor
from tests.support.cli import agentgrpo
from tests.support.vlm_models import saved_vlm


@pytest.mark.process
def test_a_run_of_a_vlm_folder_on_colour_square_keeps_each_picture_as_a_file(tmp_path):
    vlm = saved_vlm("qwen2_5_vl", tmp_path / "vlm")
    out = tmp_path / "run"
    result = agentgrpo(
        "run", "env:ColourSquare", "--model", str(vlm), "--output-dir", str(out),
        "--max-steps", "1", "--per-device-train-batch-size", "4", "--num-generations", "2",
        "--max-completion-length", "8", "--dataset-size", "4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (out / "episodes" / "step-00001.jsonl").read_text().splitlines()
    assert len(lines) == 4
    for line in lines:
        assert len(line) < 20_000  # a reference to the picture, not its pixels
        record = json.loads(line)
        (image,) = [p["image"] for p in record["messages"][0]["content"] if p["type"] == "image"]
        assert image["size"] == [32, 32]
        assert (out / "episodes" / image["path"]).read_bytes().startswith(b"\x89PNG")
    assert "[image]" in (out / "episodes" / "step-00001.txt").read_text()
    saved = load_processor(str(out / "model"))  # the final folder loads as a VLM again
    assert type(saved).__name__ == "Qwen2_5_VLProcessor"
