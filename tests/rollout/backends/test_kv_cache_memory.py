"""The decoding batch remakes its keys and values a layer at a time, never holding them twice."""

from __future__ import annotations

import weakref

import anyio
import pytest
import torch

from rollout import SamplingParams, TransformersBackend
from rollout.backends import dynamic_batch, kv_cache
from tests.support.tiny_model import tiny_llama


def layers(count: int, rows: int = 3, width: int = 5) -> list[kv_cache.Layer]:
    return [(torch.randn(rows, 2, width, 4), torch.randn(rows, 2, width, 4)) for _ in range(count)]


def test_a_rebuilt_cache_lets_each_old_layer_go_before_it_makes_the_next():
    old = layers(4)
    expected = [(keys[1:].clone(), values[1:].clone()) for keys, values in old]
    refs = [weakref.ref(keys) for keys, _ in old]
    alive_at_each_layer = []

    def remake(layer: kv_cache.Layer) -> kv_cache.Layer:  # rows 1 and 2, copied
        alive_at_each_layer.append([ref() is not None for ref in refs])
        return layer[0][torch.tensor([1, 2])], layer[1][torch.tensor([1, 2])]

    cache = kv_cache.rebuilt(old, remake)
    assert old == []
    assert alive_at_each_layer == [
        [True, True, True, True],
        [False, True, True, True],
        [False, False, True, True],
        [False, False, False, True],
    ]
    for (keys, values), (want_keys, want_values) in zip(
        kv_cache.kv_of(cache), expected, strict=True
    ):
        assert torch.equal(keys, want_keys) and torch.equal(values, want_values)


def test_split_rows_gives_each_row_its_own_positions_and_empties_the_layers():
    batch = layers(3, rows=3, width=6)
    whole = tuple((keys.clone(), values.clone()) for keys, values in batch)
    starts = [0, 2, 5]
    rows = kv_cache.split_rows(batch, starts)
    assert batch == []
    for b, (row, start) in enumerate(zip(rows, starts, strict=True)):
        want = kv_cache.take_columns(whole, [b], start)
        for (keys, values), (want_keys, want_values) in zip(row, want, strict=True):
            assert torch.equal(keys, want_keys) and torch.equal(values, want_values)
            assert keys.untyped_storage().nbytes() == keys.numel() * keys.element_size()


def test_stacked_parts_are_left_padded_with_zeros_to_the_width():
    short, long = layers(1, rows=1, width=2)[0], layers(1, rows=2, width=4)[0]
    keys, values = kv_cache.stacked([short, long], width=5)
    assert keys.shape == (3, 2, 5, 4)
    assert torch.equal(keys[0, :, :3], torch.zeros(2, 3, 4))
    assert torch.equal(keys[0, :, 3:], short[0][0])
    assert torch.equal(values[1:, :, 1:], long[1]) and not values[1:, :, :1].any()


@pytest.mark.anyio
async def test_the_decoding_batch_never_holds_its_keys_and_values_twice(tokenizer, monkeypatch):
    """Rows of different lengths join and leave the batch: at every layer the batch remakes,
    the earlier old layers are gone (all but what the prefix cache keeps)."""
    model = tiny_llama(tokenizer)  # its own: the rows' lengths hang on its weights
    backend = TransformersBackend(model, stop_token_ids=[0], pad_token_id=2)
    checked = []
    rebuilt = kv_cache.rebuilt

    def watched(items, remake):
        kept = {id(t) for kv in backend.prefixes._entries.values() for layer in kv for t in layer}
        refs = [[weakref.ref(t) for t in _tensors(item) if id(t) not in kept] for item in items]

        def remake_watched(item):
            done = len(refs) - len(items) - 1  # the layers remade before this one
            checked.append(all(ref() is None for layer in refs[:done] for ref in layer))
            return remake(item)

        return rebuilt(items, remake_watched)

    monkeypatch.setattr(dynamic_batch.kv_cache, "rebuilt", watched)
    prompts = [[1, 520, 33, 8], [1, 1823, 9, 44, 101, 7, 3], [1, 77], [1, 5, 6]]
    lengths = [3, 9, 5, 12]

    async def one(prompt, length):
        await anyio.sleep(0.01 * len(prompt))  # arrive apart: later rows join a running batch
        await backend.generate(prompt, SamplingParams(max_tokens=length, temperature=0))

    async with anyio.create_task_group() as group:
        for prompt, length in zip(prompts, lengths, strict=True):
            group.start_soon(one, prompt, length)
    assert len(checked) > 2 * len(model.model.layers) and all(checked)


def _tensors(item) -> list[torch.Tensor]:
    """The tensors of one layer's item: a (keys, values) pair or a list of such pairs."""
    if isinstance(item, tuple) and isinstance(item[0], torch.Tensor):
        return list(item)
    return [t for pair in item for t in pair]


@pytest.mark.anyio
async def test_rows_joining_and_leaving_a_cpu_batch_give_the_freed_memory_back(
    tokenizer, monkeypatch
):
    model = tiny_llama(tokenizer)  # its own: the rows' lengths hang on its weights
    backend = TransformersBackend(model, stop_token_ids=[0], pad_token_id=2)
    given_back = []
    monkeypatch.setattr(dynamic_batch, "give_back_freed_memory", lambda: given_back.append(1))
    await backend.generate([1, 520, 33, 8], SamplingParams(max_tokens=4, temperature=0))
    assert len(given_back) == 2  # the row joined, then left
