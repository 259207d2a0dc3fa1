"""Keys and values a transformers model computed, kept to prefill only what is new.

`KV` is a model's attention cache as plain tensors: per layer `(keys, values)`, each
`[rows, heads, T, head_dim]`. `PrefixCache` keeps the KV of token sequences the model has read
(one row each); a later prompt that starts with such a sequence reuses its keys and values
(causal attention: the KV of the first n tokens depends on those n tokens only). The batch
helpers lay rows of different lengths side by side, left-padded, as the decoding batch holds
them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

import torch
from torch import nn
from transformers import DynamicCache

KV = tuple[tuple[torch.Tensor, torch.Tensor], ...]


def kv_of(cache: DynamicCache) -> KV:
    """The tensors of a `DynamicCache` (no copy)."""
    return tuple((keys, values) for keys, values, *_ in cache)


def cache_of(kv: KV) -> DynamicCache:
    """A new `DynamicCache` holding a copy of `kv`."""
    return DynamicCache(ddp_cache_data=list(kv))


def first_positions(kv: KV, count: int) -> KV:
    """Views of the first `count` positions."""
    return tuple((keys[:, :, :count], values[:, :, :count]) for keys, values in kv)


def take_columns(kv: KV, rows: slice | Sequence[int], start: int, end: int | None = None) -> KV:
    """The given rows' positions `start:end`, as tensors of their own (not views)."""
    index = rows if isinstance(rows, slice) else torch.tensor(list(rows))
    return tuple(
        (keys[index, :, start:end].clone(), values[index, :, start:end].clone())
        for keys, values in kv
    )


def left_pad(kv: KV, width: int) -> KV:
    """`kv` widened to `width` positions with zeros on the left."""
    return tuple(
        (_pad_positions(keys, width), _pad_positions(values, width)) for keys, values in kv
    )


def stack_rows(parts: Sequence[KV]) -> KV:
    """The rows of every part, one after the other (all parts have the same width)."""
    layers = range(len(parts[0]))
    return tuple(
        (torch.cat([part[i][0] for part in parts]), torch.cat([part[i][1] for part in parts]))
        for i in layers
    )


def width(kv: KV) -> int:
    """The number of positions `kv` holds."""
    return kv[0][0].shape[-2]


def _pad_positions(tensor_R_H_T_D: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - tensor_R_H_T_D.shape[-2]
    return nn.functional.pad(tensor_R_H_T_D, (0, 0, missing, 0)) if missing else tensor_R_H_T_D


class PrefixCache:
    """The KV of token sequences a model has read, least recently used first out.

    Adding a sequence drops every kept sequence it extends (the new entry serves their
    prefixes too), so an episode keeps one entry however many turns it has. All entries are
    valid for one set of weights only: `clear` them when the weights change.

    Args:
        max_tokens: The most positions kept over all entries (0: keep nothing).

    """

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[Hashable, ...], KV] = OrderedDict()

    @property
    def tokens(self) -> int:
        """Positions kept now."""
        return sum(len(tokens) for tokens in self._entries)

    def longest_prefix(self, token_ids: Sequence[Hashable]) -> tuple[int, KV | None]:
        """The most leading tokens of `token_ids` some entry holds, and that entry's KV.

        The KV may be longer than the shared prefix: use its first n positions.
        """
        best, best_key = 0, None
        for key in self._entries:
            shared = shared_prefix_length(key, token_ids)
            if shared > best:
                best, best_key = shared, key
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        return best, self._entries[best_key]

    def add(self, token_ids: Sequence[Hashable], kv: KV) -> None:
        """Keep the KV (one row, `len(token_ids)` positions) of `token_ids`.

        Ids, or keys standing for them (`image_prefixes.prefix_key`: a picture's tokens paired
        with its digest).
        """
        key = tuple(token_ids)
        if len(key) > self.max_tokens:
            return
        for kept in [kept for kept in self._entries if key[: len(kept)] == kept]:
            del self._entries[kept]
        self._entries[key] = kv
        while self.tokens > self.max_tokens:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every entry (the weights changed)."""
        self._entries.clear()


def shared_prefix_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """How many leading tokens `a` and `b` have in common."""
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length
