"""The generator: which backend generates, on which weights, and how the policy's reach it.

`choose_generators` reads the config and the placement once, refuses what does not combine
(`REFUSALS`, each naming what works), and returns the run's `Generators`:

| generation       | synchronous rounds, evaluation | `async_grpo`'s producer                   |
|------------------|--------------------------------|-------------------------------------------|
| transformers     | `SharedWeights`: the policy    | `CopiedWeights`: its own copy             |
| vLLM colocate    | `ColocatedPush`                | refused (GRPOConfig: it holds the device) |
| vLLM server      | `ServedWeights`                | the same `ServedWeights`; evaluation      |
|                  |                                | pushes to it through the producer         |

Launches: ZeRO-3 generating from shards over several processes is refused; `async_grpo` runs
on one process (GRPOConfig) and not over sharded weights. PEFT policies go to vLLM merged
(`weight_sync.policy_weights`); with transformers the adapter generates as it trains.

The trainer wraps every round it plays in `rounds.generating(policy, global_step)`, which brings
the generator to that step's weights (after each optimizer step, a warm start or a resume).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from agentgrpo.generation.evaluation import stop_token_ids_of
from agentgrpo.generation.local import CopiedWeights, SharedWeights, transformers_backend
from agentgrpo.generation.sampling import sampling_overrides
from agentgrpo.generation.weight_sync import (
    ColocatedPush,
    ServedWeights,
    ServerPush,
    colocated_vllm,
    sleeps_between_rounds,
)
from agentgrpo.placement import Placement
from rollout import GenerationBackend
from rollout.backends.vllm_server import ServerConnection, VLLMServerBackend, server_url

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig


class Generator(Protocol):
    """A generation backend and the policy weights it generates with, round by round.

    `version` is the optimizer step of those weights (-1: none of the policy's steps yet).
    A round the learner waits for runs inside `generating`.
    """

    @property
    def version(self) -> int:
        """The optimizer step of the weights it generates with."""
        ...

    @property
    def backend(self) -> GenerationBackend:
        """The backend that generates with these weights."""
        ...

    def generating(
        self, policy: torch.nn.Module, step: int
    ) -> contextlib.AbstractContextManager[None]:
        """Context of one round on `policy`'s weights of optimizer step `step` (loaded first)."""
        ...


class ConcurrentGenerator(Generator, Protocol):
    """A generator that also plays beside the learner (`async_grpo`'s producer).

    It takes new weights by `push`, between two of its generation steps, while episodes play;
    its backend tags each token with the version that drew it.
    """

    def load(self, policy: torch.nn.Module, version: int) -> None:
        """Take `policy`'s weights as `version` while nothing generates."""
        ...

    async def push(self, policy: torch.nn.Module, version: int) -> None:
        """Take `policy`'s weights as `version` between two generation steps, while it plays."""
        ...

    def take_paused_s(self) -> float:
        """Seconds generation waited for pushes since the last call."""
        ...


class Generators(NamedTuple):
    """A run's generators: its rounds', and its asynchronous producer's (None without one).

    With a vLLM server both are one generator: the server.
    """

    rounds: Generator
    producer: ConcurrentGenerator | None


@dataclass(frozen=True)
class Refusal:
    """A combination that cannot run: `applies(config, placement)`, and what to do instead."""

    applies: Callable[[GRPOConfig, Placement], bool]
    message: str


def _sharded(placement: Placement) -> str | None:
    if placement.zero_stage == 3:
        return "DeepSpeed ZeRO-3"
    return "FSDP" if placement.engine == "FSDP" else None


REFUSALS = (
    Refusal(
        lambda c, p: p.zero_stage == 3 and p.num_processes > 1 and not c.ds3_gather_for_generation,
        "ds3_gather_for_generation=False generates from ZeRO-3 shards, where every forward "
        "pass waits for every process, and episodes of different lengths would never "
        "finish; leave ds3_gather_for_generation=True (the model must fit on one device "
        "to generate), or use ZeRO-2",
    ),
    Refusal(
        lambda c, p: c.async_grpo and _sharded(p) is not None,
        "async_grpo cannot generate from {sharded}'s sharded weights: its producer copies "
        "and pushes the policy's whole weights from its own thread while the learner "
        "trains. Launch its one process without sharded weights (DeepSpeed ZeRO-2, "
        "examples/accelerate/deepspeed_zero2.yaml, works), or set async_grpo=False.",
    ),
)


def check_combination(args: GRPOConfig, placement: Placement) -> None:
    """Refuse a config that cannot generate under `placement` (`REFUSALS`).

    GRPOConfig refuses, on its own, what the config alone rules out (`async_grpo` with a
    colocated vLLM or over several processes, tensor parallelism in colocate mode).

    Raises:
        ValueError: The first refusal that applies, saying what works instead.
    """
    for refusal in REFUSALS:
        if refusal.applies(args, placement):
            raise ValueError(refusal.message.format(sharded=_sharded(placement)))


def choose_generators(
    args: GRPOConfig,
    placement: Placement,
    policy: torch.nn.Module,
    tokenizer: Any,
    accelerator: Any,
    processor: Any = None,
) -> Generators:
    """The generators `args` asks for (`use_vllm`, `vllm_mode`, `async_grpo`) under `placement`.

    Args:
        args: The run's config.
        placement: Its launch.
        policy: The policy, unwrapped (a vLLM engine starts from its weights; the producer's
            copy is made of it).
        tokenizer: The policy's tokenizer.
        accelerator: The trainer's (a server push's main process and barrier).
        processor: A vision-language model's; vLLM (colocated or a server) is then given the
            rows' images with their placeholders unexpanded (`rollout.images.unexpanded_ids`).

    Raises:
        ValueError: The combination cannot run (`check_combination`).
    """
    check_combination(args, placement)
    if not args.use_vllm:
        shared = SharedWeights(transformers_backend(policy, tokenizer, args, placement.fsdp2))
        producer = CopiedWeights(policy, tokenizer, args) if args.async_grpo else None
        return Generators(shared, producer)
    stop = stop_token_ids_of(tokenizer, getattr(policy, "generation_config", None))
    if args.vllm_mode == "colocate":
        sleeps = sleeps_between_rounds(args)
        colocated = colocated_vllm(policy, processor or tokenizer, args, stop, sleeps)
        if sleeps:  # as TRL: its memory is free until the first round
            colocated.sleep()
        return Generators(ColocatedPush(colocated, sleeps), None)
    url = server_url(args.vllm_server_base_url, args.vllm_server_host, args.vllm_server_port)
    connection = ServerConnection(url, args.vllm_server_timeout)
    backend = _server_backend(connection, args, stop, processor)
    transport = ServerPush(connection, args.vllm_group_port)
    served = ServedWeights(backend, transport, accelerator)
    return Generators(served, served if args.async_grpo else None)


def _server_backend(
    connection: ServerConnection, args: GRPOConfig, stop: set[int], processor: Any
) -> VLLMServerBackend:
    return VLLMServerBackend.connect(
        connection,
        stop_token_ids=stop,
        sampling_overrides=sampling_overrides(args),
        regex=args.vllm_structured_outputs_regex,
        max_concurrent_requests=args.max_concurrent_episodes,
        processor=processor,
    )
