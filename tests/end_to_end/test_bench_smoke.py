"""The benchmarks still run: rollout (quick), the endpoint, the sharded engines (tiny model), the
learner's memory under FSDP2 (tiny model)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.process

BENCH = REPO / "bench" / "rollout.py"


# "Does not hang", not a speed check: about 150 s at a load average of 10 on 2 cores, where
# the earlier 180 s limit came close; a quiet machine takes a fraction of that.
TIMEOUT_S = 900


def test_the_rollout_benchmark_runs_end_to_end_in_quick_mode():
    done = subprocess.run(
        [sys.executable, str(BENCH), "--quick"], capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "engine/lock-step" in done.stdout
    assert "ms per turn" in done.stdout


def test_the_endpoint_benchmark_runs_on_the_tiny_model():
    bench = BENCH.parent / "endpoint.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--tiny", "--episodes", "2", "--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "endpoint overhead:" in done.stdout
    assert "(8 requests)" in done.stdout  # 2 episodes x 3 tool calls and an answer


def test_the_sharded_memory_benchmark_runs_and_prints_its_table(tiny_model_dir):
    # One plain process only: tests/end_to_end/test_distributed.py runs the engines themselves.
    bench = BENCH.parent / "sharded_memory.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--model", str(tiny_model_dir), "--engines", "one"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| one | 1 |")]
    assert len(rows) == 1
    assert rows[0].endswith("| 0.0e+00 | 100.0000% |")  # one process against itself


def test_the_learner_memory_benchmark_scores_a_sharded_model_as_its_whole_logits():
    bench = BENCH.parent / "learner_memory.py"
    sizes = ("--rows", "4", "--prompt", "8", "--completion", "24", "--repeats", "1")
    done = subprocess.run(
        [sys.executable, str(bench), "--tiny", "--fsdp2", *sizes],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "FSDP2 (one process)" in done.stdout
    gaps = [line.rsplit(" ", 1)[1] for line in done.stdout.splitlines() if "difference" in line]
    assert len(gaps) == 2 and all(float(gap) < 1e-5 for gap in gaps)  # checkpointing off, on
    peaks = [line.split(" | ")[2] for line in done.stdout.splitlines() if line.startswith("| o")]
    assert len(peaks) == 4 and all(float(peak) > 0 for peak in peaks)  # measured on the CPU
