"""Generation with a transformers model: continuous batching over a prefix cache.

Episodes call `generate` whenever they need a turn. A call queues its request, then drives the
backend one step at a time until its request is done (one step runs at a time, in a worker
thread, so tools and other episodes keep running on the event loop). A step admits the
requests that arrived, up to `max_batch_size` running rows, prefilling them from the longest
cached prefix of each prompt (those of similar lengths in one forward pass) and drawing their
first tokens, then decodes every running row. A row leaves as soon as it stops; the keys and
values of what it read go to the prefix cache, so an episode's next turn (its prompt extends
the last one) prefills only the new tokens, and the G members of a group prefill their shared
prompt once.

The running rows decode in one of two batches, chosen by the model's device: on a CPU a
`DynamicBatch` (a growing cache of left-padded rows, sampled on the host, one token a step), on
a CUDA GPU a `SlotBatch` (a static cache with a slot per row, sampled on the device, a chunk of
steps per host round trip, replayed as CUDA graphs).

Models whose cache is not plain attention keys and values (recurrent or linear-attention
layers) generate one request at a time, without prefix reuse. So do prompts with images (a
vision-language model's): the prefill reads their pixels with their ids (`rollout.images`).
Where the model has full attention and plain positions (not Qwen2-VL's 3-D ones), they reuse
the prefix cache keyed by their ids and their pictures (`image_prefixes`): requests that share
a prompt with the same pictures prefill it once; other pictures never match.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import anyio
import torch
from transformers import DynamicCache

from rollout.backends import kv_cache
from rollout.backends.dynamic_batch import DynamicBatch, left_padded_ones
from rollout.backends.generation_rows import Request, Row, draw_rows
from rollout.backends.generation_settings import generation_settings, row_processors
from rollout.backends.image_prefixes import prefix_key, reusable_length
from rollout.backends.kv_cache import KV, PrefixCache
from rollout.backends.prefill_plans import (
    PrefillPlan,
    cache_of_prefixes,
    left_padded,
    plan_wave,
    similar_lengths,
)
from rollout.backends.slot_batch import SlotBatch
from rollout.images import feature_token_ids, vision_forward_kwargs
from rollout.types import Completion, Pictures, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

# What a row samples with when neither its request nor the backend's settings say otherwise.
_SAMPLING_DEFAULTS = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


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
        sampling_overrides: TRL's `generation_kwargs` (transformers' `GenerationConfig`
            fields) for every request, winning over the request's own sampling: see
            `generation_settings` for what applies and what is refused. The sampler logprobs
            stay those of softmax(logits / T), before any penalty, processor or filter. A
            vision-language model's image-feature tokens are always suppressed
            (`rollout.images.feature_token_ids`).
        static_cache: Decode in a `SlotBatch` (True) or a `DynamicBatch` (False); None: a
            `SlotBatch` when the model is on a CUDA device. Only models whose every layer is
            full attention decode in slots.
        autocast_dtype: Generate under `torch.autocast` in this dtype (e.g. bfloat16), as the
            trainer's mixed-precision forward computes; None: in the weights' own dtype.
        chunk_steps: A `SlotBatch`'s decoding steps per host round trip.
        cuda_graphs: Let a `SlotBatch` on CUDA replay its decoding step as CUDA graphs.
        step_lock: Hold this lock for each step, in place of one of its own: backends over one
            model that share it never step at once (say, one per LoRA adapter of a PEFT model).
        step_context: Enter this context around each step (say, one activating its adapter).

    Attributes:
        reads_images: True: `generate` takes a vision-language model's image tensors.

    """

    reads_images = True

    def __init__(
        self,
        model: torch.nn.Module,
        stop_token_ids: Collection[int],
        pad_token_id: int,
        max_batch_size: int = 64,
        seed: int = 0,
        prefix_cache_tokens: int = 16384,
        sampling_overrides: Mapping[str, Any] | None = None,
        static_cache: bool | None = None,
        autocast_dtype: torch.dtype | None = None,
        chunk_steps: int = 8,
        cuda_graphs: bool = True,
        step_lock: anyio.Lock | None = None,
        step_context: Callable[[], contextlib.AbstractContextManager] | None = None,
    ):
        if not stop_token_ids:
            raise ValueError("stop_token_ids is empty: generation would never end a turn")
        self.model = model
        self.stop_token_ids = frozenset(stop_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        overrides = dict(sampling_overrides or {})
        if features := feature_token_ids(_config(model)):
            overrides["suppress_tokens"] = sorted(
                {*(overrides.get("suppress_tokens") or ()), *features}
            )
        self.settings = generation_settings(overrides, self.stop_token_ids)
        self.sampling_overrides = self.settings.sampling
        self.context_limit: int | None = getattr(model.config, "max_position_embeddings", None)
        self.vocab_size: int = _text_config(model).vocab_size
        self.prefixes = PrefixCache(prefix_cache_tokens)
        self.reuses_keys_and_values = _has_plain_attention_cache(model)
        self.batches_prefills = _layer_types(model) == {"full_attention"}
        self.feature_ids = frozenset(feature_token_ids(_config(model)))
        # 3-D rotary positions (Qwen2-VL's family) depend on the whole prompt's pictures
        plain_positions = getattr(model.config, "vision_start_token_id", None) is None
        self.caches_images = self.batches_prefills and plain_positions
        self.static_cache = static_cache
        self.autocast_dtype = autocast_dtype
        self.chunk_steps = chunk_steps
        self.cuda_graphs = cuda_graphs
        self._seeds = torch.Generator().manual_seed(seed)
        self._arriving: list[Request] = []
        self._batch: DynamicBatch | SlotBatch | None = None
        self._lock = step_lock or anyio.Lock()
        self._step_context = step_context or contextlib.nullcontext
        # The version tagging each drawn token (`Completion.versions`); None: no tags.
        self.weights_version: int | None = None
        # transformers checks the processors' values when they are built: fail now, not mid-round
        self._processors([pad_token_id], SamplingParams(max_tokens=1), self.sampling_overrides)

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

    def release_memory(self) -> None:
        """Free what generating holds: the prefix cache, and a `SlotBatch`'s cache and graphs.

        For a trainer between rounds, so its learner has that memory; the next request
        allocates it again. Only while no request is in flight: running rows are dropped.
        """
        self.prefixes.clear()
        if isinstance(self._batch, SlotBatch):
            self._batch.release()
        elif self._batch is not None:
            self._batch.clear()

    async def between_steps(self, update: Callable[[], None], version: int | None = None) -> None:
        """Run `update` (a weight load, say) while no generation step runs, then empty the cache.

        Steps already queued wait for it; rows that are decoding continue after it with the
        updated model (their cached keys and values were computed before it). With `version`,
        the tokens drawn from then on carry it (`Completion.versions`; see `weights_version`).
        """
        async with self._lock:
            update()
            self.reset_prefix_cache()
            if version is not None:
                self.set_weights_version(version)

    def set_weights_version(self, version: int) -> None:
        """Tag the tokens drawn from now on with `version`, those of running rows included.

        Rows started before the backend had a version keep none (their completions have
        `versions=None`). Call it only between steps (`between_steps` does).
        """
        self.weights_version = version
        for row in self._running().rows:
            if row.version is not None:
                row.version = version

    @property
    def step_lock(self) -> anyio.Lock:
        """The lock each step holds (see the ``step_lock`` argument)."""
        return self._lock

    @property
    def running_rows(self) -> int:
        """How many rows are decoding now."""
        return len(self._running().rows)

    @property
    def decoding(self) -> str:
        """Which batch decodes: "slots" (static cache, sampled on the device) or "dynamic"."""
        return "slots" if isinstance(self._running(), SlotBatch) else "dynamic"

    def _running(self) -> DynamicBatch | SlotBatch:
        """The decoding batch, made on first use for the model's device then."""
        if self._batch is None:
            static = self.static_cache
            if static is None:
                static = self._device().type == "cuda"
            if static and self.batches_prefills and self.reuses_keys_and_values:
                self._batch = SlotBatch(
                    self.model, self.max_batch_size, self.chunk_steps, self.cuda_graphs
                )
            else:
                self._batch = DynamicBatch(self.model)
        return self._batch

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, pictures: Pictures | None = None
    ) -> Completion:
        """Queue a request and return its completion once the steps have generated it.

        The model reads `pictures.vision` (the processor's tensors); a request with pictures
        generates on its own.
        """
        if self.context_limit and len(prompt_ids) + params.max_tokens > self.context_limit:
            raise ValueError(
                f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                f"model's context of {self.context_limit} tokens"
            )
        if not prompt_ids:
            raise ValueError("the prompt is empty: there is nothing to continue")
        params = replace(params, max_tokens=self.settings.turn_budget(params.max_tokens))
        vision, images = (dict(pictures.vision), pictures.images) if pictures else ({}, ())
        request = Request(list(prompt_ids), params, vision, images)
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

    def _admissions(self) -> list[Request]:
        """The arrived requests there is room for, taken off the queue (on the event loop)."""
        room = self.max_batch_size - self.running_rows if self.reuses_keys_and_values else 1
        admitted = [r for r in self._arriving[: max(room, 0)] if not r.abandoned]
        del self._arriving[: max(room, 0)]
        return admitted

    def _step(self, admitted: list[Request]) -> None:
        """Admit `admitted`, then decode every running row (a token, or a chunk of tokens)."""
        batch = self._running()
        try:
            with self._step_context(), torch.inference_mode(), self._autocast():
                alone = [r for r in admitted if r.vision or not self.reuses_keys_and_values]
                for request in alone:
                    self._generate_alone(request)
                if len(alone) == len(admitted) and not batch.rows:
                    return
                prefilled = self._prefill_all([r for r in admitted if r not in alone])
                batch.join([(row, kv) for row, kv in prefilled if not row.finished])
                if batch.rows:
                    for row, kv in batch.decode(self.stop_token_ids):
                        self.prefixes.add(row.fed, kv)
        except Exception as error:  # every request in the step must learn about it
            for request in [*admitted, *(row.request for row in batch.rows)]:
                request.error = error
            batch.clear()

    def _autocast(self) -> contextlib.AbstractContextManager:
        """Mixed precision as the trainer computes it, when `autocast_dtype` is set.

        The cast cache stays off: a CUDA graph must capture the casts, not a cached result.
        """
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device_type = self._device().type
        return torch.autocast(device_type, dtype=self.autocast_dtype, cache_enabled=False)

    def _prefill_all(self, admitted: list[Request]) -> list[tuple[Row, KV]]:
        """Prefill the admitted requests in as few forward passes as their lengths allow.

        A request that shares more of its prompt with an earlier admitted one than the prefix
        cache holds (a group's members arriving together) waits for the next wave, and then
        reads that prompt from the cache. Within a wave, requests of similar lengths read in one
        pass (`similar_lengths`).
        """
        prefilled: list[tuple[Row, KV]] = []
        waiting = admitted
        while waiting:
            wave, waiting = plan_wave(waiting, self.prefixes)
            for plans in similar_lengths(wave, batched=self.batches_prefills):
                prefilled.extend(self._prefill(plans))
        return prefilled

    def _prefill(self, plans: list[PrefillPlan]) -> list[tuple[Row, KV]]:
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
            token_ids.append(left_padded(plan.prompt[n:], reads, self.pad_token_id))
            positions.append(left_padded(list(range(n, len(plan.prompt))), reads, 0))
        mask_B_T = torch.cat([left_padded_ones(len(plan.prompt), width) for plan in plans])
        device = self._device()
        out = self.model(
            input_ids=torch.tensor(token_ids, device=device),
            attention_mask=mask_B_T.to(device),
            position_ids=torch.tensor(positions, device=device),
            past_key_values=cache_of_prefixes(plans, kept),
            use_cache=True,
            logits_to_keep=1,
        )
        rows = [self._new_row(plan.request) for plan in plans]
        self._draw(rows, out.logits[:, -1, :])
        read = kv_cache.taken_layers(out.past_key_values)  # each row's part, a layer at a time
        kvs = kv_cache.split_rows(read, [width - len(plan.prompt) for plan in plans])
        for plan, kv in zip(plans, kvs, strict=True):
            self.prefixes.add(plan.prompt, kv)
        return list(zip(rows, kvs, strict=True))

    def _forward(
        self,
        token_ids: list[int],
        positions: range,
        cache: DynamicCache | None,
        vision: Mapping[str, torch.Tensor],
        rope_delta: torch.Tensor | None = None,
    ):
        """One forward of a lone request's next ids (`_generate_alone`).

        `vision` (prefill only) holds the prompt's image tensors; a model with 3-D rotary
        positions then computes its own, and returns `rope_deltas`, the shift of the text
        positions after the images, which each decoding step passes back as `rope_delta`.
        """
        device = self._device()
        ids_1_T = torch.tensor([token_ids], device=device)
        position_ids: torch.Tensor | None = torch.tensor([list(positions)], device=device)
        if rope_delta is not None:
            position_ids = (position_ids + rope_delta).expand(3, 1, -1)  # type: ignore[operator]
        vision = {key: value.to(device) for key, value in vision.items()}
        extra = vision_forward_kwargs(_config(self.model), ids_1_T, vision)
        position_ids = extra.pop("position_ids", position_ids)
        return self.model(
            input_ids=ids_1_T,
            attention_mask=torch.ones(1, positions.stop, dtype=torch.long, device=device),
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **extra,
        )

    def _generate_alone(self, request: Request) -> None:
        """Generate one request with the model's own cache (models without plain KV, images).

        A request with images starts from the longest cached prefix of its ids and pictures
        (`caches_images`), and leaves what it read in the prefix cache.
        """
        row = self._new_row(request)
        key = self._image_key(request.prompt_ids, request.images)
        reused, cache = self._cached_prefix(key, request.prompt_ids)
        new = request.prompt_ids[reused:]
        vision = request.vision if self.feature_ids.intersection(new) else {}
        out = self._forward(new, range(reused, len(request.prompt_ids)), cache, vision)
        rope_delta = getattr(out, "rope_deltas", None) if request.vision else None
        self._draw([row], out.logits[:, -1, :])
        while not row.finished:
            row.fed.append(row.tokens[-1])
            last = len(row.fed) - 1
            out = self._forward(
                [row.tokens[-1]], range(last, last + 1), out.past_key_values, {}, rope_delta
            )
            self._draw([row], out.logits[:, -1, :])
        if key is not None and (fed_key := self._image_key(row.fed, request.images)):
            self.prefixes.add(fed_key, kv_cache.kv_of(out.past_key_values))

    def _image_key(self, ids: list[int], images: Sequence[Any]) -> tuple | None:
        """The prefix-cache key of a prompt with images (None: it is not cached)."""
        if not images or not self.caches_images:
            return None
        return prefix_key(ids, images, self.feature_ids)

    def _cached_prefix(self, key: tuple | None, ids: list[int]) -> tuple[int, DynamicCache | None]:
        """How many leading `ids` a cached prefix serves, and a cache holding their KV."""
        if key is None:
            return 0, None
        cached, kv = self.prefixes.longest_prefix(key)
        reused = reusable_length(cached, ids, self.feature_ids)
        if kv is None or reused == 0:
            return 0, None
        return reused, kv_cache.cache_of(kv_cache.first_positions(kv, reused))

    def _new_row(self, request: Request) -> Row:
        params = request.params
        sampling = _SAMPLING_DEFAULTS | {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
        }
        sampling |= self.sampling_overrides
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._seeds))
        processors = self._processors(request.prompt_ids, params, sampling)
        fed = list(request.prompt_ids)
        return Row(
            request, sampling, seed, fed, processors=processors, version=self.weights_version
        )

    def _processors(
        self, prompt_ids: list[int], params: SamplingParams, sampling: Mapping[str, Any]
    ) -> Any:
        """The request's transformers logits processors (`row_processors`), or None."""
        return row_processors(
            self.settings,
            _SAMPLING_DEFAULTS | dict(sampling),
            prompt_ids,
            params.max_tokens,
            self.stop_token_ids,
            self.vocab_size,
            self._device(),
        )

    def _draw(self, rows: list[Row], logits_B_V: torch.Tensor) -> None:
        """Sample each row's first token, as the decoding batch samples the others."""
        counter_based = isinstance(self._running(), SlotBatch)
        draw_rows(rows, logits_B_V, self.stop_token_ids, counter_based)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device  # what transformers' `model.device` reads


def _has_plain_attention_cache(model: Any) -> bool:
    """Whether the model's cache is attention keys and values only (no recurrent state)."""
    attention = {"full_attention", "sliding_attention", "chunked_attention"}
    supports = getattr(type(model), "_supports_default_dynamic_cache", lambda: True)
    return _layer_types(model) <= attention and bool(supports())


def _layer_types(model: Any) -> set[str]:
    return set(getattr(_text_config(model), "layer_types", None) or ["full_attention"])


def _config(model: torch.nn.Module) -> PreTrainedConfig:
    """`model.config`: the backend takes transformers models (possibly PEFT-wrapped)."""
    return cast("PreTrainedConfig", model.config)


def _text_config(model: Any) -> Any:
    return model.config.get_text_config(decoder=True)
