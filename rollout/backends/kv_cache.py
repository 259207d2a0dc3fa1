"""Keys and values a transformers model computed, kept to prefill only what is new.

`KV` is a model's attention cache as plain tensors: per layer `(keys, values)`, each
`[rows, heads, T, head_dim]`. `PrefixCache` keeps the KV of token sequences the model has read
(one row each); a later prompt that starts with such a sequence reuses its keys and values
(causal attention: the KV of the first n tokens depends on those n tokens only). The batch
helpers lay rows of different lengths side by side, left-padded, as the decoding batch holds
them; `rebuilt` and `split_rows` remake a cache a layer at a time, letting each old layer go
once its new one exists, so a batch's keys and values are never held twice over.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TypeVar

import torch
from transformers import DynamicCache

Layer = tuple[torch.Tensor, torch.Tensor]
KV = tuple[Layer, ...]
T = TypeVar("T")


def kv_of(cache: DynamicCache) -> KV:
    """The tensors of a `DynamicCache` (no copy)."""
    return tuple((keys, values) for keys, values, *_ in cache)


def cache_of(layers: Iterable[Layer]) -> DynamicCache:
    """A new `DynamicCache` holding a copy of each layer, copied in turn as `layers` yields it."""
    return DynamicCache(ddp_cache_data=layers)


def taken_layers(cache: DynamicCache) -> list[Layer]:
    """The tensors of `cache`'s layers (no copy), emptying the cache of them.

    The list is then their only holder (the cache object no longer holds them, wherever a
    model's output still refers to it), so `rebuilt` and `split_rows` free each layer as they
    go.
    """
    layers = list(kv_of(cache))
    cache.layers.clear()
    return layers


def rebuilt(layers: list[T], remake: Callable[[T], Layer]) -> DynamicCache:
    """A new `DynamicCache` of `remake(layer)` for every layer, emptying `layers` as it goes.

    `layers`: each layer's tensors (its keys and values, or several rows' of them).

    Each old layer is let go once its new one is copied into the cache, so the old and the
    new cache are never both whole in memory (where nothing else holds the old layers).
    """

    def remade() -> Iterator[Layer]:
        while layers:
            yield remake(layers.pop(0))

    return cache_of(remade())


def split_rows(layers: list[Layer], starts: Sequence[int]) -> list[KV]:
    """Row b's positions from `starts[b]` on, for every row, as tensors of their own.

    Empties `layers` a layer at a time, as `rebuilt` does.
    """
    rows: list[list[Layer]] = [[] for _ in starts]
    while layers:
        keys, values = layers.pop(0)
        for b, start in enumerate(starts):
            row = slice(b, b + 1)
            rows[b].append((keys[row, :, start:].clone(), values[row, :, start:].clone()))
    return [tuple(row) for row in rows]


def stacked(parts: Sequence[Layer], width: int) -> Layer:
    """One layer: the rows of every part one after the other, left-padded with zeros to `width`."""
    keys = _stacked([keys for keys, _ in parts], width)
    return keys, _stacked([values for _, values in parts], width)


def _stacked(parts_R_H_T_D: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    first = parts_R_H_T_D[0]
    rows = sum(part.shape[0] for part in parts_R_H_T_D)
    out_R_H_W_D = first.new_zeros(rows, first.shape[1], width, first.shape[3])
    row = 0
    for part in parts_R_H_T_D:
        out_R_H_W_D[row : row + part.shape[0], :, width - part.shape[2] :] = part
        row += part.shape[0]
    return out_R_H_W_D


def first_positions(kv: KV, count: int) -> KV:
    """Views of the first `count` positions."""
    return tuple((keys[:, :, :count], values[:, :, :count]) for keys, values in kv)


def take_columns(
    kv: Sequence[Layer], rows: slice | Sequence[int], start: int, end: int | None = None
) -> KV:
    """The given rows' positions `start:end`, as tensors of their own (not views)."""
    index = rows if isinstance(rows, slice) else torch.tensor(list(rows))
    return tuple(
        (keys[index, :, start:end].clone(), values[index, :, start:end].clone())
        for keys, values in kv
    )


def width(kv: Sequence[Layer]) -> int:
    """The number of positions `kv` holds."""
    return kv[0][0].shape[-2]


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
