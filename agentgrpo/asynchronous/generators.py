"""The generator of asynchronous GRPO and its weights: a copy of the policy, or a vLLM server.

Both tag each drawn token with the version (the optimizer step) of the weights that drew it, and
take new weights between two of their own steps, while episodes play:

- transformers (`CopiedWeights`): the backend generates from a copy of the policy, on the
  producer's thread, so that the optimizer never changes weights under a forward pass; a push
  copies the policy's tensors in between two generation steps. Rows that are decoding go on
  with the new weights, so an episode, and even a turn, can hold two versions.
- a vLLM server (`ServedWeights`, `agentgrpo vllm-serve`, in its own process): a push holds new
  requests back and pauses the server, which cuts the turns in flight short, broadcasts the
  weights (`ServerPush`) and resumes; the cut turns are continued with the new weights
  (`VLLMServerBackend.between_steps`), so here too a turn can hold two versions.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from agentgrpo.generation.weight_sync import ServerPush, policy_weights, sampling_overrides
from agentgrpo.precision import autocast_kwargs, mixed_precision_dtype
from rollout import GenerationBackend, TransformersBackend
from rollout.backends.vllm_server import VLLMServerBackend


class GeneratorWeights(Protocol):
    """The generator's weights: their version, and how the policy's reach them."""

    version: int

    @property
    def backend(self) -> GenerationBackend:
        """The backend that generates with these weights (it counts versions)."""
        ...

    async def push(self, policy: torch.nn.Module, version: int) -> None:
        """Give the generator `policy`'s weights between two of its steps, while it runs."""
        ...

    def load(self, policy: torch.nn.Module, version: int) -> None:
        """Give the generator `policy`'s weights while nothing generates."""
        ...

    def take_paused_s(self) -> float:
        """Seconds generation waited for pushes since the last call."""
        ...


class CopiedWeights:
    """The transformers backend's own copy of the policy, reloaded between generation steps.

    Args:
        policy: The policy (unwrapped); copied once, here.
        tokenizer: The policy's tokenizer.
        args: The run's config (seed, sampling, mixed precision).
    """

    def __init__(self, policy: torch.nn.Module, tokenizer: Any, args: Any):
        self.model = copy.deepcopy(policy).eval().requires_grad_(False)
        self.backend = TransformersBackend.from_tokenizer(
            self.model,
            tokenizer,
            seed=args.seed,
            sampling_overrides=sampling_overrides(args),
            **autocast_kwargs(mixed_precision_dtype(args)),
        )
        self.version = 0
        self.paused_s = 0.0  # generation paused for pushes since the last `take_paused_s`

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
        self.version = version

    def take_paused_s(self) -> float:
        """Seconds generation paused for pushes since the last call."""
        paused, self.paused_s = self.paused_s, 0.0
        return paused


class ServedWeights:
    """A vLLM server's weights, broadcast while the server is paused.

    Args:
        backend: The server's backend (the trainer's own: evaluation shares the server).
        pushes: The trainer's `ServerPush` (it holds the broadcast group).
    """

    def __init__(self, backend: VLLMServerBackend, pushes: ServerPush):
        self.backend, self.pushes = backend, pushes
        self.version = -1  # the served model's own weights, until the first push
        self.paused_s = 0.0  # new requests held back for pushes since the last `take_paused_s`

    async def push(self, policy: torch.nn.Module, version: int) -> None:
        """Pause the server (cutting the turns in flight), broadcast `policy`'s weights, resume.

        `take_paused_s` counts the whole time new requests were held back.
        """
        started = time.perf_counter()
        await self.backend.between_steps(lambda: self._send(policy, version), version)
        self.paused_s += time.perf_counter() - started

    def load(self, policy: torch.nn.Module, version: int) -> None:
        """Broadcast `policy`'s weights (nothing generates)."""
        self._send(policy, version)
        self.backend.set_weights_version(version)

    def _send(self, policy: torch.nn.Module, version: int) -> None:
        with policy_weights(policy) as weights:
            self.pushes.push(weights, next(policy.parameters()).device)
        self.pushes.pushed_step = self.version = version

    def take_paused_s(self) -> float:
        """Seconds new requests waited for pushes since the last call."""
        paused, self.paused_s = self.paused_s, 0.0
        return paused


def generator_weights(
    args: Any, policy: torch.nn.Module, tokenizer: Any, backend: Any, sync: Any
) -> GeneratorWeights:
    """The producer's weights for `args`: a vLLM server's (`vllm_mode='server'`), else a copy.

    Args:
        args: The run's config.
        policy: The learner's policy (unwrapped).
        tokenizer: The policy's tokenizer.
        backend: The trainer's backend; the server one is shared with the producer.
        sync: The trainer's weight sync; a `ServerPush` with the server.
    """
    if args.use_vllm:
        assert isinstance(backend, VLLMServerBackend) and isinstance(sync, ServerPush)
        return ServedWeights(backend, sync)
    return CopiedWeights(policy, tokenizer, args)


class PushedForEvaluation:
    """The trainer's weight sync when an asynchronous producer shares its vLLM server.

    An evaluation round first brings the server to the learner's step, through the producer
    (between its requests), so that evaluation is of the current policy.

    Args:
        push: Pushes the learner's weights of the given step (`AsyncGeneration.push`).
        version: The version the server holds now.
    """

    def __init__(self, push: Callable[[int], float], version: Callable[[], int]):
        self.push, self.version = push, version

    @contextlib.contextmanager
    def generating(self, model: torch.nn.Module, step: int) -> Iterator[None]:
        """Push if the server's weights are not those of `step`, then generate."""
        if self.version() != step:
            self.push(step)
        yield
