"""Generation with a transformers model: continuous batching over a prefix cache.

Episodes call `generate` whenever they need a turn. A call queues its request, then drives the
backend one step at a time until its request is done (one step runs at a time, in a worker
thread, so tools and other episodes keep running on the event loop). A step admits the
requests that arrived, up to `max_batch_size` running rows, prefilling them from the longest
cached prefix of each prompt (those of similar lengths in one forward pass) and drawing their
first tokens, then decodes one token for every running row. A row leaves as soon as it stops;
the keys and values of what it read go to the prefix cache, so an episode's next turn (its
prompt extends the last one) prefills only the new tokens, and the G members of a group
prefill their shared prompt once.

Models whose cache is not plain attention keys and values (recurrent or linear-attention
layers) generate one request at a time, without prefix reuse.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import torch
from transformers import DynamicCache

from rollout import kv_cache
from rollout.kv_cache import KV, PrefixCache
from rollout.sampling import sample_tokens
from rollout.types import Completion, SamplingParams

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    result: Completion | None = None
    error: BaseException | None = None
    abandoned: bool = False

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


@dataclass
class _Plan:
    """How a request prefills: the first `reused` positions of `cached` serve its prompt."""

    request: _Request
    reused: int
    cached: KV | None

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_ids

    @property
    def reads(self) -> int:
        """Tokens the request must read."""
        return len(self.prompt) - self.reused


@dataclass
class _Row:
    """A request being generated: `fed` tokens are in the cache; `tokens[-1]` is not yet."""

    request: _Request
    sampling: dict[str, float]
    generator: torch.Generator
    fed: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False


class TransformersBackend:
    """A `GenerationBackend` over a transformers causal LM (the policy itself, on one device).

    Args:
        model: A causal LM. The backend only reads it (under `torch.inference_mode`), so the
            trainer's updates are seen without any weight push; call `reset_prefix_cache`
            after they change the weights.
        stop_token_ids: Token ids that end a turn (e.g. the tokenizer's end-of-turn id).
        pad_token_id: Id fed to rows that already stopped (never sampled from).
        max_batch_size: The most rows decoded together.
        seed: Seeds the requests that carry no seed of their own.
        prefix_cache_tokens: The most positions of keys and values kept for reuse (0: none).
        sampling_overrides: `min_p`, `repetition_penalty`, `temperature`, `top_p` or `top_k`
            for every request (TRL's `generation_kwargs`); they win over the request's own.
            The sampler logprobs stay those of softmax(logits / T), before any of them.

    """

    def __init__(
        self,
        model: torch.nn.Module,
        stop_token_ids: Collection[int],
        pad_token_id: int,
        max_batch_size: int = 64,
        seed: int = 0,
        prefix_cache_tokens: int = 16384,
        sampling_overrides: Mapping[str, Any] | None = None,
    ):
        if not stop_token_ids:
            raise ValueError("stop_token_ids is empty: generation would never end a turn")
        self.model = model
        self.stop_token_ids = frozenset(stop_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.sampling_overrides = _checked_overrides(sampling_overrides or {})
        self.context_limit: int | None = getattr(model.config, "max_position_embeddings", None)
        self.prefixes = PrefixCache(prefix_cache_tokens)
        self.reuses_keys_and_values = _has_plain_attention_cache(model)
        self.batches_prefills = _layer_types(model) == {"full_attention"}
        self._seeds = torch.Generator().manual_seed(seed)
        self._arriving: list[_Request] = []
        self._rows: list[_Row] = []
        self._cache: DynamicCache | None = None
        self._mask_B_T: torch.Tensor | None = None
        self._lock = anyio.Lock()

    @classmethod
    def from_tokenizer(cls, model: torch.nn.Module, tokenizer, **kwargs) -> TransformersBackend:
        """Build with the stop ids of the tokenizer and the model's generation config."""
        stop = {tokenizer.eos_token_id}
        configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        stop.update(configured if isinstance(configured, list) else [configured])
        stop.discard(None)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop)
        return cls(model, stop, pad, **kwargs)

    def reset_prefix_cache(self) -> None:
        """Forget the cached keys and values: call it whenever the model's weights change."""
        self.prefixes.clear()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Queue a request and return its completion once the steps have generated it."""
        if self.context_limit and len(prompt_ids) + params.max_tokens > self.context_limit:
            raise ValueError(
                f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                f"model's context of {self.context_limit} tokens"
            )
        if not prompt_ids:
            raise ValueError("the prompt is empty: there is nothing to continue")
        request = _Request(list(prompt_ids), params)
        self._arriving.append(request)
        try:
            while not request.done:
                async with self._lock:
                    if not request.done:
                        await anyio.to_thread.run_sync(self._step, self._admissions())
        except BaseException:
            request.abandoned = True  # cancelled: the next step drops its row
            raise
        if request.error is not None:
            raise request.error
        assert request.result is not None  # the loop ends on a result or an error
        return request.result

    def _admissions(self) -> list[_Request]:
        """The arrived requests there is room for, taken off the queue (on the event loop)."""
        room = self.max_batch_size - len(self._rows) if self.reuses_keys_and_values else 1
        admitted = [r for r in self._arriving[: max(room, 0)] if not r.abandoned]
        del self._arriving[: max(room, 0)]
        return admitted

    def _step(self, admitted: list[_Request]) -> None:
        """Admit `admitted`, then decode one token for every running row; fail them on error."""
        try:
            with torch.inference_mode():
                if not self.reuses_keys_and_values:
                    for request in admitted:
                        self._generate_alone(request)
                    return
                prefilled = self._prefill_all(admitted)
                self._join([(row, kv) for row, kv in prefilled if not row.finished])
                if self._rows:
                    self._decode()
        except Exception as error:  # every request in the step must learn about it
            for request in [*admitted, *(row.request for row in self._rows)]:
                request.error = error
            self._rows, self._cache, self._mask_B_T = [], None, None

    def _prefill_all(self, admitted: list[_Request]) -> list[tuple[_Row, KV]]:
        """Prefill the admitted requests in as few forward passes as their lengths allow.

        A request that shares more of its prompt with an earlier admitted one than the prefix
        cache holds (a group's members arriving together) waits for the next wave, and then
        reads that prompt from the cache. Within a wave, requests of similar lengths read in one
        pass (`_similar_lengths`).
        """
        prefilled: list[tuple[_Row, KV]] = []
        waiting = admitted
        while waiting:
            wave, waiting = self._wave(waiting)
            for plans in _similar_lengths(wave, batched=self.batches_prefills):
                prefilled.extend(self._prefill(plans))
        return prefilled

    def _wave(self, requests: list[_Request]) -> tuple[list[_Plan], list[_Request]]:
        """Plan the requests that prefill now; return their plans and the requests that wait."""
        wave: list[_Plan] = []
        waiting: list[_Request] = []
        for request in requests:
            prompt = request.prompt_ids
            reused, cached = self.prefixes.longest_prefix(prompt)
            shared = max(
                (kv_cache.shared_prefix_length(plan.prompt, prompt) for plan in wave), default=0
            )
            if shared > reused and self.prefixes.max_tokens > 0:
                waiting.append(request)
            else:  # read at least one token: its logits are needed
                wave.append(_Plan(request, min(reused, len(prompt) - 1), cached))
        return wave, waiting

    def _prefill(self, plans: list[_Plan]) -> list[tuple[_Row, KV]]:
        """Read the plans' prompts in one pass and draw their first tokens.

        Every row reads the same number of tokens, the most any plan needs: a row that needs
        fewer reads again some of its cached tokens, and a prompt shorter than that is
        left-padded. So each row's positions are contiguous and right-aligned, as the decoding
        batch keeps them. Returns each row and the keys and values of its prompt (one row).
        """
        reads = max(plan.reads for plan in plans)
        kept = [max(len(plan.prompt) - reads, 0) for plan in plans]  # cached positions used
        width = max(kept) + reads
        token_ids, positions = [], []
        for plan, n in zip(plans, kept, strict=True):
            token_ids.append(_left_padded(plan.prompt[n:], reads, self.pad_token_id))
            positions.append(_left_padded(list(range(n, len(plan.prompt))), reads, 0))
        mask_B_T = torch.cat([_left_padded_ones(len(plan.prompt), width) for plan in plans])
        device = self._device()
        out = self.model(
            input_ids=torch.tensor(token_ids, device=device),
            attention_mask=mask_B_T.to(device),
            position_ids=torch.tensor(positions, device=device),
            past_key_values=_cache_of_prefixes(plans, kept),
            use_cache=True,
            logits_to_keep=1,
        )
        rows = [self._new_row(plan.request) for plan in plans]
        self._draw(rows, out.logits[:, -1, :])
        read = kv_cache.kv_of(out.past_key_values)
        prefilled = []
        for b, (plan, row) in enumerate(zip(plans, rows, strict=True)):
            kv = kv_cache.take_columns(read, [b], width - len(plan.prompt))
            self.prefixes.add(plan.prompt, kv)
            prefilled.append((row, kv))
        return prefilled

    def _forward(self, token_ids: list[int], positions: range, cache: DynamicCache | None):
        device = self._device()
        return self.model(
            input_ids=torch.tensor([token_ids], device=device),
            attention_mask=torch.ones(1, positions.stop, dtype=torch.long, device=device),
            position_ids=torch.tensor([list(positions)], device=device),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )

    def _join(self, prefilled: list[tuple[_Row, KV]]) -> None:
        """Put freshly prefilled rows into the decoding batch, everything left-padded."""
        if not prefilled:
            return
        running = kv_cache.kv_of(self._cache) if self._cache is not None else None
        widths = [len(row.fed) for row, _ in prefilled]
        width = max([*widths, kv_cache.width(running) if running else 0])
        parts = [kv_cache.left_pad(kv, width) for _, kv in prefilled]
        masks = [_left_padded_ones(w, width) for w in widths]
        if running is not None and self._mask_B_T is not None:
            parts.insert(0, kv_cache.left_pad(running, width))
            masks.insert(0, _pad_mask(self._mask_B_T.cpu(), width))
        self._cache = kv_cache.cache_of(kv_cache.stack_rows(parts))
        self._mask_B_T = torch.cat(masks).to(self._device())
        self._rows.extend(row for row, _ in prefilled)

    def _decode(self) -> None:
        """Feed every running row its last token, draw the next, and let finished rows go."""
        device = self._device()
        assert self._mask_B_T is not None
        self._mask_B_T = torch.cat([self._mask_B_T, self._mask_B_T.new_ones(len(self._rows), 1)], 1)
        out = self.model(
            input_ids=torch.tensor([[row.tokens[-1]] for row in self._rows], device=device),
            attention_mask=self._mask_B_T,
            position_ids=torch.tensor([[len(row.fed)] for row in self._rows], device=device),
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache = out.past_key_values
        for row in self._rows:
            row.fed.append(row.tokens[-1])
        self._draw(self._rows, out.logits[:, -1, :])
        self._release([b for b, row in enumerate(self._rows) if row.finished])

    def _release(self, finished: list[int]) -> None:
        """Cache what the finished rows read, then drop them from the batch."""
        if not finished:
            return
        assert self._cache is not None and self._mask_B_T is not None
        running = kv_cache.kv_of(self._cache)
        total = kv_cache.width(running)
        for b in finished:
            fed = self._rows[b].fed
            read = kv_cache.take_columns(running, slice(b, b + 1), total - len(fed))
            self.prefixes.add(fed, read)
        kept = [b for b in range(len(self._rows)) if b not in set(finished)]
        self._rows = [self._rows[b] for b in kept]
        if not kept:
            self._cache, self._mask_B_T = None, None
            return
        start = total - max(len(row.fed) for row in self._rows)  # drop all-padding columns
        self._cache = kv_cache.cache_of(kv_cache.take_columns(running, kept, start))
        self._mask_B_T = self._mask_B_T[kept, start:]

    def _generate_alone(self, request: _Request) -> None:
        """Generate one request with the model's own cache (models without plain KV)."""
        row = self._new_row(request)
        out = self._forward(request.prompt_ids, range(len(request.prompt_ids)), None)
        self._draw([row], out.logits[:, -1, :])
        while not row.finished:
            row.fed.append(row.tokens[-1])
            last = len(row.fed) - 1
            out = self._forward([row.tokens[-1]], range(last, last + 1), out.past_key_values)
            self._draw([row], out.logits[:, -1, :])

    def _new_row(self, request: _Request) -> _Row:
        params = request.params
        sampling = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
        }
        sampling |= self.sampling_overrides
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._seeds))
        generator = torch.Generator(device=self._device()).manual_seed(seed)
        return _Row(request, sampling, generator, fed=list(request.prompt_ids))

    def _draw(self, rows: list[_Row], logits_B_V: torch.Tensor) -> None:
        """Sample each row's next token; a row that stops or runs out of tokens finishes."""
        device = logits_B_V.device

        def column(name: str, dtype=torch.float32) -> torch.Tensor:
            return torch.tensor([row.sampling[name] for row in rows], dtype=dtype, device=device)

        penalty_B = column("repetition_penalty")
        penalized = bool((penalty_B != 1).any())
        tokens_B, logprobs_B = sample_tokens(
            logits_B_V.float(),
            column("temperature"),
            column("top_k", torch.long),
            column("top_p"),
            [row.generator for row in rows],
            min_p_B=column("min_p"),
            penalty_B=penalty_B if penalized else None,
            seen_B_V=_seen(rows, logits_B_V.shape[-1], device) if penalized else None,
        )
        for row, token, logprob in zip(rows, tokens_B.tolist(), logprobs_B.tolist(), strict=True):
            row.tokens.append(token)
            row.logprobs.append(logprob)
            stopped = token in self.stop_token_ids
            if stopped or len(row.tokens) >= row.request.params.max_tokens or row.request.abandoned:
                row.finished = True
                row.request.result = Completion(row.tokens, row.logprobs, stopped)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device  # what transformers' `model.device` reads


def _checked_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`generation_kwargs` this backend applies; anything else is refused by name.

    `do_sample=False` means greedy (temperature 0), `do_sample=True` changes nothing.
    """
    overrides = dict(overrides)
    if overrides.pop("do_sample", True) is False:
        overrides["temperature"] = 0.0
    unknown = sorted(set(overrides) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(
            f"generation_kwargs {unknown} are not supported by the transformers backend, which "
            f"applies {['do_sample', *SAMPLING_FIELDS]}; remove them, or generate with vLLM "
            "(use_vllm=True), which takes any vllm.SamplingParams field"
        )
    return overrides


def _has_plain_attention_cache(model: Any) -> bool:
    """Whether the model's cache is attention keys and values only (no recurrent state)."""
    attention = {"full_attention", "sliding_attention", "chunked_attention"}
    supports = getattr(type(model), "_supports_default_dynamic_cache", lambda: True)
    return _layer_types(model) <= attention and bool(supports())


def _layer_types(model: Any) -> set[str]:
    config = model.config.get_text_config(decoder=True)
    return set(getattr(config, "layer_types", None) or ["full_attention"])


def _cache_of_prefixes(plans: list[_Plan], kept: list[int]) -> DynamicCache:
    """The first `kept[b]` cached positions of each plan's prompt as row b, left-padded."""
    if max(kept) == 0:
        return DynamicCache()
    any_cached = next(plan.cached for plan, n in zip(plans, kept, strict=True) if n > 0)
    rows = []
    for plan, n in zip(plans, kept, strict=True):
        prefix = kv_cache.first_positions(plan.cached if n > 0 else any_cached, n)  # type: ignore[arg-type]
        rows.append(kv_cache.left_pad(prefix, max(kept)))
    return kv_cache.cache_of(kv_cache.stack_rows(rows))


def _similar_lengths(plans: list[_Plan], batched: bool) -> list[list[_Plan]]:
    """The plans in batches that read together, longest first (one each unless `batched`).

    Every row of a batch reads as many tokens as its longest, so a plan joins a batch only
    while it needs at least half of that, or no more than 16 tokens less: a pass costs about
    as much as reading a few dozen tokens more (SmolLM2-135M, one CPU thread: 60 ms for one
    token, 150 ms for 30).
    """
    batches: list[list[_Plan]] = []
    for plan in sorted(plans, key=lambda plan: plan.reads, reverse=True):
        longest = batches[-1][0].reads if batches else 0
        if batched and batches and (2 * plan.reads >= longest or longest - plan.reads <= 16):
            batches[-1].append(plan)
        else:
            batches.append([plan])
    return batches


def _left_padded(values: list[int], width: int, pad: int) -> list[int]:
    return [pad] * (width - len(values)) + values


def _left_padded_ones(ones: int, width: int) -> torch.Tensor:
    """A one-row attention mask: `width - ones` padding positions, then `ones` real ones."""
    mask_1_W = torch.zeros(1, width, dtype=torch.long)
    mask_1_W[:, width - ones :] = 1
    return mask_1_W


def _pad_mask(mask_B_T: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(mask_B_T, (width - mask_B_T.shape[1], 0))


def _seen(rows: list[_Row], vocab: int, device: torch.device) -> torch.Tensor:
    """True at the tokens each row has read or drawn (what the repetition penalty hits)."""
    seen_B_V = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    for b, row in enumerate(rows):
        seen_B_V[b, torch.tensor(row.fed + row.tokens, device=device)] = True
    return seen_B_V
