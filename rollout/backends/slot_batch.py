"""The decoding batch on a GPU: a preallocated key/value cache with one slot per row.

On a GPU a decoding step is cheap and a host round trip is not, so this batch keeps the hot
loop on the device. Every running row owns a slot of a static cache (per layer
`[slots, kv heads, width, head dim]`), and a row's token at position p sits in column p of its
slot, so a row joins by copying its prompt's keys and values into its slot and nothing else
moves. A decoding step writes each row's new keys and values at its own column, attends over
the slot under a mask of the columns the row has written, samples the next token on the device
(`sampling.sample_plain`, uniforms from `counter_uniform(seed, draw number)`), records it, and
advances the row unless it has stopped: a row that samples a stop token or reaches its budget
freezes in place. `decode` runs a chunk of such steps and reads the results back once; on CUDA
the step is captured as a CUDA graph per (slots, width) bucket and replayed, so a chunk costs a
few launches. Rows whose sampling needs filters or a penalty take one eager step at a time.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Collection
from dataclasses import dataclass, fields
from typing import Any

import torch

from rollout.backends.generation_rows import Row, sample_rows
from rollout.backends.kv_cache import KV
from rollout.backends.sampling import counter_uniform, sample_plain

MIN_SLOTS = 8
MIN_WIDTH = 128


class SlotCache:
    """The cache a slot decoding step hands the model: writes go to each row's own column.

    transformers' attention layers call `update(keys, values, layer_idx)` with the new keys and
    values of one token per row and attend over what it returns: here the slots' whole width
    (the step's mask hides the columns a row has not written).
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions_S):
        self.keys, self.values = keys, values
        self.positions_S = positions_S
        self.rows_S = torch.arange(len(positions_S), device=positions_S.device)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Write one new position per row at its column; return the layer's whole cache."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self.rows_S, :, self.positions_S] = key_states[:, :, 0].to(keys.dtype)
        values[self.rows_S, :, self.positions_S] = value_states[:, :, 0].to(values.dtype)
        return keys, values


@dataclass
class _Buffers:
    """The device state of every slot (S slots, W columns, K steps of results per chunk)."""

    keys: list[torch.Tensor]  # per layer [S, heads, W, head_dim]
    values: list[torch.Tensor]
    mask_S_1_1_W: torch.Tensor  # True at the columns a row attends to
    input_S_1: torch.Tensor  # the token each row feeds next (its last sampled one)
    positions_S: torch.Tensor  # that token's position: the row's column to write
    temperature_S: torch.Tensor
    seed_S: torch.Tensor
    drawn_S: torch.Tensor  # tokens sampled so far (the next draw's counter)
    budget_S: torch.Tensor  # max_tokens
    done_S: torch.Tensor  # stopped, out of budget, or a free slot: frozen in place
    tokens_S_K: torch.Tensor  # each chunk step's sampled token
    logprobs_S_K: torch.Tensor
    step_1: torch.Tensor  # the chunk step being run

    @property
    def width(self) -> int:
        return self.mask_S_1_1_W.shape[-1]

    def state(self) -> dict[str, torch.Tensor]:
        """Copies of what a step changes besides idempotent writes (mask, keys, values)."""
        changed = ("input_S_1", "positions_S", "drawn_S", "done_S", "step_1")
        return {name: getattr(self, name).clone() for name in changed}

    def restore(self, state: dict[str, torch.Tensor]) -> None:
        for name, saved in state.items():
            getattr(self, name).copy_(saved)


class SlotBatch:
    """The running rows of a transformers backend on a static cache, decoded on the device.

    Args:
        model: The causal LM (full attention in every layer); the policy itself.
        max_rows: The number of slots.
        chunk_steps: Decoding steps between two reads of the results (the host round trip).
        cuda_graphs: Capture and replay the step as CUDA graphs (on a CUDA device only).
    """

    def __init__(
        self, model: torch.nn.Module, max_rows: int, chunk_steps: int = 8, cuda_graphs: bool = True
    ):
        if max_rows < 1 or chunk_steps < 1:
            raise ValueError(f"max_rows and chunk_steps must be >= 1: {max_rows}, {chunk_steps}")
        self.model = model
        self.max_rows = max_rows
        self.chunk_steps = chunk_steps
        self.cuda_graphs = cuda_graphs
        self.slots: list[Row | None] = [None] * max_rows
        self._buffers: _Buffers | None = None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # the graphs' shared memory pool
        self._weights: tuple[int, ...] = ()  # the addresses of the weights the graphs read
        self._stops: tuple[frozenset[int], torch.Tensor] | None = None

    @property
    def rows(self) -> list[Row]:
        """The running rows, in slot order."""
        return [row for row in self.slots if row is not None]

    def clear(self) -> None:
        """Drop every row (after a failed step); the buffers stay for the next rows."""
        for slot, row in enumerate(self.slots):
            if row is not None:
                self._free(slot)

    def release(self) -> None:
        """Drop every row and free the buffers and the captured graphs (with their pool).

        Between rounds, so the slot cache does not sit through the learner's step; the next
        `join` allocates the buffers again, and each step's graph is captured again.
        """
        self.slots = [None] * self.max_rows
        self._buffers, self._graphs, self._pool, self._weights = None, {}, None, ()

    # ------------------------------------------------------------------ joining

    def join(self, prefilled: list[tuple[Row, KV]]) -> None:
        """Give each prefilled row a free slot, with its prompt's keys and values."""
        if not prefilled:
            return
        free = [slot for slot, row in enumerate(self.slots) if row is None]
        assert len(prefilled) <= len(free), "more rows than free slots"
        needed = max(len(row.fed) + row.request.params.max_tokens for row, _ in prefilled)
        buffers = self._ensure(prefilled[0][1], needed)
        for slot, (row, kv) in zip(free, prefilled, strict=False):
            self._seat(buffers, slot, row, kv)

    def _seat(self, buffers: _Buffers, slot: int, row: Row, kv: KV) -> None:
        length = len(row.fed)
        for layer, (keys, values) in enumerate(kv):
            buffers.keys[layer][slot, :, :length] = keys[0]
            buffers.values[layer][slot, :, :length] = values[0]
        buffers.mask_S_1_1_W[slot] = False
        buffers.mask_S_1_1_W[slot, 0, 0, :length] = True
        fields_ = {
            "input_S_1": row.tokens[-1],
            "positions_S": length,
            "temperature_S": row.sampling["temperature"],
            "seed_S": row.seed & (2**63 - 1),  # any Python int; int64 holds 63 bits
            "drawn_S": len(row.tokens),
            "budget_S": row.request.params.max_tokens,
            "done_S": False,
        }
        for name, value in fields_.items():
            getattr(buffers, name)[slot] = value
        self.slots[slot] = row

    def _free(self, slot: int) -> None:
        """Empty a slot: frozen, at column 0, attending to column 0 only (never a NaN row)."""
        buffers = self._buffers
        assert buffers is not None
        buffers.done_S[slot] = True
        buffers.positions_S[slot] = 0
        buffers.mask_S_1_1_W[slot] = False
        buffers.mask_S_1_1_W[slot, 0, 0, 0] = True
        self.slots[slot] = None

    def _ensure(self, kv: KV, width: int) -> _Buffers:
        """Buffers of at least `width` columns, shaped like `kv` (grown, copied, if needed)."""
        old = self._buffers
        if old is not None and old.width >= width:
            return old
        width = _bucket(width, MIN_WIDTH)
        device = kv[0][0].device
        S = self.max_rows

        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        new = _Buffers(
            keys=[zeros(S, k.shape[1], width, k.shape[3], dtype=k.dtype) for k, _ in kv],
            values=[zeros(S, v.shape[1], width, v.shape[3], dtype=v.dtype) for _, v in kv],
            mask_S_1_1_W=zeros(S, 1, 1, width, dtype=torch.bool),
            input_S_1=zeros(S, 1, dtype=torch.long),
            positions_S=zeros(S, dtype=torch.long),
            temperature_S=zeros(S, dtype=torch.float32),
            seed_S=zeros(S, dtype=torch.long),
            drawn_S=zeros(S, dtype=torch.long),
            budget_S=zeros(S, dtype=torch.long),
            done_S=torch.ones(S, dtype=torch.bool, device=device),
            tokens_S_K=zeros(S, self.chunk_steps, dtype=torch.long),
            logprobs_S_K=zeros(S, self.chunk_steps, dtype=torch.float32),
            step_1=zeros(1, dtype=torch.long),
        )
        new.mask_S_1_1_W[:, 0, 0, 0] = True
        if old is not None:
            _copy_into(old, new)
        self._buffers, self._graphs, self._pool = new, {}, None  # graphs held old addresses
        return new

    # ------------------------------------------------------------------ decoding

    def decode(self, stop_token_ids: Collection[int]) -> list[tuple[Row, KV]]:
        """Run a chunk of decoding steps; return the rows that finished, with what they read.

        Each finished row comes with the keys and values of `row.fed` (one row), for the prefix
        cache; its slot is free again.
        """
        buffers = self._buffers
        occupied = [slot for slot, row in enumerate(self.slots) if row is not None]
        assert buffers is not None and occupied, "decode with no rows"
        rows = [row for row in self.slots if row is not None]  # in the order of `occupied`
        plain = all(row.plain for row in rows)
        remaining = max(row.request.params.max_tokens - len(row.tokens) for row in rows)
        steps = min(self.chunk_steps, remaining) if plain else 1
        slots = min(self.max_rows, _bucket(occupied[-1] + 1, MIN_SLOTS))
        reach = max(len(row.fed) + steps for row in rows)
        width = min(buffers.width, _bucket(reach + 1, MIN_WIDTH))
        stops = self._stop_tensor(stop_token_ids, buffers.done_S.device)
        buffers.step_1.zero_()
        if plain:
            run = self._runner(slots, width, stops)
            for _ in range(steps):
                run()
        else:
            self._filtered_step(slots, width, stops)
        return self._collect(buffers, occupied, steps, stop_token_ids)

    def _collect(
        self, buffers: _Buffers, occupied: list[int], steps: int, stop_token_ids
    ) -> list[tuple[Row, KV]]:
        """Read the chunk's tokens back once; hand them to the rows; free the finished."""
        drawn = buffers.drawn_S.tolist()
        tokens = buffers.tokens_S_K[:, :steps].tolist()
        logprobs = buffers.logprobs_S_K[:, :steps].tolist()
        released = []
        for slot in occupied:
            row = self.slots[slot]
            assert row is not None
            for step in range(drawn[slot] - len(row.tokens)):
                row.fed.append(row.tokens[-1])
                row.take(tokens[slot][step], logprobs[slot][step], stop_token_ids)
            if row.request.abandoned and not row.finished:
                row.finished = True  # cancelled: its slot goes back, nobody reads it
            if row.finished:
                released.append((row, _slot_kv(buffers, slot, len(row.fed))))
                self._free(slot)
        return released

    def _stop_tensor(self, stop_token_ids: Collection[int], device) -> torch.Tensor:
        """The stop ids on the device, one tensor per set (graphs hold its address)."""
        key = frozenset(stop_token_ids)
        if self._stops is None or self._stops[0] != key:
            ids = sorted(key) or [-1]  # -1 is never sampled: no stop
            self._stops = (key, torch.tensor(ids, dtype=torch.long, device=device))
            self._graphs = {}
        return self._stops[1]

    def _runner(self, slots: int, width: int, stops_N: torch.Tensor):
        """One plain decoding step over the first `slots` slots and `width` columns.

        On CUDA (with `cuda_graphs`) the step's graph replays, captured on first use; if the
        capture fails, the step runs eagerly from then on, with a warning. (A model under FSDP2
        is given `cuda_graphs=False`: its forward hooks make FSDP's own streams wait for the
        current one, which a capture cannot take in.)
        """
        buffers = self._buffers
        assert buffers is not None

        def step() -> None:
            _plain_step(self.model, buffers, slots, width, stops_N)

        if not (self.cuda_graphs and buffers.done_S.is_cuda):
            return step
        weights = _addresses(self.model)
        if weights != self._weights:  # e.g. ZeRO-3 gathered them anew: the graphs read old ones
            self._graphs, self._pool, self._weights = {}, None, weights
        graph = self._graphs.get((slots, width))
        if graph is None:
            try:
                graph = self._capture(step, buffers)
            except Exception as error:  # any capture failure: run eagerly
                warnings.warn(
                    f"CUDA graph capture of the decoding step failed ({type(error).__name__}: "
                    f"{error}); decoding runs without graphs",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self.cuda_graphs = False
                return step
            self._graphs[(slots, width)] = graph
        return graph.replay

    def _capture(self, step, buffers: _Buffers) -> torch.cuda.CUDAGraph:
        """Warm the step up on a side stream (state restored after), then capture it."""
        state = buffers.state()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
                buffers.restore(state)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph leaves its stream current when the capture fails; the outer block
        # puts the thread's own stream back all the same, so an eager fallback runs on it.
        # thread_local: CUDA work of other threads (a reward model, say) may go on meanwhile.
        with (
            torch.cuda.stream(side),
            torch.cuda.graph(
                graph, pool=self._pool, stream=side, capture_error_mode="thread_local"
            ),
        ):
            step()
        return graph

    def _filtered_step(self, slots: int, width: int, stops_N: torch.Tensor) -> None:
        """One eager step for rows that sample with filters or a penalty (`sample_rows`)."""
        buffers = self._buffers
        assert buffers is not None
        logits_S_V = _forward(self.model, buffers, slots, width)
        live = [slot for slot in range(slots) if self.slots[slot] is not None]
        rows = [row for row in self.slots[:slots] if row is not None]
        drawn_L, logprobs_L = sample_rows(rows, logits_S_V[live], counter_based=True)
        tokens_S = buffers.input_S_1[:slots, 0].clone()
        logprobs_S = torch.zeros(slots, device=logprobs_L.device)
        tokens_S[live], logprobs_S[live] = drawn_L, logprobs_L
        _advance(buffers, slots, tokens_S, logprobs_S, stops_N)


def _forward(model, buffers: _Buffers, slots: int, width: int) -> torch.Tensor:
    """Feed every slot its input token at its column; the next-token logits, float32 (S x V)."""
    positions_S = buffers.positions_S[:slots]
    mask_S_1_1_W = buffers.mask_S_1_1_W[:slots, :, :, :width]
    # scatter_ takes the value as a kernel argument: no host copy (which a graph cannot hold)
    mask_S_1_1_W[:, 0, 0].scatter_(1, positions_S.unsqueeze(1), True)
    cache = SlotCache(
        [keys[:slots, :, :width] for keys in buffers.keys],
        [values[:slots, :, :width] for values in buffers.values],
        positions_S,
    )
    out = model(
        input_ids=buffers.input_S_1[:slots],
        position_ids=positions_S.unsqueeze(1),
        attention_mask=mask_S_1_1_W,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float()


def _plain_step(model, buffers: _Buffers, slots: int, width: int, stops_N: torch.Tensor) -> None:
    """One decoding step of plain sampling, all on the device (what a CUDA graph captures)."""
    logits_S_V = _forward(model, buffers, slots, width)
    uniform_S = counter_uniform(buffers.seed_S[:slots], buffers.drawn_S[:slots])
    tokens_S, logprobs_S = sample_plain(logits_S_V, buffers.temperature_S[:slots], uniform_S)
    _advance(buffers, slots, tokens_S, logprobs_S, stops_N)


def _advance(
    buffers: _Buffers,
    slots: int,
    tokens_S: torch.Tensor,
    logprobs_S: torch.Tensor,
    stops_N: torch.Tensor,
) -> None:
    """Record the step's draws; move the live rows on; freeze those that stop or run out."""
    live_S = ~buffers.done_S[:slots]
    drawn_S = buffers.drawn_S[:slots]
    buffers.tokens_S_K[:slots].index_copy_(1, buffers.step_1, tokens_S.unsqueeze(1))
    buffers.logprobs_S_K[:slots].index_copy_(1, buffers.step_1, logprobs_S.unsqueeze(1))
    buffers.step_1.add_(1)
    advance_S = live_S.long()
    drawn_S.add_(advance_S)
    buffers.positions_S[:slots].add_(advance_S)
    inputs_S = buffers.input_S_1[:slots, 0]
    inputs_S.copy_(torch.where(live_S, tokens_S, inputs_S))
    stopped_S = (tokens_S.unsqueeze(1) == stops_N).any(dim=1)
    buffers.done_S[:slots] |= live_S & (stopped_S | (drawn_S >= buffers.budget_S[:slots]))


def _slot_kv(buffers: _Buffers, slot: int, length: int) -> KV:
    """A copy of the first `length` columns of a slot's keys and values (one row)."""
    return tuple(
        (keys[slot : slot + 1, :, :length].clone(), values[slot : slot + 1, :, :length].clone())
        for keys, values in zip(buffers.keys, buffers.values, strict=True)
    )


def _copy_into(old: _Buffers, new: _Buffers) -> None:
    """Copy `old`'s state into the wider `new` (the first columns of every slot)."""
    width = old.width
    for name in (f.name for f in fields(_Buffers)):
        source, target = getattr(old, name), getattr(new, name)
        if name in ("keys", "values"):
            for a, b in zip(source, target, strict=True):
                b[:, :, :width] = a
        elif name == "mask_S_1_1_W":
            target[..., :width] = source
            target[..., width:] = False
        elif name not in ("tokens_S_K", "logprobs_S_K", "step_1"):
            target.copy_(source)


def _addresses(model: torch.nn.Module) -> tuple[int, ...]:
    """Where the model's weights and buffers live: a graph reads them at these addresses."""
    return tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers()))


def _bucket(n: int, minimum: int) -> int:
    """The smallest power of two >= n, at least `minimum`."""
    return max(minimum, 1 << max(n - 1, 0).bit_length())
