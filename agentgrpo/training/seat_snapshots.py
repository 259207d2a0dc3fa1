"""Frozen snapshots of the policy that play seats of a game (``seat_players={"o": "snapshot:N"}``).

A seat that `environments.seats.Snapshot` plays samples its turns from a copy of the policy's
weights as they were when the copy was last taken, and is never trained. With the transformers
backend the copy is a second model in the trainer's process, generating through a backend of
its own (`generation.local.CopiedWeights`, the copy the asynchronous producer also uses). One
pool of copies serves every snapshot seat with the same `Snapshot` settings.

A copy is taken at the first round the run plays (after the warm start), then, for
``"snapshot:N"``, again at the first round at least N optimizer steps after the last; plain
``"snapshot"`` is never taken again. A league (``"league:N:K"``) keeps its K latest copies,
a new one replacing the oldest once there are K, and each match draws one of them
(`rollout.match`). A resumed run takes its copies afresh from the resumed policy: a league
starts again from one. With `async_grpo` the producer plays from pools of its own, which
its generator fills as it is loaded and pushed new weights (`SeatSnapshots.producer`,
`RefreshedOnPush`). With vLLM a snapshot is a frozen LoRA adapter in its engine
(`generation.adapters.FrozenAdapter`): the policy must be a LoRA adapter pushed alone, and
not with `async_grpo`. Sharded weights (DeepSpeed ZeRO-3, FSDP) cannot be copied here; these
are refused by `SeatSnapshots.of`. `choose_with_snapshots` is the trainer's one call for it
all: its generators, the rounds' one refreshing the copies first, the seats that trained LoRA
adapters play (`seat_policies`) and those other models play (`seat_models`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from agentgrpo.generation.adapters import FrozenAdapter, is_peft
from agentgrpo.generation.generator import (
    AroundRounds,
    ConcurrentGenerator,
    Generator,
    Generators,
    choose_generators,
)
from agentgrpo.generation.local import CopiedWeights
from agentgrpo.placement import Placement
from agentgrpo.training.seat_models import SeatModels
from agentgrpo.training.seat_policies import SeatPolicies
from environments.seats import Snapshot, is_seated, seat_players
from rollout import GenerationBackend

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig


class _Copy(Protocol):
    """A snapshot: a `CopiedWeights` (transformers), or a `FrozenAdapter` (vLLM)."""

    @property
    def backend(self) -> Any:
        """What generates with it (its `reset_prefix_cache` and `release_memory` too)."""
        ...

    def load(self, policy: torch.nn.Module, version: int) -> None:
        """Take `policy`'s weights (of step `version`) in place of those held."""
        ...


@dataclass
class _Pool:
    """The copies of one `Snapshot` setting: at most `size`, the oldest replaced first.

    Attributes:
        copy: Makes a new copy of the policy it is given (weights and backend): a
            `CopiedWeights`, or a `FrozenAdapter` in vLLM's engine (`SeatSnapshots.on_vllm`).
        every: Optimizer steps between two copies; None: only the first is taken.
        size: The most copies kept.
        copies: The copies taken, in the order of their slots.
        backends: Their backends: the list the match engine draws from, kept in place.
        taken_at: The optimizer step of each copy, by slot.
    """

    copy: Callable[[torch.nn.Module], _Copy]
    every: int | None
    size: int
    copies: list[_Copy] = field(default_factory=list)
    backends: list[GenerationBackend] = field(default_factory=list)
    taken_at: list[int] = field(default_factory=list)

    def due(self, step: int) -> bool:
        """Whether the round of optimizer step `step` takes a new copy."""
        if not self.taken_at:
            return True
        return self.every is not None and step >= max(self.taken_at) + self.every

    def take(self, policy: torch.nn.Module, step: int) -> None:
        """Copy `policy` (its weights of `step`) into a new slot, or over the oldest copy."""
        if len(self.copies) < self.size:
            self.copies.append(self.copy(policy))
            self.backends.append(self.copies[-1].backend)
            self.taken_at.append(step)
            return
        oldest = self.taken_at.index(min(self.taken_at))
        self.copies[oldest].load(policy, step)
        self.copies[oldest].backend.reset_prefix_cache()  # its keys are the old weights'
        self.taken_at[oldest] = step

    async def push(self, policy: torch.nn.Module, step: int) -> None:
        """`take`, while the copies generate: over the oldest copy between two of its steps.

        Its games in play go on with the new weights (an opponent's turns, never trained).
        """
        if len(self.copies) < self.size:
            self.take(policy, step)  # a new copy: nothing generates with it yet
            return
        oldest = self.taken_at.index(min(self.taken_at))
        copied = self.copies[oldest]
        assert isinstance(copied, CopiedWeights)  # vLLM's are refused with `async_grpo`
        await copied.push(policy, step)  # empties its prefix cache too
        self.taken_at[oldest] = step

    def emptied(self) -> _Pool:
        """A pool of the same settings that holds no copy yet."""
        return dataclasses.replace(self, copies=[], backends=[], taken_at=[])


@dataclass
class SeatSnapshots:
    """The frozen copies of the policy that a run's snapshot seats play.

    Attributes:
        seats: Each snapshot seat's pool of copies (seats with one `Snapshot` share it).
        policies: The trained LoRA adapters some seats play (`seat_policies.SeatPolicies`):
            their backends are handed on with the snapshots'.
        models: The other models that ``"model:PATH"`` seats play (`seat_models.SeatModels`),
            their backends handed on with the snapshots'.
    """

    seats: dict[str, _Pool] = field(default_factory=dict)
    policies: SeatPolicies | None = None
    models: SeatModels = field(default_factory=SeatModels)

    @classmethod
    def of(
        cls,
        args: GRPOConfig,
        placement: Placement,
        environment: Any,
        policy: torch.nn.Module,
        tokenizer: Any,
    ) -> SeatSnapshots:
        """The copies `args.seat_players` asks for (none: an empty `SeatSnapshots`).

        Args:
            args: The run's config (its `seat_players`, sampling and precision).
            placement: Its launch.
            environment: The run's environment factory.
            policy: The policy (unwrapped); copied by each round that takes a copy.
            tokenizer: The policy's tokenizer.

        Raises:
            ValueError: A snapshot seat with vLLM generating a policy that is not a LoRA
                adapter pushed alone, or with `async_grpo`; or over sharded weights.
        """
        if not (isinstance(environment, type) and is_seated(environment)):
            return cls()
        players = seat_players(environment, args.seat_players)
        chosen = {s: p for s, p in players.items() if type(p) is Snapshot}  # not OtherModel
        if not chosen:
            return cls()
        asked = {seat: args.seat_players[seat] for seat in chosen}  # type: ignore[index]
        if args.use_vllm and (reason := _vllm_refusal(args, policy)):
            raise ValueError(
                f"seat_players {asked}: with vLLM a snapshot seat plays a frozen copy of the "
                f"policy's LoRA adapter, loaded beside the policy's, and {reason}; or generate "
                "with transformers (use_vllm=False), or give the seat 'random' or a scripted "
                "player"
            )
        if placement.shards_weights:
            raise ValueError(
                f"seat_players {asked}: a snapshot seat needs the whole policy on each process "
                "to copy, and DeepSpeed ZeRO-3 or FSDP shards it; launch with DeepSpeed ZeRO-2 "
                "or without sharding, or give the seat 'random' or a scripted player"
            )
        copy = functools.partial(_copied, tokenizer=tokenizer, args=args)
        pools = {p: _Pool(copy, p.every, p.pool) for p in dict.fromkeys(chosen.values())}
        return cls({seat: pools[snapshot] for seat, snapshot in chosen.items()})

    @property
    def slots(self) -> int:
        """The most snapshots held at once: every pool's size (seats may share one)."""
        return sum(pool.size for pool in {id(p): p for p in self.seats.values()}.values())

    def on_vllm(self, generator: Any) -> None:
        """Take the snapshots as frozen adapters in `generator`'s vLLM engine (`use_vllm`).

        Raises:
            ValueError: `generator` pushes merged weights (vLLM cannot serve the policy's
                adapter: the warning before said why).
        """
        if not self.seats:
            return
        pushes = generator.adapters
        if pushes is None:
            raise ValueError(
                "seat_players: a snapshot seat on vLLM is a frozen LoRA adapter beside the "
                "policy's, and this run pushes merged weights (see the warning above for why); "
                "generate with transformers (use_vllm=False), or give the seat 'random' or a "
                "scripted player"
            )
        for pool in self.seats.values():
            pool.copy = functools.partial(FrozenAdapter, pushes)

    @property
    def backends(self) -> dict[str, list[GenerationBackend]]:
        """Each snapshot seat's pool of backends, which the rounds fill and refresh in place.

        `rollout.match.MatchEngine`'s ``seat_backends``: each match draws one of its seat's.
        Each seat a trained adapter or another model plays has its backend, alone in its pool.
        """
        adapters = self.policies.seat_backends if self.policies is not None else {}
        fixed = adapters | self.models.backends
        own = {seat: [backend] for seat, backend in fixed.items()}
        return {seat: pool.backends for seat, pool in self.seats.items()} | own

    def refresh(self, policy: torch.nn.Module, step: int) -> None:
        """Take a copy of `policy`'s weights into each pool due at optimizer step `step`."""
        for pool in {id(p): p for p in self.seats.values()}.values():
            if pool.due(step):
                pool.take(policy, step)

    async def push(self, policy: torch.nn.Module, step: int) -> None:
        """`refresh`, while the copies generate (`_Pool.push`)."""
        for pool in {id(p): p for p in self.seats.values()}.values():
            if pool.due(step):
                await pool.push(policy, step)

    def producer(
        self, generator: ConcurrentGenerator | None, tokenizer: Any, args: GRPOConfig
    ) -> tuple[ConcurrentGenerator, dict[str, list[GenerationBackend]]]:
        """`async_grpo`'s producer: its generator, and what plays its frozen seats (`backends`).

        The producer plays on a thread of its own, beside the learner's rounds (evaluation),
        which keep these pools and backends. So its snapshot seats draw from pools of their own,
        of the same settings, which the returned generator fills and refreshes
        (`RefreshedOnPush`): its copies are of the weights the producer generates with, taken
        as they are loaded or pushed. Each other model's seat gets a backend of its own over
        the same frozen model (`SeatModels.producer_backends`), and each trained adapter's
        a backend over the producer's copy with that adapter active
        (`SeatPolicies.producer_backends`).
        """
        assert generator is not None  # `async_grpo` has a producer
        pools = {id(p): p.emptied() for p in self.seats.values()}
        own = SeatSnapshots({seat: pools[id(p)] for seat, p in self.seats.items()})
        fixed: dict[str, GenerationBackend] = {**self.models.producer_backends(tokenizer, args)}
        if self.policies is not None:
            fixed |= self.policies.producer_backends(generator, tokenizer)
        seats = own.backends | {seat: [backend] for seat, backend in fixed.items()}
        return (RefreshedOnPush(generator, own) if own.seats else generator), seats

    def around(self, generator: Generator) -> Generator:
        """`generator`, refreshing the copies (as due) at the start of each of its rounds.

        Its rounds end by freeing the memory the copies' and other models' backends hold.
        """
        if not (self.seats or self.models.backends):
            return generator
        return AroundRounds(generator, self.refresh, self.release_memory)

    def release_memory(self) -> None:
        """Free what the copies' and the other models' backends hold for generating."""
        for pool in self.seats.values():
            for copied in pool.copies:
                copied.backend.release_memory()
        self.models.release_memory()


class RefreshedOnPush(AroundRounds):
    """A `ConcurrentGenerator`: `generator`, taking `snapshots`' copies as due with its weights.

    Each `load` and `push` of step N's weights also refreshes the pools due at step N
    (`SeatSnapshots.refresh`, `SeatSnapshots.push`): the producer's snapshots are of the weights
    it has generated with, refreshed at the first push at least ``every`` steps after the last.
    """

    generator: ConcurrentGenerator

    def __init__(self, generator: ConcurrentGenerator, snapshots: SeatSnapshots):
        super().__init__(generator, snapshots.refresh, lambda: None)  # rounds refresh too
        self.snapshots = snapshots

    def load(self, policy: torch.nn.Module, version: int) -> None:
        """`generator.load`, then the copies due at `version` (nothing generates)."""
        self.generator.load(policy, version)
        self.snapshots.refresh(policy, version)

    async def push(self, policy: torch.nn.Module, version: int) -> None:
        """`generator.push`, then the copies due at `version`, between their own steps."""
        await self.generator.push(policy, version)
        await self.snapshots.push(policy, version)

    def take_paused_s(self) -> float:
        """`generator`'s."""
        return self.generator.take_paused_s()


def _vllm_refusal(args: GRPOConfig, policy: torch.nn.Module) -> str | None:
    """Why vLLM cannot hold this run's snapshots (frozen LoRA adapters), or None."""
    if not is_peft(policy):
        return "this policy trains whole: pass peft_config=LoraConfig(...) (`--use-peft`)"
    if args.vllm_lora_push == "merged":
        return "vllm_lora_push='merged' pushes no adapter: set it to 'auto' or 'adapter'"
    if args.async_grpo:
        return "async_grpo would unload a snapshot that episodes play: drop async_grpo"
    return None


def _copied(policy: torch.nn.Module, tokenizer: Any, args: GRPOConfig) -> CopiedWeights:
    """A new frozen copy of `policy`, with its own backend, tagged with no version yet."""
    return CopiedWeights(policy, tokenizer, args)


def choose_with_snapshots(
    args: GRPOConfig,
    placement: Placement,
    policy: torch.nn.Module,
    tokenizer: Any,
    accelerator: Any,
    processor: Any,
    environment: Any,
) -> tuple[Generators, SeatSnapshots, SeatPolicies]:
    """`generation.generator.choose_generators`, with the seats' snapshots and trained adapters.

    The arguments are `choose_generators`'s, and the run's environment factory. The snapshot
    seats are refused (`SeatSnapshots.of`), the other models loaded (`SeatModels.of`) and the
    adapter seats' adapters added to `policy` (`SeatPolicies.of`) before any generator starts;
    the rounds' generator refreshes the snapshots and starts the adapters' backends afresh.

    Raises:
        ValueError: As `SeatSnapshots.of`, `SeatModels.of`, `SeatPolicies.of` and
            `choose_generators`.
    """
    snapshots = SeatSnapshots.of(args, placement, environment, policy, tokenizer)
    snapshots.models = SeatModels.of(args, placement, environment, policy, tokenizer)
    policies = SeatPolicies.of(args, placement, accelerator, environment, policy)
    room = snapshots.slots  # a colocated vLLM engine holds each as an adapter
    generators = choose_generators(
        args, placement, policy, tokenizer, accelerator, processor, frozen_adapters=room
    )
    if args.use_vllm:
        snapshots.on_vllm(generators.rounds)
    policies.attach(generators.rounds.backend, tokenizer)
    snapshots.policies = policies
    rounds = policies.around(snapshots.around(generators.rounds))
    return generators._replace(rounds=rounds), snapshots, policies
