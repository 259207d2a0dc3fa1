"""Per-token logprobs of a batch's completions under a model: the learner's view of the policy."""

from __future__ import annotations

import torch

from agentgrpo.learner.batch import TrainingBatch


def completion_logprobs(
    model: torch.nn.Module, batch: TrainingBatch, temperature: float, with_logits: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each completion token, from one forward pass over prompt and completion.

    Logits are divided by the sampling `temperature` first, so the values are comparable with
    the sampler's (see `rollout.sampling`). Only the last C + 1 positions' logits are computed.

    Returns:
        logprobs_B_C (with grad when the model requires it), and the scaled logits_B_C_V when
        `with_logits` (for entropy), else None.
    """
    width_C = batch.completion_width
    out = model(
        input_ids=batch.input_ids_B_L,
        attention_mask=batch.attention_mask_B_L,
        position_ids=batch.position_ids_B_L,
        logits_to_keep=width_C + 1,
        use_cache=False,
    )
    logits_B_C_V = out.logits[:, :-1].float() / (temperature or 1.0)
    targets_B_C = batch.completion_ids_B_C
    logprobs_B_C = logits_B_C_V.gather(-1, targets_B_C.unsqueeze(-1)).squeeze(-1)
    logprobs_B_C = logprobs_B_C - torch.logsumexp(logits_B_C_V, dim=-1)
    return logprobs_B_C, (logits_B_C_V if with_logits else None)


@torch.no_grad()
def batched_logprobs(
    model: torch.nn.Module, batch: TrainingBatch, temperature: float, rows_per_pass: int
) -> torch.Tensor:
    """`completion_logprobs` without grad, `rows_per_pass` rows at a time; shape B x C."""
    parts = []
    for start in range(0, len(batch), rows_per_pass):
        rows = list(range(start, min(start + rows_per_pass, len(batch))))
        part = batch.select(rows)
        logprobs_b_c, _ = completion_logprobs(model, part, temperature)
        padded = torch.zeros(len(rows), batch.completion_width)
        padded[:, : part.completion_width] = logprobs_b_c
        parts.append(padded)
    return torch.cat(parts)
