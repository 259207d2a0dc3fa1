"""The requests a transformers backend generates, and the rows that carry them while decoding.

A `Request` is one `generate` call; a `Row` is that request in the decoding batch: what the
model has read (`fed`), what it sampled, and how it samples. `draw_rows` samples the next
token of a batch of rows from their logits and lets the rows that stop finish; it is shared by
the prefill and by every decoding batch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList

from rollout.backends.sampling import counter_uniform, sample_tokens
from rollout.types import Completion, SamplingParams


@dataclass
class Request:
    """One `generate` call: its prompt, its sampling, and (once done) its result or error.

    `vision` holds the processor's tensors of the prompt's images (empty: a text prompt),
    `images` the pictures themselves (PIL), in order.
    """

    prompt_ids: list[int]
    params: SamplingParams
    vision: Mapping[str, Any] = field(default_factory=dict)
    images: Sequence[Any] = ()
    result: Completion | None = None
    error: BaseException | None = None
    abandoned: bool = False

    @property
    def done(self) -> bool:
        """Whether the request has its result or its error."""
        return self.result is not None or self.error is not None


@dataclass
class Row:
    """A request being generated: `fed` tokens are in the cache; `tokens[-1]` is not yet.

    Attributes:
        request: The request.
        sampling: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`.
        seed: Seeds the row's draws: through `generator` (a CPU generator) on the host
            sampling path, through `counter_uniform(seed, draw number)` on the device path.
        fed: The ids whose keys and values are in the cache, prompt first.
        tokens: The sampled ids; `logprobs` their sampler logprobs.
        processors: transformers' logits processors the row draws through
            (`generation_settings.row_processors`), or None: `sampling` alone decides.
        version: The weights version its next tokens are drawn with, or None when the
            backend counts no versions; `versions` holds each sampled token's.
    """

    request: Request
    sampling: dict[str, float]
    seed: int
    fed: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    processors: LogitsProcessorList | None = None
    version: int | None = None
    versions: list[int] = field(default_factory=list)
    _generator: torch.Generator | None = None

    @property
    def generator(self) -> torch.Generator:
        """The row's CPU generator (made on first use): the host path's uniform draws."""
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(self.seed)
        return self._generator

    @property
    def plain(self) -> bool:
        """Whether the row samples from softmax(logits / T) alone (no filter, no penalty)."""
        s = self.sampling
        unfiltered = s["top_k"] == 0 and s["top_p"] >= 1 and s["min_p"] == 0
        return unfiltered and s["repetition_penalty"] == 1 and self.processors is None

    def processed(self, logits_1_V: torch.Tensor) -> torch.Tensor:
        """The logits the row draws from: `processors` applied to its ids so far, (1, V)."""
        assert self.processors is not None  # asked only of rows that have them
        ids_1_L = torch.tensor([self.request.prompt_ids + self.tokens], device=logits_1_V.device)
        return self.processors(ids_1_L, logits_1_V.float())  # type: ignore[arg-type]  # legacy LongTensor/FloatTensor hints

    def take(self, token: int, logprob: float, stop_token_ids: Collection[int]) -> None:
        """Append a sampled token; finish (with the request's result) if the row stops there."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if self.version is not None:
            self.versions.append(self.version)
        stopped = token in stop_token_ids
        if stopped or len(self.tokens) >= self.request.params.max_tokens or self.request.abandoned:
            self.finished = True
            versions = self.versions if self.version is not None else None
            self.request.result = Completion(self.tokens, self.logprobs, stopped, versions)


def draw_rows(
    rows: list[Row],
    logits_B_V: torch.Tensor,
    stop_token_ids: Collection[int],
    counter_based: bool = False,
) -> None:
    """Sample each row's next token from its logits; a row that stops or runs out finishes."""
    tokens_B, logprobs_B = sample_rows(rows, logits_B_V, counter_based)
    for row, token, logprob in zip(rows, tokens_B.tolist(), logprobs_B.tolist(), strict=True):
        row.take(token, logprob, stop_token_ids)


def sample_rows(
    rows: list[Row], logits_B_V: torch.Tensor, counter_based: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's next token and its logprob, drawn with the row's own sampling settings.

    `counter_based` draws the uniforms with `counter_uniform(seed, draw number)` (the device
    path's generator) instead of the rows' CPU generators. The rows are not changed.
    """
    device = logits_B_V.device

    def column(name: str, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor([row.sampling[name] for row in rows], dtype=dtype, device=device)

    processed_B_V = None
    if rows[0].processors is not None:  # a backend's rows all have processors, or none
        processed_B_V = torch.cat(
            [row.processed(logits_B_V[b : b + 1]) for b, row in enumerate(rows)]
        )
    penalty_B = column("repetition_penalty")
    penalized = processed_B_V is None and bool((penalty_B != 1).any())  # else a processor
    if counter_based:
        uniform_B = counter_uniform(
            torch.tensor([row.seed for row in rows], device=device),
            torch.tensor([len(row.tokens) for row in rows], device=device),
        )
    else:
        uniform_B = torch.cat([torch.rand(1, generator=row.generator) for row in rows])
    return sample_tokens(
        logits_B_V.float(),
        column("temperature"),
        column("top_k", torch.long),
        column("top_p"),
        uniform_B=uniform_B,
        min_p_B=column("min_p"),
        penalty_B=penalty_B if penalized else None,
        seen_B_V=seen_tokens(rows, logits_B_V.shape[-1], device) if penalized else None,
        processed_B_V=processed_B_V,
    )


def seen_tokens(rows: list[Row], vocab: int, device: torch.device) -> torch.Tensor:
    """True at the tokens each row has read or drawn (what the repetition penalty hits)."""
    seen_B_V = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for b, row in enumerate(rows):
        seen_B_V[b, torch.tensor(row.fed + row.tokens, device=device)] = True
    return seen_B_V
