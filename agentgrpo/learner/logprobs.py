"""Per-token logprobs of a batch's completions under a model: the learner's view of the policy."""

from __future__ import annotations

from typing import NamedTuple

import torch

from agentgrpo.learner.batch import TrainingBatch
from agentgrpo.learner.shared_prompt import can_share_prompts, prompt_groups, shared_prompt_logits


class PolicyForward(NamedTuple):
    """What `completion_logprobs` computes.

    Attributes:
        logprobs_B_C: Logprob of each completion token (with grad when the model requires it).
        logits_B_C_V: The temperature-scaled logits, when asked for (for entropy), else None.
        aux_loss: A mixture-of-experts model's load-balancing loss, when asked for, else None.
    """

    logprobs_B_C: torch.Tensor
    logits_B_C_V: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


def completion_logprobs(
    model: torch.nn.Module,
    batch: TrainingBatch,
    temperature: float,
    with_logits: bool = False,
    with_aux_loss: bool = False,
) -> PolicyForward:
    """Logprob of each completion token under `model`.

    Logits are divided by the sampling `temperature` first, so the values are comparable with
    the sampler's (see `rollout.sampling`). Only the completion positions' logits are computed.
    When rows share a prompt (a GRPO group), each distinct prompt runs through the model once
    (`shared_prompt_logits`); otherwise, and whenever that could change the results, one pass
    runs over prompts and completions (`one_pass_logits`). Both give the same logprobs, logits
    and gradients up to float rounding. `with_aux_loss` asks a mixture-of-experts model for
    its load-balancing loss, over the whole sequences, prompts included (so always one pass).
    """
    prompts = None if with_aux_loss else _shared_prompts(model, batch)
    if prompts is not None:
        logits_B_C_V, aux_loss = shared_prompt_logits(model, batch, prompts), None
    else:
        logits_B_C_V, aux_loss = one_pass_logits(model, batch, with_aux_loss)
    logits_B_C_V = logits_B_C_V.float()
    if temperature and temperature != 1.0:
        logits_B_C_V = logits_B_C_V / temperature
    logprobs_B_C = logprobs_from_logits(logits_B_C_V, batch.completion_ids_B_C)
    return PolicyForward(logprobs_B_C, logits_B_C_V if with_logits else None, aux_loss)


def one_pass_logits(
    model: torch.nn.Module, batch: TrainingBatch, with_aux_loss: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits predicting each completion token (B x C x V) from one pass over whole rows.

    Returns the logits and, with `with_aux_loss`, the model's load-balancing loss (else None).
    """
    router = {"output_router_logits": True} if with_aux_loss else {}
    out = model(
        input_ids=batch.input_ids_B_L,
        attention_mask=batch.attention_mask_B_L,
        position_ids=batch.position_ids_B_L,
        logits_to_keep=batch.completion_width + 1,
        use_cache=False,
        **router,
    )
    return out.logits[:, :-1], out.aux_loss if with_aux_loss else None


def logprobs_from_logits(logits_B_C_V: torch.Tensor, targets_B_C: torch.Tensor) -> torch.Tensor:
    """Log-softmax of the logits, read at the target ids: B x C."""
    picked_B_C = logits_B_C_V.gather(-1, targets_B_C.unsqueeze(-1)).squeeze(-1)
    return picked_B_C - torch.logsumexp(logits_B_C_V, dim=-1)


def _shared_prompts(
    model: torch.nn.Module, batch: TrainingBatch
) -> tuple[list[int], torch.Tensor] | None:
    """`prompt_groups(batch)` where sharing prompts is valid and pays, else None.

    It pays when rows share prompts; it needs prompt columns, at least 2 completion columns
    (the first completion token's logits come from the prompt pass) and a model it suits.
    """
    width_C = batch.completion_width
    if batch.input_ids_B_L.shape[1] == width_C or width_C < 2 or not can_share_prompts(model):
        return None
    prompts = prompt_groups(batch)
    return prompts if len(prompts[0]) < len(batch) else None


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module, batch: TrainingBatch, temperature: float, rows_per_pass: int
) -> torch.Tensor:
    """`completion_logprobs` without grad, `rows_per_pass` rows at a time; shape B x C."""
    parts = []
    for start in range(0, len(batch), rows_per_pass):
        rows = list(range(start, min(start + rows_per_pass, len(batch))))
        part = batch.select(rows)
        logprobs_b_c = completion_logprobs(model, part, temperature).logprobs_B_C
        padded = logprobs_b_c.new_zeros(len(rows), batch.completion_width)  # on the model's device
        padded[:, : part.completion_width] = logprobs_b_c
        parts.append(padded)
    return torch.cat(parts)
