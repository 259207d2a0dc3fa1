"""Per-token logprobs of a batch's completions under a model: the learner's view of the policy."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.learner.output_head import (
    InForwardScores,
    Readout,
    head_logprobs,
    output_head,
    read_hidden,
    read_logits,
)
from agentgrpo.learner.packing import check_packable, packed_states
from agentgrpo.learner.shared_prompt import can_share_prompts, prompt_groups, shared_prompt_states
from agentgrpo.learner.token_weights import entropy_from_logits
from rollout.images import batch_vision, vision_forward_kwargs


class PolicyForward(NamedTuple):
    """What `completion_logprobs` computes.

    Attributes:
        logprobs_B_C: Logprob of each completion token (with grad when the model requires it);
            0 at padding.
        entropy_B_C: Entropy (nats) of each completion position's distribution, when asked
            for, else None; 0 at padding.
        aux_loss: A mixture-of-experts model's load-balancing loss, when asked for, else None.
    """

    logprobs_B_C: torch.Tensor
    entropy_B_C: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def completion_logprobs(
    model: torch.nn.Module,
    batch: TrainingBatch,
    temperature: float,
    entropy: str | None = None,
    with_aux_loss: bool = False,
    sharded: bool = False,
    padding_free: bool = False,
) -> PolicyForward:
    """Logprob (and entropy) of each completion token under `model`.

    Logits are divided by the sampling `temperature` first, so the values are comparable with
    the sampler's (see `rollout.backends.sampling`). The model returns its final hidden states and
    `output_head.head_logprobs` turns them into logprobs a chunk of tokens at a time, so the
    B x C x V logits never exist at once; for a model whose logits are not plain
    `lm_head(hidden)` (`output_head` is None) the completion positions' logits are read whole.
    A model whose weights FSDP2 or ZeRO-3 shard is scored the same way inside its forward
    (`output_head.InForwardScores`), in one pass. When rows share a prompt (a GRPO group),
    each distinct prompt runs through the model once (`shared_prompt_states`); otherwise, and
    whenever that could change the results, one pass runs over prompts and completions
    (`one_pass_states`). With `padding_free` the rows run packed, without padding (`packing`),
    sharing prompts the same way where it applies. Every way gives the same numbers and
    gradients up to float rounding.

    Args:
        model: A causal LM, possibly wrapped (DDP, DeepSpeed, PEFT).
        batch: The rows to score.
        temperature: Divides the logits; 0 means 1 (greedy sampling's logprobs).
        entropy: None, "detached" or "differentiable" (see `output_head.head_logprobs`).
        with_aux_loss: Ask a mixture-of-experts model for its load-balancing loss, over the
            whole sequences, prompts included (so always one pass).
        sharded: FSDP2 or DeepSpeed ZeRO-3 shards `model`'s weights (`Placement.shards_weights`).
        padding_free: Pack the rows into one, without padding (`packing.check_packable` says
            where it cannot, with a ValueError).
    """
    if padding_free:
        check_packable(model, batch, sharded)
    temperature = temperature or 1.0
    targets_B_C = batch.completion_ids_B_C
    real_B_C = batch.attention_mask_B_L[:, -batch.completion_width :].bool()
    head = output_head(model)
    if head is not None and sharded:
        scores = InForwardScores(head, targets_B_C, real_B_C, temperature, entropy)
        states_B_C_3S, aux_loss = one_pass_states(model, batch, scores, with_aux_loss)
        return PolicyForward(*scores.numbers(states_B_C_3S), aux_loss)
    readout: Readout = read_logits if head is None else read_hidden
    prompts = None if with_aux_loss else _shared_prompts(model, batch, sharded)
    if padding_free:
        states_B_C_D, aux_loss = packed_states(model, batch, prompts, readout, with_aux_loss)
    elif prompts is not None:
        states_B_C_D, aux_loss = shared_prompt_states(model, batch, prompts, readout), None
    else:
        states_B_C_D, aux_loss = one_pass_states(model, batch, readout, with_aux_loss)
    if head is not None:
        numbers = head_logprobs(head, states_B_C_D, targets_B_C, real_B_C, temperature, entropy)
    else:
        numbers = logits_logprobs(states_B_C_D, targets_B_C, real_B_C, temperature, entropy)
    return PolicyForward(*numbers, aux_loss)


def one_pass_states(
    model: torch.nn.Module, batch: TrainingBatch, readout: Readout, with_aux_loss: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`readout`'s states (B x C x D) predicting each completion token, one pass over whole rows.

    Returns the states and, with `with_aux_loss`, the model's load-balancing loss (else None).
    """
    router: dict[str, Any] = {"output_router_logits": True} if with_aux_loss else {}
    inputs = {"position_ids": batch.position_ids_B_L, **vision_inputs(model, batch)}
    states_B_C1_D, out = readout(
        model,
        batch.completion_width + 1,
        input_ids=batch.input_ids_B_L,
        attention_mask=batch.attention_mask_B_L,
        **inputs,
        **router,
    )
    return states_B_C1_D[:, :-1], out.aux_loss if with_aux_loss else None


def vision_inputs(model: torch.nn.Module, batch: TrainingBatch) -> dict[str, Any]:
    """The image tensors of the batch's rows and what the model reads with them (none: text).

    `rollout.images.vision_forward_kwargs`: the sampler calls the model the same way.
    """
    if batch.vision_B is None:
        return {}
    config = _unwrapped(model).config
    return vision_forward_kwargs(config, batch.input_ids_B_L, batch_vision(batch.vision_B))


def _unwrapped(model: Any) -> Any:
    """The model under DDP's or DeepSpeed's `module` wrapper (PEFT models pass `config` on)."""
    while not hasattr(model, "config") and hasattr(model, "module"):
        model = model.module
    return model


def logits_logprobs(
    logits_B_C_V: torch.Tensor,
    targets_B_C: torch.Tensor,
    real_B_C: torch.Tensor,
    temperature: float,
    entropy: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`output_head.head_logprobs` from whole logits: the same numbers, B x C x V at once."""
    logits_B_C_V = logits_B_C_V.float()
    if temperature != 1.0:
        logits_B_C_V = logits_B_C_V / temperature
    logprobs_B_C = torch.where(real_B_C, logprobs_from_logits(logits_B_C_V, targets_B_C), 0.0)
    if entropy is None:
        return logprobs_B_C, None
    scored_B_C_V = logits_B_C_V if entropy == "differentiable" else logits_B_C_V.detach()
    return logprobs_B_C, torch.where(real_B_C, entropy_from_logits(scored_B_C_V), 0.0)


def logprobs_from_logits(logits_B_C_V: torch.Tensor, targets_B_C: torch.Tensor) -> torch.Tensor:
    """Log-softmax of the logits, read at the target ids: B x C."""
    picked_B_C = logits_B_C_V.gather(-1, targets_B_C.unsqueeze(-1)).squeeze(-1)
    return picked_B_C - torch.logsumexp(logits_B_C_V, dim=-1)


def _shared_prompts(
    model: torch.nn.Module, batch: TrainingBatch, sharded: bool
) -> tuple[list[int], torch.Tensor] | None:
    """`prompt_groups(batch)` where sharing prompts is valid and pays, else None.

    It pays when rows share prompts; it needs prompt columns, at least 2 completion columns
    (the first completion token's state comes from the prompt pass), a model it suits, and no
    images (the prompt pass would have to split the images' tensors by prompt).
    """
    width_C = batch.completion_width
    shares = can_share_prompts(model, sharded)
    if batch.input_ids_B_L.shape[1] == width_C or width_C < 2 or not shares:
        return None
    if batch.vision_B is not None:  # the images' tokens are read with their pixels: one pass
        return None
    prompts = prompt_groups(batch)
    return prompts if len(prompts[0]) < len(batch) else None


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module,
    batch: TrainingBatch,
    temperature: float,
    rows_per_pass: int,
    sharded: bool = False,
) -> torch.Tensor:
    """`completion_logprobs` without grad, `rows_per_pass` rows at a time; shape B x C."""
    parts = []
    for start in range(0, len(batch), rows_per_pass):
        rows = list(range(start, min(start + rows_per_pass, len(batch))))
        part = batch.select(rows)
        logprobs_b_c = completion_logprobs(model, part, temperature, sharded=sharded).logprobs_B_C
        padded = logprobs_b_c.new_zeros(len(rows), batch.completion_width)  # on the model's device
        padded[:, : part.completion_width] = logprobs_b_c
        parts.append(padded)
    return torch.cat(parts)
