"""Sampling the next token of each row, and the sampler logprob the learner recomputes."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def sample_tokens(
    logits_B_V: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    generators: Sequence[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return it with its logprob.

    Rows with temperature 0 take the argmax. Other rows sample from softmax(logits / T) after
    top-k (k = 0: off) and top-p (p = 1: off) filtering, by the Gumbel-max trick with noise from
    the row's own generator, so a row's draw does not depend on the other rows of the batch.
    The returned logprob is log softmax(logits / T) at the token, before filtering: the same
    quantity a training forward pass computes from the same logits and temperature (T = 1 for
    greedy rows).

    Args:
        logits_B_V: Next-token logits, float32.
        temperature_B: Per-row temperature.
        top_k_B: Per-row top-k (int).
        top_p_B: Per-row top-p.
        generators: One random generator (or None: the global one) per row.

    Returns:
        tokens_B (long) and logprobs_B (float32).

    >>> logits = torch.tensor([[0.0, 2.0, 1.0]])
    >>> greedy = (torch.tensor([0.0]), torch.tensor([0]), torch.tensor([1.0]))
    >>> tokens, logprobs = sample_tokens(logits, *greedy)
    >>> tokens.tolist(), round(logprobs.item(), 4)
    ([1], -0.4076)

    """
    greedy_B = temperature_B == 0
    scaled_B_V = logits_B_V / torch.where(greedy_B, 1.0, temperature_B).unsqueeze(-1)
    logprobs_B_V = torch.log_softmax(scaled_B_V, dim=-1)
    filtered_B_V = _filter_top_p(_filter_top_k(scaled_B_V, top_k_B), top_p_B)
    noise_B_V = _gumbel_noise(logits_B_V, generators)
    drawn_B = (filtered_B_V + noise_B_V).argmax(dim=-1)
    tokens_B = torch.where(greedy_B, scaled_B_V.argmax(dim=-1), drawn_B)
    return tokens_B, logprobs_B_V.gather(-1, tokens_B.unsqueeze(-1))[:, 0]


def _gumbel_noise(
    logits_B_V: torch.Tensor, generators: Sequence[torch.Generator | None] | None
) -> torch.Tensor:
    """Gumbel(0, 1) noise, row by row from each row's generator: argmax(x + noise) ~ softmax(x)."""
    rows = len(logits_B_V)
    generators = generators or [None] * rows
    vocab = logits_B_V.shape[-1]
    uniform_B_V = torch.stack(
        [torch.rand(vocab, generator=g, device=logits_B_V.device) for g in generators]
    )
    tiny = torch.finfo(uniform_B_V.dtype).tiny
    return -torch.log(-torch.log(uniform_B_V.clamp(min=tiny)))


def _filter_top_k(logits_B_V: torch.Tensor, top_k_B: torch.Tensor) -> torch.Tensor:
    if not bool((top_k_B > 0).any()):
        return logits_B_V
    vocab = logits_B_V.shape[-1]
    k_B = torch.where(top_k_B > 0, top_k_B.clamp(max=vocab), vocab)
    kth_B = logits_B_V.sort(dim=-1, descending=True).values.gather(-1, (k_B - 1).unsqueeze(-1))
    return logits_B_V.masked_fill(logits_B_V < kth_B, float("-inf"))


def _filter_top_p(logits_B_V: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    if not bool((top_p_B < 1).any()):
        return logits_B_V
    sorted_B_V, order_B_V = logits_B_V.sort(dim=-1, descending=True)
    probs_B_V = torch.softmax(sorted_B_V, dim=-1)
    # Drop a token when the tokens ranked above it already hold top_p of the mass.
    drop_B_V = probs_B_V.cumsum(dim=-1) - probs_B_V >= top_p_B.unsqueeze(-1)
    drop_B_V = drop_B_V.scatter(-1, order_B_V, drop_B_V)
    return logits_B_V.masked_fill(drop_B_V, float("-inf"))
