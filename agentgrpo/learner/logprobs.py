"""Per-token logprobs of a batch's completions under a model: the learner's view of the policy."""

from __future__ import annotations

from typing import NamedTuple

import torch

from agentgrpo.learner.batch import TrainingBatch


class PolicyForward(NamedTuple):
    """What `completion_logprobs` computes in one forward pass.

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
    """Logprob of each completion token, from one forward pass over prompt and completion.

    Logits are divided by the sampling `temperature` first, so the values are comparable with
    the sampler's (see `rollout.sampling`). Only the last C + 1 positions' logits are computed.
    `with_aux_loss` asks a mixture-of-experts model for its router logits, so that it returns
    its load-balancing loss (over the whole sequences, prompts included).
    """
    width_C = batch.completion_width
    router = {"output_router_logits": True} if with_aux_loss else {}
    out = model(
        input_ids=batch.input_ids_B_L,
        attention_mask=batch.attention_mask_B_L,
        position_ids=batch.position_ids_B_L,
        logits_to_keep=width_C + 1,
        use_cache=False,
        **router,
    )
    logits_B_C_V = out.logits[:, :-1].float() / (temperature or 1.0)
    targets_B_C = batch.completion_ids_B_C
    logprobs_B_C = logits_B_C_V.gather(-1, targets_B_C.unsqueeze(-1)).squeeze(-1)
    logprobs_B_C = logprobs_B_C - torch.logsumexp(logits_B_C_V, dim=-1)
    aux_loss = out.aux_loss if with_aux_loss else None
    return PolicyForward(logprobs_B_C, logits_B_C_V if with_logits else None, aux_loss)


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
        padded = torch.zeros(len(rows), batch.completion_width)
        padded[:, : part.completion_width] = logprobs_b_c
        parts.append(padded)
    return torch.cat(parts)
