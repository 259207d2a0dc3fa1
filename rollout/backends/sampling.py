"""Sampling the next token of each row, and the sampler logprob the learner recomputes."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

_BLOCK = 256


def sample_tokens(
    logits_B_V: torch.Tensor,
    temperature_B: torch.Tensor,
    top_k_B: torch.Tensor,
    top_p_B: torch.Tensor,
    generators: Sequence[torch.Generator | None] | None = None,
    *,
    uniform_B: torch.Tensor | None = None,
    min_p_B: torch.Tensor | None = None,
    penalty_B: torch.Tensor | None = None,
    seen_B_V: torch.Tensor | None = None,
    processed_B_V: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return it with its logprob.

    The returned logprob is log softmax(logits / T) at the token, before any penalty or
    filter: the quantity a training forward pass computes from the same logits and
    temperature (T = 1 for greedy rows). The draw itself first applies the repetition penalty
    (`penalty_B` > 1 divides the positive logits of the tokens in `seen_B_V` and multiplies
    their negative ones, as transformers and vLLM do), then top-k (k = 0: off), top-p (p = 1:
    off) and min-p (0: off; drops tokens less likely than min_p times the likeliest). Rows with
    temperature 0 take the argmax; the others invert the filtered distribution's cumulative sum
    at one uniform draw from the row's own generator (or `uniform_B`), so a row's token does not
    depend on the other rows of the batch.

    Args:
        logits_B_V: Next-token logits, float32.
        temperature_B: Per-row temperature.
        top_k_B: Per-row top-k (int).
        top_p_B: Per-row top-p.
        generators: One random generator (or None: the global one) per row.
        uniform_B: The rows' uniform draws in [0, 1), in place of `generators` (e.g. from
            `counter_uniform`, which needs no generator objects and stays on the device).
        min_p_B: Per-row min-p, or None (off).
        penalty_B: Per-row repetition penalty, or None (off); needs `seen_B_V`.
        seen_B_V: True at the tokens each row has seen (its prompt and its samples so far).
        processed_B_V: The logits each row draws from, already penalised, scaled and filtered
            (transformers' logits processors, `generation_settings.row_processors`), in place
            of the penalty and filters above; greedy rows take its argmax.

    Returns:
        tokens_B (long) and logprobs_B (float32).

    >>> logits = torch.tensor([[0.0, 2.0, 1.0]])
    >>> greedy = (torch.tensor([0.0]), torch.tensor([0]), torch.tensor([1.0]))
    >>> tokens, logprobs = sample_tokens(logits, *greedy)
    >>> tokens.tolist(), round(logprobs.item(), 4)
    ([1], -0.4076)

    """
    greedy_B = temperature_B == 0
    divisor_B_1 = torch.where(greedy_B, 1.0, temperature_B).unsqueeze(-1)
    unpenalized_B_V = logits_B_V / divisor_B_1
    logprobs_B_V = torch.log_softmax(unpenalized_B_V, dim=-1)
    scaled_B_V = unpenalized_B_V
    if processed_B_V is not None:
        scaled_B_V = filtered_B_V = processed_B_V.float()
    else:
        if penalty_B is not None and seen_B_V is not None:
            scaled_B_V = _penalize(logits_B_V, penalty_B, seen_B_V) / divisor_B_1
        filtered_B_V = _filter_top_p(_filter_top_k(scaled_B_V, top_k_B), top_p_B)
        if min_p_B is not None:
            filtered_B_V = _filter_min_p(filtered_B_V, min_p_B)
    # A batch drawn from the plain distribution reuses the logprobs: no second softmax.
    unchanged = filtered_B_V is unpenalized_B_V
    probs_B_V = logprobs_B_V.exp() if unchanged else torch.softmax(filtered_B_V, dim=-1)
    if uniform_B is None:
        rows = len(probs_B_V)
        uniform_B = torch.cat([torch.rand(1, generator=g) for g in generators or [None] * rows])
    tokens_B = _inverse_cdf(probs_B_V, uniform_B.to(probs_B_V.device))
    if bool(greedy_B.any()):
        tokens_B = torch.where(greedy_B, scaled_B_V.argmax(dim=-1), tokens_B)
    return tokens_B, logprobs_B_V.gather(-1, tokens_B.unsqueeze(-1))[:, 0]


def _inverse_cdf(probs_B_V: torch.Tensor, uniform_B: torch.Tensor) -> torch.Tensor:
    """One token per row of `probs_B_V` (unnormalised is fine), by inverting its cumulative sum.

    Row b takes the token where the cumulative mass first exceeds `uniform_B[b]` of the total.

    The vocabulary is cut into blocks of `_BLOCK` tokens: a row's uniform picks a block by the
    blocks' cumulative masses, then a token inside it, so no cumulative sum runs over the whole
    vocabulary (on a CPU that scan costs more than the rest of sampling). `right=True` never
    lands on a zero-mass block or token; a rounding error that would still push past the
    block's end (a zero-mass token) falls back to the block's last token of nonzero mass.
    """
    rows, vocab = probs_B_V.shape
    if vocab % _BLOCK:
        probs_B_V = nn.functional.pad(probs_B_V, (0, -vocab % _BLOCK))
    blocks_B_N_K = probs_B_V.view(rows, -1, _BLOCK)
    cdf_B_N = blocks_B_N_K.sum(dim=-1).cumsum(dim=-1)
    target_B_1 = uniform_B.unsqueeze(-1) * cdf_B_N[:, -1:]
    block_B_1 = torch.searchsorted(cdf_B_N, target_B_1, right=True).clamp(max=cdf_B_N.shape[1] - 1)
    before_B_1 = torch.where(block_B_1 > 0, cdf_B_N.gather(-1, (block_B_1 - 1).clamp(min=0)), 0.0)
    inner_B_K = blocks_B_N_K[torch.arange(rows, device=probs_B_V.device), block_B_1[:, 0]]
    inner_B_1 = torch.searchsorted(inner_B_K.cumsum(dim=-1), target_B_1 - before_B_1, right=True)
    positions_B_K = torch.arange(_BLOCK, device=probs_B_V.device).expand(rows, -1)
    last_nonzero_B_1 = torch.where(inner_B_K > 0, positions_B_K, 0).amax(dim=-1, keepdim=True)
    return (block_B_1 * _BLOCK + torch.minimum(inner_B_1, last_nonzero_B_1))[:, 0]


def sample_plain(
    logits_B_V: torch.Tensor, temperature_B: torch.Tensor, uniform_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_tokens` for rows without filters or penalty, with no host round trip.

    The same tokens and logprobs as `sample_tokens(..., uniform_B=uniform_B)` with top-k,
    top-p, min-p and the penalty off, but every operation stays on the logits' device and no
    value is read back, so a CUDA graph can capture it.
    """
    greedy_B = temperature_B == 0
    divisor_B_1 = torch.where(greedy_B, 1.0, temperature_B).unsqueeze(-1)
    logprobs_B_V = torch.log_softmax(logits_B_V / divisor_B_1, dim=-1)
    drawn_B = _inverse_cdf(logprobs_B_V.exp(), uniform_B)
    tokens_B = torch.where(greedy_B, logits_B_V.argmax(dim=-1), drawn_B)
    return tokens_B, logprobs_B_V.gather(-1, tokens_B.unsqueeze(-1))[:, 0]


_MASK32 = 0xFFFFFFFF
_MIX32 = 0x45D9F3B  # below 2**27: a product with a 32-bit value stays below 2**63


def counter_uniform(seed_B: torch.Tensor, counter_B: torch.Tensor) -> torch.Tensor:
    """A uniform draw in [0, 1) per row, a function of the row's seed and draw number alone.

    A counter-based generator: row b's value depends on `(seed_B[b], counter_B[b])` only, so a
    seeded request draws the same numbers whatever is batched with it, and no generator object
    or host round trip is needed (a CUDA graph can capture it). Integer hashing on int64
    tensors whose values stay below 2**32 before each multiply; 24 bits of resolution, as a
    float32 uniform has.

    Args:
        seed_B: Each row's seed (int64; its 64 bits are all used).
        counter_B: Each row's draw number (int64, below 2**32): 0 for its first token.

    Returns:
        uniform_B: float32 in [0, 1), on the inputs' device.

    >>> u = counter_uniform(torch.tensor([7, 7, 8]), torch.tensor([0, 1, 0]))
    >>> bool(((u >= 0) & (u < 1)).all()), len(set(u.tolist()))
    (True, 3)

    """
    low_B = seed_B & _MASK32
    high_B = (seed_B >> 32) & _MASK32
    mixed_B = _mix32(_mix32(low_B ^ _mix32(high_B)) ^ (counter_B & _MASK32))
    return (mixed_B >> 8).to(torch.float32) / float(1 << 24)


def _mix32(x_B: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (values below 2**32 in int64, so no product overflows)."""
    x_B = (((x_B >> 16) ^ x_B) * _MIX32) & _MASK32
    x_B = (((x_B >> 16) ^ x_B) * _MIX32) & _MASK32
    return (x_B >> 16) ^ x_B


def _penalize(
    logits_B_V: torch.Tensor, penalty_B: torch.Tensor, seen_B_V: torch.Tensor
) -> torch.Tensor:
    penalty_B_1 = penalty_B.unsqueeze(-1)
    penalized_B_V = torch.where(logits_B_V > 0, logits_B_V / penalty_B_1, logits_B_V * penalty_B_1)
    return torch.where(seen_B_V, penalized_B_V, logits_B_V)


def _filter_min_p(logits_B_V: torch.Tensor, min_p_B: torch.Tensor) -> torch.Tensor:
    if not bool((min_p_B > 0).any()):
        return logits_B_V
    probs_B_V = torch.softmax(logits_B_V, dim=-1)
    floor_B_1 = min_p_B.unsqueeze(-1) * probs_B_V.max(dim=-1, keepdim=True).values
    return logits_B_V.masked_fill(probs_B_V < floor_B_1, float("-inf"))


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
