"""Generators of the transformers backend, in the trainer's process: the policy, or a copy of it.

- `SharedWeights`: the backend generates with the policy's own tensors, between optimizer
  steps (synchronous rounds, and evaluation under `async_grpo`): there is nothing to push.
- `CopiedWeights`: the backend generates from a copy of the policy, on the asynchronous
  producer's thread, so that the optimizer never changes weights under a forward pass; a push
  copies the policy's tensors in between two generation steps. Rows that are decoding go on
  with the new weights, so an episode, and even a turn, can hold two versions.

Under mixed precision both generate under the autocast dtype of the trainer's forward passes.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from agentgrpo.generation.sampling import sampling_overrides
from agentgrpo.precision import autocast_kwargs, mixed_precision_dtype
from rollout import TransformersBackend

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig


def transformers_backend(
    model: torch.nn.Module, tokenizer: Any, args: GRPOConfig, fsdp2: bool = False
) -> TransformersBackend:
    """A transformers backend generating with `model`, sampled as `args` asks.

    `fsdp2`: FSDP2 shards `model` (`Placement.fsdp2`); its decoding step then takes no CUDA
    graphs, whose capture cannot take in the streams FSDP's forward hooks wait on.
    """
    return TransformersBackend.from_tokenizer(
        model,
        tokenizer,
        seed=args.seed,
        sampling_overrides=sampling_overrides(args),
        cuda_graphs=not fsdp2,
        **autocast_kwargs(mixed_precision_dtype(args)),
    )


class SharedWeights:
    """The transformers backend generating with the policy's own tensors: nothing to push.

    Its prefix cache holds keys and values of the weights it was filled with, so every round
    starts with an empty one. Every round ends by freeing all the backend holds for generating
    (`release_memory`: the prefix cache, on a GPU the slot cache and the decoding step's CUDA
    graphs), so the learner has that memory; the next round allocates it and captures again.
    Nothing generates while the optimizer steps, so it never plays beside the learner.
    """

    def __init__(self, backend: TransformersBackend):
        self.backend = backend
        self.version = -1  # no round yet

    @contextlib.contextmanager
    def generating(self, policy: torch.nn.Module, step: int) -> Iterator[None]:
        """Generate with the policy as it is."""
        self.backend.reset_prefix_cache()
        self.version = step
        try:
            yield
        finally:
            self.backend.release_memory()


class CopiedWeights:
    """The transformers backend's own copy of the policy, reloaded between generation steps.

    Args:
        policy: The policy (unwrapped); copied once, here.
        tokenizer: The policy's tokenizer.
        args: The run's config (seed, sampling, mixed precision).
    """

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, args: GRPOConfig):
        self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        self.backend = transformers_backend(self.model, tokenizer, args)
        # Other backends over `model`, under `backend`'s step lock (a trained adapter's):
        # each copy in empties their prefix caches and tags their tokens too.
        self.siblings: list[TransformersBackend] = []
        self.version = 0
        self.paused_s = 0.0  # generation paused for pushes since the last `take_paused_s`

    @contextlib.contextmanager
    def generating(self, policy: torch.nn.Module, step: int) -> Iterator[None]:
        """Copy `policy`'s tensors in if they are not those of `step`, then generate."""
        if step != self.version:
            self.load(policy, step)
        yield

    async def push(self, policy: torch.nn.Module, version: int) -> None:
        """Copy `policy`'s tensors into the generator's, between two generation steps."""

        def copy_in() -> None:
            started = time.perf_counter()
            self._copy(policy, version)
            self.paused_s += time.perf_counter() - started

        await self.backend.between_steps(copy_in, version)

    def load(self, policy: torch.nn.Module, version: int) -> None:
        """Copy `policy`'s tensors in (nothing generates)."""
        self._copy(policy, version)
        self.backend.set_weights_version(version)

    def _copy(self, policy: torch.nn.Module, version: int) -> None:
        with torch.no_grad():
            targets = self.model.state_dict()
            for name, tensor in policy.state_dict().items():
                targets[name].copy_(tensor)
        for sibling in self.siblings:  # nothing generates, or the shared step lock is held
            sibling.reset_prefix_cache()
            sibling.set_weights_version(version)
        self.version = version

    def take_paused_s(self) -> float:
        """Seconds generation paused for pushes since the last call."""
        paused, self.paused_s = self.paused_s, 0.0
        return paused
