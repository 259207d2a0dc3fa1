"""`agentgrpo eval --model <a VLM folder>` plays episodes with pictures, as `run` does."""

from __future__ import annotations

import pytest

from tests.support.cli import agentgrpo
from tests.support.vlm_models import saved_vlm


@pytest.mark.process
def test_eval_of_a_vlm_folder_shows_the_model_the_pictures(tmp_path):
    vlm = saved_vlm("idefics3", tmp_path / "vlm")
    episodes = tmp_path / "episodes.txt"
    result = agentgrpo(
        "eval", "env:ColourSquare", "--model", str(vlm), "--num-episodes", "2",
        "--max-completion-length", "8", "--episodes-file", str(episodes),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "episodes               2" in result.stdout
    assert episodes.read_text().count("[image]") == 2  # each episode's prompt showed its picture
