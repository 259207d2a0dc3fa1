"""The GRPO loss of one micro-batch, with the state the loss keeps from one micro-batch to the next.

`LossStep` owns what the loss needs beyond the batch: the loss settings (`losses.LossConfig`),
the sampler-mismatch token weights, the adaptive entropy controller (its checkpoint file
included), the router's load-balancing coefficient of a mixture-of-experts model, and the window
of sampler-mismatch statistics of the current optimizer step. The trainer calls it from its
hooks; everything distributed (gathers, reductions) comes in as a function, so it runs on CPU
without a Trainer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.learner.entropy_control import AdaptiveEntropy
from agentgrpo.learner.logprobs import completion_logprobs
from agentgrpo.learner.losses import LossConfig, policy_loss
from agentgrpo.learner.token_weights import TokenWeighting
from agentgrpo.precision import corrects_sampler_mismatch
from agentgrpo.reporting.sampling import SamplingWindow

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig
    from agentgrpo.training.seat_policies import SeatPolicies

# Where a checkpoint keeps the adaptive entropy controller (the name TRL 1.16 uses).
ENTROPY_STATE_FILE = "entropy_ctrl_state.json"


@dataclass
class LossStep:
    """The loss settings and the state they carry across micro-batches.

    Attributes:
        loss_config: The loss and its hyperparameters.
        token_weighting: The sampler-mismatch correction and token masks.
        entropy_control: The adaptive entropy controller, or None for a fixed coefficient.
        entropy_bonus: Whether the loss has an entropy bonus (fixed or adapted).
        router_aux_loss_coef: The weight of a mixture-of-experts model's load-balancing loss
            (0.0: the model has none, or it is off).
        temperature: The sampling temperature the logits are divided by.
        sharded: FSDP2 or ZeRO-3 shards the model's weights (`Placement.shards_weights`): the
            learner scores completions inside its forward.
        padding_free: Pack each micro-batch's rows into one, without padding
            (`learner.packing`).
        sampling: This optimizer step's sampler-mismatch statistics, micro-batch by micro-batch.
        policies: The LoRA adapters that seats train beside the policy (`seat_policies`): each
            row's loss forward runs under its adapter, and a checkpoint's adapters are read
            back with the loss step's state; None: the policy alone.
    """

    loss_config: LossConfig
    token_weighting: TokenWeighting
    entropy_control: AdaptiveEntropy | None
    entropy_bonus: bool
    router_aux_loss_coef: float
    temperature: float
    sharded: bool = False
    padding_free: bool = False
    sampling: SamplingWindow = field(default_factory=SamplingWindow)
    policies: SeatPolicies | None = None

    @classmethod
    def from_config(
        cls, args: GRPOConfig, loss_config: LossConfig, router_coef: float, sharded: bool = False
    ) -> LossStep:
        """The loss step of a `GRPOConfig` run, with its `loss_config` and router coefficient.

        `sharded`: the run's weights are shards (`Placement.shards_weights`).
        """
        return cls(
            loss_config=loss_config,
            token_weighting=TokenWeighting.from_config(args, corrects_sampler_mismatch(args)),
            entropy_control=AdaptiveEntropy.from_config(args),
            entropy_bonus=args.entropy_coef != 0.0 or args.use_adaptive_entropy,
            router_aux_loss_coef=router_coef,
            temperature=args.temperature,
            sharded=sharded,
            padding_free=args.padding_free,
        )

    def loss(
        self, model: torch.nn.Module, batch: TrainingBatch, training: bool, scale: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss to back-propagate for one micro-batch, and the loss metrics to record.

        The policy loss over mask-1 tokens scaled by `scale`, plus a mixture-of-experts model's
        load-balancing loss times `router_aux_loss_coef`. As TRL: `policy_loss` (the loss before
        the entropy bonus) is a metric when there is an entropy bonus, `aux_loss` (unweighted)
        when the model is mixture-of-experts. A `training` micro-batch adds its entropy to the
        adaptive controller's window; evaluation never changes the controller.
        """
        # The entropy bonus needs the entropy's gradient; everything else reads it detached.
        forward = completion_logprobs if self.policies is None else self.policies.forward
        logprobs_B_C, entropy_B_C, aux_loss = forward(
            model,
            batch,
            self.temperature,
            entropy="differentiable" if self.entropy_bonus else "detached",
            with_aux_loss=self.router_aux_loss_coef != 0.0,
            sharded=self.sharded,
            padding_free=self.padding_free,
        )
        assert entropy_B_C is not None  # asked for
        old_B_C = batch.old_logprobs_B_C
        if old_B_C is None:  # one update per round: the generating policy is the current one
            old_B_C = logprobs_B_C.detach()
        ratios_U = self.token_weighting.sampler_ratios(batch, old_B_C)
        self.sampling.add(old_B_C, batch.sampler_logprobs_B_C, batch.loss_mask_B_C, ratios_U)
        output = policy_loss(
            logprobs_B_C,
            old_B_C,
            batch.token_advantages,
            batch.loss_mask_B_C,
            self.loss_config,
            ref_logprobs_B_T=batch.ref_logprobs_B_C,
            sampler_weights_B_T=self.token_weighting.weights(
                batch, logprobs_B_C.detach(), old_B_C, entropy_B_C.detach()
            ),
            num_items=batch.num_items,
            entropy_B_T=entropy_B_C,
            entropy_coef=self._entropy_coef(entropy_B_C.detach(), batch.loss_mask_B_C, training),
            episode_B=batch.episode_B,
        )
        return self._total(output.loss * scale, output.metrics, scale, aux_loss)

    def _total(
        self,
        loss: torch.Tensor,
        metrics: dict[str, torch.Tensor],
        scale: float,
        aux_loss: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The scaled policy loss plus the weighted router loss, and the metrics to record."""
        recorded = {name: value for name, value in metrics.items() if name != "policy_loss"}
        if self.entropy_bonus:
            recorded["policy_loss"] = metrics["policy_loss"] * scale
        if aux_loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss
            recorded["aux_loss"] = aux_loss.detach()
        return loss, recorded

    def _entropy_coef(
        self, entropy_B_C: torch.Tensor, mask_B_C: torch.Tensor, training: bool
    ) -> float | None:
        """The adaptive coefficient for this micro-batch (None: the config's fixed one)."""
        control = self.entropy_control
        if control is None:
            return None
        if training:
            mask_B_C = mask_B_C.to(entropy_B_C.dtype)
            control.observe(float((entropy_B_C * mask_B_C).sum()), float(mask_B_C.sum()))
        return control.applied_coef

    def end_entropy_window(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> float:
        """At an optimizer step: update the adaptive coefficient from every process's window.

        `reduce_sum` sums a tensor over the processes. Returns the new coefficient. Only with
        an entropy controller.
        """
        control = self.entropy_control
        assert control is not None  # the caller checks
        local_2 = torch.tensor([control.window_sum, control.window_tokens], dtype=torch.float64)
        total_2 = reduce_sum(local_2)
        control.end_step(float(total_2[0]), float(total_2[1]))
        return control.coef

    def end_step(
        self,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor],
        gather: Callable[[torch.Tensor], torch.Tensor],
    ) -> dict[str, float]:
        """At an optimizer step: end its windows, and the metrics they give.

        `entropy_coef`, the adaptive coefficient updated from every process's window
        (`end_entropy_window`; with an entropy controller only), then the step's
        sampler-mismatch metrics (`SamplingWindow.close`). Every process calls it at once;
        `reduce_sum` and `gather` are the run's collectives.
        """
        ended: dict[str, float] = {}
        if self.entropy_control is not None:
            ended["entropy_coef"] = self.end_entropy_window(reduce_sum)
        return ended | self.sampling.close(gather)

    def save(self, checkpoint: str) -> None:
        """Write the entropy controller's state into `checkpoint` (nothing without one)."""
        if self.entropy_control is not None:
            with open(os.path.join(checkpoint, ENTROPY_STATE_FILE), "w") as file:
                json.dump(self.entropy_control.state(), file)

    def load(self, checkpoint: str) -> None:
        """Read the entropy controller's state, and the seats' adapters, from `checkpoint`."""
        if self.policies is not None:
            self.policies.load(checkpoint)
        path = os.path.join(checkpoint, ENTROPY_STATE_FILE)
        if self.entropy_control is not None and os.path.exists(path):
            with open(path) as file:
                self.entropy_control.load(json.load(file))
