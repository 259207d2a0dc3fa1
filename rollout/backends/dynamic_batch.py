"""The decoding batch on a CPU: a growing cache of left-padded rows, one token a step.

Every running row's keys and values sit side by side in one transformers `DynamicCache`,
left-padded to a common width, so each row's positions are contiguous and right-aligned. A step
feeds every row its last token and samples the next on the host with the row's own generator.
Rows join with the keys and values of their prompt and leave with those of what they read;
the cache is then remade a layer at a time (`kv_cache.rebuilt`), never held twice over, and
the freed layers go back to the system (`host_memory`). On a CPU this beats a preallocated
cache: nothing is read or written past a row's end.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from transformers import DynamicCache

from rollout.backends import kv_cache
from rollout.backends.generation_rows import Row, draw_rows
from rollout.backends.host_memory import give_back_freed_memory
from rollout.backends.kv_cache import KV


class DynamicBatch:
    """The running rows of a transformers backend, decoded one token a step.

    Args:
        model: The causal LM (the policy itself); its device is read at every step.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.rows: list[Row] = []
        self._cache: DynamicCache | None = None
        self._mask_B_T: torch.Tensor | None = None

    def clear(self) -> None:
        """Drop every row (after a failed step)."""
        self.rows, self._cache, self._mask_B_T = [], None, None

    def join(self, prefilled: list[tuple[Row, KV]]) -> None:
        """Put freshly prefilled rows into the batch, everything left-padded."""
        if not prefilled:
            return
        running = kv_cache.taken_layers(self._cache) if self._cache is not None else []
        widths = [len(row.fed) for row, _ in prefilled]
        width = max([*widths, kv_cache.width(running) if running else 0])
        masks = [left_padded_ones(w, width) for w in widths]
        parts_by_layer = [[kv[i] for _, kv in prefilled] for i in range(len(prefilled[0][1]))]
        if running and self._mask_B_T is not None:
            pairs = zip(running, parts_by_layer, strict=True)
            parts_by_layer = [[layer, *parts] for layer, parts in pairs]
            masks.insert(0, _pad_mask(self._mask_B_T.cpu(), width))
            running.clear()  # parts_by_layer is their only holder now
        self._cache = kv_cache.rebuilt(parts_by_layer, lambda parts: kv_cache.stacked(parts, width))
        self._mask_B_T = torch.cat(masks).to(_device(self.model))
        self.rows.extend(row for row, _ in prefilled)
        self._give_back_host_memory()

    def decode(self, stop_token_ids: Collection[int]) -> list[tuple[Row, KV]]:
        """Feed every row its last token and draw the next; return the rows that finished.

        Each finished row comes with the keys and values of what it read (`row.fed`), for the
        prefix cache; it has left the batch.
        """
        next_logits_B_V = self._read_last_tokens()
        for row in self.rows:
            row.fed.append(row.tokens[-1])
        draw_rows(self.rows, next_logits_B_V, stop_token_ids)
        return self._release([b for b, row in enumerate(self.rows) if row.finished])

    def _read_last_tokens(self) -> torch.Tensor:
        """Feed every row its last token (the cache grows a position); the next token's logits."""
        device = _device(self.model)
        assert self._mask_B_T is not None
        self._mask_B_T = torch.cat([self._mask_B_T, self._mask_B_T.new_ones(len(self.rows), 1)], 1)
        out = self.model(
            input_ids=torch.tensor([[row.tokens[-1]] for row in self.rows], device=device),
            attention_mask=self._mask_B_T,
            position_ids=torch.tensor([[len(row.fed)] for row in self.rows], device=device),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache = out.past_key_values
        return out.logits[:, -1, :]

    def _release(self, finished: list[int]) -> list[tuple[Row, KV]]:
        """Take the finished rows, with the keys and values of what they read, out of the batch."""
        if not finished:
            return []
        assert self._cache is not None and self._mask_B_T is not None
        running = kv_cache.taken_layers(self._cache)
        self._cache = None
        total = kv_cache.width(running)
        released = []
        for b in finished:
            fed = self.rows[b].fed
            read = kv_cache.take_columns(running, slice(b, b + 1), total - len(fed))
            released.append((self.rows[b], read))
        kept = [b for b in range(len(self.rows)) if b not in set(finished)]
        self.rows = [self.rows[b] for b in kept]
        if not kept:
            self._mask_B_T = None
            self._give_back_host_memory()
            return released
        start = total - max(len(row.fed) for row in self.rows)  # drop all-padding columns
        index = torch.tensor(kept)
        self._cache = kv_cache.rebuilt(
            running, lambda layer: (layer[0][index, :, start:], layer[1][index, :, start:])
        )
        self._mask_B_T = self._mask_B_T[kept, start:]
        self._give_back_host_memory()
        return released

    def _give_back_host_memory(self) -> None:
        """On a CPU, hand the old cache's freed layers back to the system (`host_memory`)."""
        if _device(self.model).type == "cpu":
            give_back_freed_memory()


def left_padded_ones(ones: int, width: int) -> torch.Tensor:
    """A one-row attention mask: `width - ones` padding positions, then `ones` real ones."""
    mask_1_W = torch.zeros(1, width, dtype=torch.long)
    mask_1_W[:, width - ones :] = 1
    return mask_1_W


def _pad_mask(mask_B_T: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(mask_B_T, (width - mask_B_T.shape[1], 0))


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device  # what transformers' `model.device` reads
