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
on one process (GRPOConfig) and not over sharded weights. PEFT LoRA policies go to vLLM as the
adapter alone where vLLM can serve it (`generation.adapters`, `vllm_lora_push`), else merged
(`weight_sync.policy_weights`); with transformers the adapter generates as it trains.

The trainer wraps every round it plays in `rounds.generating(policy, global_step)`, which brings
the generator to that step's weights (after each optimizer step, a warm start or a resume).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol
from urllib.parse import urlsplit

import torch

from agentgrpo.generation.adapters import (
    VISION_REASON,
    AdapterPush,
    adapter_pushes,
    colocate_limits,
    unservable,
)
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
from rollout.backends.server_guard import is_loopback
from rollout.backends.vllm_colocate import VLLMColocateBackend
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


class AroundRounds:
    """A `Generator`: `generator`, calling `start` and `end` around each of its rounds.

    `start(policy, step)` runs once `generator` holds step `step`'s weights; `end()` runs when
    the round ends, however it ends.
    """

    def __init__(
        self,
        generator: Generator,
        start: Callable[[torch.nn.Module, int], None],
        end: Callable[[], None],
    ):
        self.generator = generator
        self.start = start
        self.end = end

    @property
    def version(self) -> int:
        """`generator`'s version."""
        return self.generator.version

    @property
    def backend(self) -> GenerationBackend:
        """`generator`'s backend."""
        return self.generator.backend

    @contextlib.contextmanager
    def generating(self, policy: torch.nn.Module, step: int) -> Iterator[None]:
        """A round of `generator` at optimizer step `step`, between `start` and `end`."""
        with self.generator.generating(policy, step):
            try:
                self.start(policy, step)
                yield
            finally:
                self.end()


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
    frozen_adapters: int = 0,
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
        frozen_adapters: Snapshots of the policy a colocated engine holds beside its adapter
            (`generation.adapters.FrozenAdapter`), room it is started with.

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
        why_not = functools.partial(_adapter_refusal, args, policy, processor, None)
        limits = (
            colocate_limits(policy, 1 + frozen_adapters)
            if adapter_pushes(args, policy, why_not, "colocate")
            else None
        )
        colocated = colocated_vllm(policy, processor or tokenizer, args, stop, sleeps, limits)
        if sleeps:  # as TRL: its memory is free until the first round
            colocated.sleep()
        adapters = AdapterPush(colocated, keep=1) if limits is not None else None
        return Generators(ColocatedPush(colocated, sleeps, adapters), None)
    url = server_url(args.vllm_server_base_url, args.vllm_server_host, args.vllm_server_port)
    connection = ServerConnection(url, args.vllm_server_timeout)
    backend = _server_backend(connection, args, stop, processor)
    transport = ServerPush(connection, args.vllm_group_port)
    adapters = None
    why_not = functools.partial(_adapter_refusal, args, policy, processor, transport)
    if adapter_pushes(args, policy, why_not, "server"):
        adapters = AdapterPush(backend, keep=args.max_staleness + 1 if args.async_grpo else 1)
    served = ServedWeights(backend, transport, accelerator, adapters)
    return Generators(served, served if args.async_grpo else None)


def shut_down(generator: Generator) -> None:
    """Stop `generator`'s colocated vLLM engine, if it has one (nothing generates afterwards).

    For the end of a run, before the trainer leaves its process group: the engine leaves
    vLLM's own groups first (`VLLMColocateBackend.shutdown`).
    """
    if isinstance(backend := generator.backend, VLLMColocateBackend):
        backend.shutdown()


def _adapter_refusal(
    args: GRPOConfig, policy: Any, processor: Any, transport: ServerPush | None
) -> str | None:
    """Why vLLM (colocated, or the server `transport` reaches) cannot take `policy`'s adapter.

    None: it can. A server loads each adapter from the folder the trainer writes, so `auto`
    pushes adapters only to a server on this machine; `adapter` trusts that it reads it.
    """
    if processor is not None:
        return VISION_REASON
    if transport is None:
        return unservable(policy, colocate_limits(policy))
    url = transport.connection.base_url
    if args.vllm_lora_push == "auto" and not is_loopback(urlsplit(url).hostname or ""):
        return (
            f"the server at {url} may not read the trainer's adapter folder (another machine; "
            "set vllm_lora_push='adapter' where it shares the trainer's temporary folder)"
        )
    return unservable(policy, transport.lora_limits())


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
