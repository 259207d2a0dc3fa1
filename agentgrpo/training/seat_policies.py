"""Several trained policies in one run: LoRA adapters of one base model, one per role or seat.

``seat_players={"x": "policy", "o": "adapter:solver"}`` trains the policy (PEFT's ``"default"``
adapter, `peft_config`) on seat x and a second LoRA adapter ``solver`` of the same base on o.
`SeatPolicies.of` adds every named adapter to the run's `PeftModel` with the policy's LoRA
config, each initialised as PEFT initialises one, from the run's seed plus a checksum of its
name (the run's own random draws untouched); all of them stay trainable.

- **Generation.** Each named adapter generates through a transformers backend of its own over
  the same model (`attach`): its steps run with its adapter active, and every backend over the
  model shares one step lock, so no step ever sees another's adapter. The match engine gets
  them as the adapter seats' ``seat_backends``: a seat's tokens are its adapter's.
- **Learning.** `route` records each episode's adapter (its seat's) when a round is batched;
  `forward` (the loss step's) and `logprobs` (the trainer's) score a batch's rows an adapter
  at a time, that adapter active, and put the rows back in order. The loss thus reaches only
  the adapter of each row. `grouped` gives each named adapter a param group of its own in the
  optimizer, at its `adapter_learning_rates` rate (else `learning_rate`); the schedule scales
  every group alike. `route` also queues each adapter's metrics (`round_metrics`).
- **Checkpoints.** PEFT's `save_pretrained` saves every adapter (a named one in a subfolder of
  its name); `load` reads the named ones back on resume (transformers reads the policy's), and
  the optimizer's state holds every group, so a resumed run continues exactly.

- **Asynchronous.** With `async_grpo` the producer's copy of the model holds every adapter,
  each push copies them all, and each adapter seat samples through a backend of its own over
  that copy (`producer_backends`).

vLLM, sharded weights (ZeRO-3, FSDP), gradient checkpointing and models without a LoRA
`peft_config` are refused here.
"""

from __future__ import annotations

import contextlib
import functools
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from agentgrpo.generation.generator import AroundRounds, Generator
from agentgrpo.generation.local import CopiedWeights
from agentgrpo.generation.sampling import sampling_overrides
from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.learner.logprobs import PolicyForward, batched_logprobs, completion_logprobs
from agentgrpo.placement import Placement
from agentgrpo.precision import autocast_kwargs, mixed_precision_dtype
from environments.seats import is_seated, seat_adapters
from rollout import Episode, GenerationBackend, TransformersBackend

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig
    from agentgrpo.rounds.pipeline import RoundParts
    from agentgrpo.training.loss_step import LossStep


# PEFT's prefix of LoRA weight names: it reinitialises an adapter whose name is a part of it.
_LORA_PREFIX = "lora_"


@dataclass
class SeatPolicies:
    """The named LoRA adapters a run trains beside its policy, and how each is generated and scored.

    Attributes:
        args: The run's config (sampling temperature, batch sizes, learning rates).
        placement: Its launch.
        accelerator: Its accelerator (the autocast of its forward passes).
        model: The run's `PeftModel` (None: no named adapter, and every method passes through).
        seats: Each adapter seat's adapter name.
        learning_rates: Each named adapter's learning rate.
        policy_adapter: The policy's own adapter (PEFT's ``"default"``).
        backends: Each named adapter's generation backend (`attach`).
        episode_adapters: The adapter of each episode of the last round batched, by position,
            for training (True) and evaluation (False) rounds.
        optimizer: The optimizer `grouped` made, once it has.
    """

    args: GRPOConfig
    placement: Placement
    accelerator: Any
    model: Any = None
    seats: dict[str, str] = field(default_factory=dict)
    learning_rates: dict[str, float] = field(default_factory=dict)
    policy_adapter: str = "default"
    backends: dict[str, TransformersBackend] = field(default_factory=dict)
    episode_adapters: dict[bool, list[str]] = field(default_factory=dict)
    optimizer: torch.optim.Optimizer | None = None

    @classmethod
    def of(
        cls,
        args: GRPOConfig,
        placement: Placement,
        accelerator: Any,
        environment: Any,
        policy: Any,
    ) -> SeatPolicies:
        """Add the adapters `args.seat_players` names to `policy` (none named: no adapter).

        Raises:
            ValueError: An adapter seat without a LoRA `peft_config`, with vLLM generating,
                over sharded weights, with gradient checkpointing, or an adapter name PEFT
                cannot load back (see the module).
        """
        if not (isinstance(environment, type) and is_seated(environment)):
            return cls(args, placement, accelerator)
        seats = seat_adapters(environment, args.seat_players)
        if not seats:
            return cls(args, placement, accelerator)
        _refuse(args, placement, policy, seats)
        names = list(dict.fromkeys(seats.values()))
        config = policy.peft_config[policy.active_adapter]
        for name in names:
            with torch.random.fork_rng(devices=[]):  # the run's own draws stay as they were
                torch.manual_seed(args.seed + zlib.crc32(name.encode()))
                policy.add_adapter(name, config)
        policy.set_adapter(policy.active_adapter)
        policy.set_requires_grad([policy.active_adapter, *names], True)
        rates = args.adapter_learning_rates or {}
        learning_rates = {name: rates.get(name, args.learning_rate) for name in names}
        return cls(
            args, placement, accelerator, policy, seats, learning_rates, policy.active_adapter
        )

    # ------------------------------------------------------------------ generation

    def attach(self, policy_backend: GenerationBackend, tokenizer: Any) -> None:
        """Make each named adapter's backend, sharing `policy_backend`'s step lock."""
        if self.model is None:
            return
        assert isinstance(policy_backend, TransformersBackend)  # vLLM is refused by `of`
        for name in self.learning_rates:
            self.backends[name] = self._backend(self.model, tokenizer, policy_backend, name)

    def _backend(
        self, model: Any, tokenizer: Any, beside: TransformersBackend, name: str
    ) -> TransformersBackend:
        """A backend generating with `model`'s adapter `name`, under `beside`'s step lock."""
        return TransformersBackend.from_tokenizer(
            model,
            tokenizer,
            seed=self.args.seed + zlib.crc32(name.encode()),
            sampling_overrides=sampling_overrides(self.args),
            step_lock=beside.step_lock,
            step_context=lambda: self.active(name, model),
            **autocast_kwargs(mixed_precision_dtype(self.args)),
        )

    def producer_backends(self, weights: Any, tokenizer: Any) -> dict[str, GenerationBackend]:
        """Each adapter seat's backend for `async_grpo`'s producer, over its copy `weights`.

        The producer's copy (`generation.local.CopiedWeights`) is of the whole `PeftModel`,
        every adapter in it, and each push copies them all. Each named adapter generates
        through a backend of its own over that copy, its adapter active, sharing the copy's
        step lock; the copy tags their tokens with each version it is pushed (its
        ``siblings``), so an adapter seat's episodes are checked for staleness as the
        policy's are.
        """
        if self.model is None:
            return {}
        assert isinstance(weights, CopiedWeights)  # vLLM is refused by `of`
        backends = {
            name: self._backend(weights.model, tokenizer, weights.backend, name)
            for name in self.learning_rates
        }
        weights.siblings.extend(backends.values())
        return {seat: backends[name] for seat, name in self.seats.items()}

    @property
    def seat_backends(self) -> dict[str, GenerationBackend]:
        """Each adapter seat's backend: the match engine's ``seat_backends`` for them."""
        return {seat: self.backends[name] for seat, name in self.seats.items() if self.backends}

    def around(self, generator: Generator) -> Generator:
        """`generator`, whose rounds also start and end the adapters' backends afresh."""
        if not self.backends:
            return generator
        return AroundRounds(generator, self._reset_prefix_caches, self._release_memory)

    def _reset_prefix_caches(self, policy: torch.nn.Module, step: int) -> None:
        """Drop what the adapters' backends cached of the weights before step `step`."""
        for backend in self.backends.values():
            backend.reset_prefix_cache()

    def _release_memory(self) -> None:
        """Free what the adapters' backends hold for generating."""
        for backend in self.backends.values():
            backend.release_memory()

    @contextlib.contextmanager
    def active(self, name: str, model: Any = None) -> Iterator[None]:
        """`name`'s adapter active (the policy's again after), every adapter still trainable.

        `model`: the policy (None), or the producer's copy of it, which stays frozen.
        """
        policy = model is None or model is self.model
        model = self.model if model is None else model
        model.set_adapter(name)
        try:
            yield
        finally:
            model.set_adapter(self.policy_adapter)
            if policy:
                model.set_requires_grad([self.policy_adapter, *self.learning_rates], True)
            else:
                model.requires_grad_(False)

    # ------------------------------------------------------------------ learning

    def route(
        self, parts: RoundParts, loss_step: LossStep, metrics: dict[str, dict[str, list[float]]]
    ) -> RoundParts:
        """`parts` and `loss_step` scoring each row under its episode's adapter (see the module).

        The parts' `collate` records each episode's adapter (its seat's) for the logprobs of
        its rows, and their `observe` queues each adapter's metrics in `metrics` (the
        trainer's, by mode; `round_metrics`), however the round was played (`async_grpo`'s
        come from its queue). Nothing changes without a named adapter.
        """
        if self.model is None:
            return parts

        def collate(episodes: Sequence[Episode], advantages_N: torch.Tensor) -> TrainingBatch:
            adapters = [
                self.seats.get(str(e.row.get("seat")), self.policy_adapter) for e in episodes
            ]
            self.episode_adapters[self.model.training] = adapters
            return parts.collate(episodes, advantages_N)

        def observe(episodes: Sequence[Episode], rewards_N: torch.Tensor) -> None:
            mode = metrics["train" if self.model.training else "eval"]
            for name, value in self.round_metrics(episodes, rewards_N).items():
                mode[name].append(value)

        loss_step.policies = self
        return replace(parts, collate=collate, observe=observe)

    def forward(
        self, model: torch.nn.Module, batch: TrainingBatch, *args, **kwargs
    ) -> PolicyForward:
        """`completion_logprobs` of each row under its episode's adapter (see the module)."""
        parts = self._rows_by_adapter(model, batch)
        if parts is None:
            return completion_logprobs(model, batch, *args, **kwargs)
        forwards = []
        for name, rows in parts:
            with self.active(name):
                forwards.append(completion_logprobs(model, batch.select(rows), *args, **kwargs))
        rows_B, width = [row for _, rows in parts for row in rows], batch.completion_width
        entropies = [f.entropy_B_C for f in forwards if f.entropy_B_C is not None]
        aux = [f.aux_loss for f in forwards if f.aux_loss is not None]  # a mean of the parts'
        return PolicyForward(
            _in_order([f.logprobs_B_C for f in forwards], rows_B, width),
            _in_order(entropies, rows_B, width) if len(entropies) == len(parts) else None,
            torch.stack(aux).mean() if aux else None,
        )

    def logprobs(self, model: torch.nn.Module, batch: TrainingBatch) -> torch.Tensor:
        """The trainer's logprobs of a batch under `model`, each row under its episode's adapter.

        No grad, under the run's autocast, `per_device_train_batch_size` rows a pass
        (`learner.logprobs.batched_logprobs`).
        """
        score = functools.partial(
            batched_logprobs,
            temperature=self.args.temperature,
            rows_per_pass=self.args.per_device_train_batch_size,
            sharded=self.placement.shards_weights,
        )
        with self.accelerator.autocast():  # the run's mixed precision, as in the loss forward
            parts = self._rows_by_adapter(model, batch)
            if parts is None:
                return score(model, batch)
            scored = []
            for name, rows in parts:
                with self.active(name):
                    scored.append(score(model, batch.select(rows)))
        rows_B = [row for _, rows in parts for row in rows]
        return _in_order(scored, rows_B, batch.completion_width)

    def _rows_by_adapter(
        self, model: torch.nn.Module, batch: TrainingBatch
    ) -> list[tuple[str, list[int]]] | None:
        """Each adapter's rows of `batch`; None where nothing routes (no adapter, another model)."""
        if self.model is None or _unwrapped(model) is not self.model:
            return None
        adapters = self.episode_adapters.get(model.training)
        assert adapters is not None, "a batch scored before its round was collated (`collating`)"
        by_name: dict[str, list[int]] = {}
        for row, episode in enumerate(batch.episode_B.tolist()):
            by_name.setdefault(adapters[episode], []).append(row)
        return list(by_name.items())

    def grouped(self, create: Callable[[], torch.optim.Optimizer]) -> torch.optim.Optimizer:
        """The optimizer `create` makes, each named adapter's weights in a group of its own.

        A named adapter's group takes the settings (weight decay, betas) of the group its
        weights came from, and its own learning rate; the policy's groups keep theirs.
        """
        if self.model is None:
            return create()
        self.model.set_requires_grad([self.policy_adapter, *self.learning_rates], True)
        optimizer = create()
        own = {name: set(map(id, self.weights(name).values())) for name in self.learning_rates}
        added = []
        for group in optimizer.param_groups:
            for name, ids in own.items():
                if mine := [p for p in group["params"] if id(p) in ids]:
                    group["params"] = [p for p in group["params"] if id(p) not in ids]
                    lr = self.learning_rates[name]
                    added.append(group | {"params": mine, "lr": lr, "adapter": name})
        for group in added:
            optimizer.add_param_group(group)
        self.optimizer = optimizer
        return optimizer

    def weights(self, name: str) -> dict[str, torch.nn.Parameter]:
        """The weights of adapter `name`, by parameter name."""
        return {
            key: parameter
            for key, parameter in self.model.named_parameters()
            if name in key.split(".") and "lora_" in key
        }

    # ------------------------------------------------------------------ records

    def round_metrics(
        self, episodes: Sequence[Episode], rewards_N: torch.Tensor
    ) -> dict[str, float]:
        """Each named adapter's metrics of a round's episodes (this process's).

        ``adapter/NAME/reward_mean``: the mean combined reward of its seats' episodes (those
        with one); ``adapter/NAME/episodes``: how many; ``adapter/NAME/learning_rate``: its
        param group's rate now, once the optimizer exists.
        """
        found: dict[str, float] = {}
        for name in self.learning_rates:
            seats = {seat for seat, adapter in self.seats.items() if adapter == name}
            picked = [k for k, e in enumerate(episodes) if e.row.get("seat") in seats]
            rewards = rewards_N[picked]
            rewards = rewards[~rewards.isnan()]
            found[f"adapter/{name}/episodes"] = float(len(picked))
            if len(rewards):
                found[f"adapter/{name}/reward_mean"] = float(rewards.mean())
            for group in self.optimizer.param_groups if self.optimizer is not None else ():
                if group.get("adapter") == name:
                    found[f"adapter/{name}/learning_rate"] = float(group["lr"])
        return found

    def load(self, checkpoint: str) -> None:
        """Read every adapter's weights back from `checkpoint`, when resuming.

        PEFT saved the policy's in the checkpoint and each named one in a subfolder of its
        name. transformers reads only the subfolders back once there are any, so the policy's
        is read here too; all of them stay trainable.

        Raises:
            ValueError: The checkpoint lacks an adapter's weights (its run did not train it).
        """
        if self.model is None:
            return
        from peft import set_peft_model_state_dict
        from peft.utils import load_peft_weights

        folders = {self.policy_adapter: checkpoint}
        folders |= {name: os.path.join(checkpoint, name) for name in self.learning_rates}
        for name, folder in folders.items():
            if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
                raise ValueError(
                    f"checkpoint {checkpoint} holds no weights of adapter {name!r} (in {folder}); "
                    "resume from a checkpoint of a run whose seat_players trained it"
                )
            set_peft_model_state_dict(self.model, load_peft_weights(folder), adapter_name=name)
        self.model.set_requires_grad([self.policy_adapter, *self.learning_rates], True)


def _refuse(args: GRPOConfig, placement: Placement, policy: Any, seats: dict[str, str]) -> None:
    """Refuse the settings adapter seats cannot train under, naming what works."""
    asked = {seat: args.seat_players[seat] for seat in seats}  # type: ignore[index]
    if args.use_vllm:
        raise ValueError(
            f"seat_players {asked}: adapters for several trained policies need the transformers "
            "backend for now; generate with transformers (use_vllm=False)"
        )
    if placement.shards_weights:
        raise ValueError(
            f"seat_players {asked}: several trained adapters are switched per batch, which "
            "DeepSpeed ZeRO-3 or FSDP sharding does not allow; launch with DeepSpeed ZeRO-2 or "
            "without sharding"
        )
    if args.gradient_checkpointing:
        raise ValueError(
            f"seat_players {asked}: gradient checkpointing recomputes each forward in the "
            "backward pass, after the trained adapters were switched back, so their gradients "
            "would be wrong; set gradient_checkpointing=False"
        )
    if clashing := sorted(name for name in seats.values() if name in _LORA_PREFIX):
        raise ValueError(
            f"seat_players {asked}: PEFT cannot load an adapter named {clashing[0]!r} back (a "
            f"part of its weights' prefix {_LORA_PREFIX!r}); name it otherwise, e.g. "
            f"'adapter:{clashing[0]}_seat'"
        )
    config = getattr(policy, "peft_config", {}).get(getattr(policy, "active_adapter", None))
    if getattr(config, "peft_type", None) != "LORA":
        raise ValueError(
            f"seat_players {asked}: a seat played by a trained adapter needs the policy trained "
            "as a LoRA adapter: pass GRPOTrainer peft_config=LoraConfig(...) (or a PeftModel "
            "with LoRA; `agentgrpo run --use-peft`), or let the seat be 'policy'"
        )


def _in_order(parts: list[torch.Tensor], rows_B: list[int], width: int) -> torch.Tensor:
    """The B x `width` rows of `parts` (row `rows_B[k]` the k-th of them), padded with zeros."""
    padded = torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])
    order = torch.tensor(rows_B, device=padded.device)
    return padded[torch.argsort(order)]


def _unwrapped(model: Any) -> Any:
    """`model` out of its DDP or DeepSpeed wrapper."""
    while hasattr(model, "module"):
        model = model.module
    return model
