"""Teaching a model episodes by supervised steps, so a test has a real model that calls tools."""

from __future__ import annotations

import torch

from rollout import Episode


def teach(model, episodes: list[Episode], lr: float, steps: int, until_learned: bool) -> None:
    """Fit `model` to the episodes' sampled (mask-1) tokens, all in one batch per step.

    With `until_learned`, stop as soon as greedy decoding reproduces every sampled token (and
    fail if it never does); otherwise run all `steps` (demonstrations that disagree, such as
    one call shown with several arguments, teach a distribution, not a sequence). This is how
    a test gets a real model that calls tools; the engine then runs the real forward passes,
    parsing and tool calls on what the model actually generates.
    """
    rows = [row for episode in episodes for row in episode.rows]
    width = max(len(e.prompt_ids) + len(e.completion_ids) for e in rows)
    ids_B_L = torch.zeros(len(rows), width, dtype=torch.long)
    mask_B_L = torch.zeros(len(rows), width, dtype=torch.bool)
    for b, e in enumerate(rows):  # right-padded; padding is never a target
        ids_B_L[b, : len(e.prompt_ids) + len(e.completion_ids)] = torch.tensor(
            e.prompt_ids + e.completion_ids
        )
        mask_B_L[b, len(e.prompt_ids) : len(e.prompt_ids) + len(e.completion_ids)] = torch.tensor(
            e.loss_mask
        ).bool()
    keep = width - min(len(e.prompt_ids) for e in rows) + 1  # logits only where targets are
    targets_mask = mask_B_L[:, -keep + 1 :]
    targets = ids_B_L[:, -keep + 1 :][targets_mask]
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        logits = model(ids_B_L, logits_to_keep=keep).logits[:, :-1][targets_mask]
        loss = torch.nn.functional.cross_entropy(logits, targets)
        if until_learned and bool((logits.argmax(-1) == targets).all()) and loss.item() < 0.05:
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    else:
        if until_learned:
            raise AssertionError(f"the model did not learn the episodes in {steps} steps")
    model.eval()
