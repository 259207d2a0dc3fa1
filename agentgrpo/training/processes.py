"""The run's processes as accelerate runs them: this one's index, and the collectives between them.

The round, the trainer's log and the loss step take the collectives as plain functions
(`rounds.pipeline.Gather`, `round_report.GatherObjects`, a sum), so they run on CPU without a
launch; on one process each is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object


@dataclass(frozen=True)
class Processes:
    """The processes of `accelerator`'s run; every process calls each collective at once."""

    accelerator: Accelerator

    @property
    def index(self) -> int:
        """The index of the process this runs in, from 0."""
        return self.accelerator.process_index

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's rows of `tensor`, in process order, on the CPU."""
        return self.accelerator.gather(tensor.to(self.accelerator.device)).cpu()

    def gather_objects(self, values: list[Any]) -> list[Any]:
        """Every process's `values`, concatenated in process order."""
        return gather_object(values) if self.accelerator.num_processes > 1 else list(values)

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` summed over the processes."""
        return self.accelerator.reduce(tensor.to(self.accelerator.device), reduction="sum")
