"""Episodes as training tensors: prompts left-padded, completions right-padded, masks kept.

Laying a batch out as [left-padded prompt | right-padded completion] puts every completion at the
same columns, so one forward pass scores all of them with `logits[:, P - 1 : -1]`. Each row of
an episode (`rollout.EpisodeRow`; a forked episode has several) is one batch row; `episode_B`
says which episode each batch row belongs to, so the loss can treat an episode's rows as one
sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from rollout.types import Episode


@dataclass(frozen=True)
class TrainingBatch:
    """A batch of B episode rows, with P prompt and C completion columns (L = P + C).

    Attributes:
        input_ids_B_L: Prompt then completion token ids.
        attention_mask_B_L: 1 on real tokens, 0 on padding.
        position_ids_B_L: Positions counted over real tokens only (as at generation).
        loss_mask_B_C: 1 where a completion token counts in the loss: sampled by the policy,
            and not dropped (e.g. by `mask_truncated_completions`).
        sampler_logprobs_B_C: The generator's logprob of each completion token (0 where masked).
        advantages_B: One advantage per row: its episode's.
        episode_B: The index of each row's episode in the round (long); rows of one episode
            are always in the same batch (`select_episodes`).
        old_logprobs_B_C: Logprobs of the policy that generated the batch, when they can differ
            from the current policy's (several updates per generation); else None.
        ref_logprobs_B_C: Reference-model logprobs when `beta > 0`; else None.
        num_items: Active (mask-1) tokens of the optimizer step this batch belongs to, summed
            over all processes: the normaliser of the token-level losses.
        vision_B: A vision-language model's batch: each row's image tensors
            (`rollout.EpisodeRow.vision_inputs`, empty for a row without images), which every
            forward over the rows takes; None for a text batch.
        advantages_B_C: Per-token advantages, which the loss takes in place of
            `advantages_B` (credit per turn, `turn_advantage`); None: each row's `advantages_B`.
    """

    input_ids_B_L: torch.Tensor
    attention_mask_B_L: torch.Tensor
    position_ids_B_L: torch.Tensor
    loss_mask_B_C: torch.Tensor
    sampler_logprobs_B_C: torch.Tensor
    advantages_B: torch.Tensor
    episode_B: torch.Tensor
    old_logprobs_B_C: torch.Tensor | None = None
    ref_logprobs_B_C: torch.Tensor | None = None
    num_items: float = 0.0
    vision_B: tuple[Mapping[str, torch.Tensor], ...] | None = None
    advantages_B_C: torch.Tensor | None = None

    @property
    def token_advantages(self) -> torch.Tensor:
        """advantages_B_C when set, else advantages_B: what the policy term multiplies."""
        return self.advantages_B if self.advantages_B_C is None else self.advantages_B_C

    @property
    def completion_width(self) -> int:
        """C: the number of completion columns."""
        return self.loss_mask_B_C.shape[1]

    @property
    def completion_ids_B_C(self) -> torch.Tensor:
        """The completion columns of `input_ids_B_L`."""
        return self.input_ids_B_L[:, -self.completion_width :]

    def __len__(self) -> int:
        return self.input_ids_B_L.shape[0]

    def to(self, device: torch.device | str) -> TrainingBatch:
        """The same batch with every tensor on `device` (itself when they are there already)."""
        moved: dict[str, Any] = {
            f.name: value.to(device)
            for f in fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        if self.vision_B is not None:
            moved["vision_B"] = tuple(
                {key: value.to(device) for key, value in row.items()} for row in self.vision_B
            )
        return replace(self, **moved)

    def select_episodes(self, episodes: Sequence[int]) -> TrainingBatch:
        """Every row of the given episodes (values of `episode_B`), in the order given."""
        rows_of: dict[int, list[int]] = {}
        for row, episode in enumerate(self.episode_B.tolist()):
            rows_of.setdefault(episode, []).append(row)
        return self.select([row for episode in episodes for row in rows_of[episode]])

    @property
    def episodes(self) -> list[int]:
        """The distinct values of `episode_B`, in the order their first rows appear."""
        return list(dict.fromkeys(self.episode_B.tolist()))

    def select(self, rows: torch.Tensor | Sequence[int]) -> TrainingBatch:
        """The given rows, with the padding columns no selected row needs trimmed away."""
        taken: dict[str, Any] = {
            f.name: value[rows]
            if isinstance(value := getattr(self, f.name), torch.Tensor)
            else value
            for f in fields(self)
        }
        if self.vision_B is not None:
            indices = rows.tolist() if isinstance(rows, torch.Tensor) else rows
            taken["vision_B"] = tuple(self.vision_B[int(i)] for i in indices)
        picked = TrainingBatch(**taken)
        real_B_L = picked.attention_mask_B_L.bool()
        first = int(real_B_L.any(0).nonzero()[0])  # leftmost column some row uses
        completion_used = picked.attention_mask_B_L[:, -self.completion_width :].any(0)
        last = int(completion_used.nonzero()[-1]) + 1 if completion_used.any() else 1  # C >= 1
        return picked._trim(first, self.completion_width - last)

    def _trim(self, left: int, right: int) -> TrainingBatch:
        """Drop `left` leading prompt columns and `right` trailing completion columns."""
        end_L = self.input_ids_B_L.shape[1] - right
        end_C = self.completion_width - right
        changes: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                changes[f.name] = (
                    value[:, left:end_L] if f.name.endswith("_B_L") else value[:, :end_C]
                )
        return replace(self, **changes)


def collate_episodes(
    episodes: Sequence[Episode],
    advantages_N: torch.Tensor,
    pad_token_id: int,
    mask_truncated_completions: bool = False,
) -> TrainingBatch:
    """Lay episodes out as a `TrainingBatch`, one batch row per episode row.

    The rows come in episode order, each episode's rows in order; `episode_B` holds the
    episode's position in `episodes` and `advantages_B` its advantage. No old/reference
    logprobs, num_items 0.

    Args:
        episodes: The N episodes, in batch order.
        advantages_N: Their advantages.
        pad_token_id: Id written in padding positions (never attended to, never trained on).
        mask_truncated_completions: Drop cut-off episodes (`finish.truncated`), every row of
            them, from the loss.
    """
    rows = [(n, row) for n, episode in enumerate(episodes) for row in episode.rows]
    width_P = max(len(row.prompt_ids) for _, row in rows)
    width_C = max(max(len(row.completion_ids) for _, row in rows), 1)
    ids_B_L = torch.full((len(rows), width_P + width_C), pad_token_id, dtype=torch.long)
    attention_B_L = torch.zeros((len(rows), width_P + width_C), dtype=torch.long)
    loss_mask_B_C = torch.zeros((len(rows), width_C))
    sampler_B_C = torch.zeros((len(rows), width_C))
    for b, (n, row) in enumerate(rows):
        prompt, completion = row.prompt_ids, row.completion_ids
        start, end = width_P - len(prompt), width_P + len(completion)
        ids_B_L[b, start:end] = torch.tensor(prompt + completion)
        attention_B_L[b, start:end] = 1
        if not (mask_truncated_completions and episodes[n].finish.truncated):
            loss_mask_B_C[b, : len(completion)] = torch.tensor(row.loss_mask, dtype=torch.float)
        sampler_B_C[b, : len(completion)] = torch.tensor(row.sampler_logprobs)
    positions_B_L = (attention_B_L.cumsum(-1) - 1).clamp(min=0)
    episode_B = torch.tensor([n for n, _ in rows], dtype=torch.long)
    with_images = any(row.vision_inputs for _, row in rows)
    return TrainingBatch(
        ids_B_L,
        attention_B_L,
        positions_B_L,
        loss_mask_B_C,
        sampler_B_C,
        advantages_N.float()[episode_B],
        episode_B,
        vision_B=tuple(row.vision_inputs for _, row in rows) if with_images else None,
    )
