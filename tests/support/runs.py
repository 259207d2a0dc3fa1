"""Short training runs as plain settings, for agentgrpo's GRPOConfig and TRL's alike.

Nothing here imports agentgrpo or TRL, so a script that runs TRL alone can use it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# What every short test run sets: log each step; report, save and show nothing; stay on the CPU.
QUIET_CPU_RUN: dict[str, Any] = dict(
    logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True
)


def one_step(output_dir: str | Path, **changes: Any) -> dict[str, Any]:
    """One optimizer step of 4 completions (2 prompts x 2 generations), 8 tokens each.

    Quiet on the CPU (QUIET_CPU_RUN); `changes` add to or override any of it.
    """
    run = dict(output_dir=str(output_dir), max_steps=1, per_device_train_batch_size=4)
    return run | dict(num_generations=2, max_completion_length=8) | QUIET_CPU_RUN | changes


class CounterTools:
    """The `increment` tool of the TRL-style counters the tests define (a `counter` attribute)."""

    counter: int

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: The value to add.
        """
        self.counter += step
        return self.counter
