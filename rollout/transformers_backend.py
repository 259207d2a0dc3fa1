"""Generation with a transformers model, batching whatever requests are pending.

Episodes call `generate` whenever they need a turn. Requests that arrive while a batch is running
wait; when it ends, the next waiter takes every pending request (up to `max_batch_size`) and runs
them as one left-padded batch in a worker thread, so tools and other episodes keep running on the
event loop meanwhile. Each row stops at its own stop token or its own `max_tokens`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import anyio
import torch

from rollout.sampling import sample_tokens
from rollout.types import Completion, SamplingParams


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    result: Completion | None = None
    error: BaseException | None = None


class TransformersBackend:
    """A `GenerationBackend` over a transformers causal LM (the policy itself, on one device).

    Args:
        model: A causal LM. The backend only reads it (under `torch.inference_mode`), so the
            trainer's updates are seen by the next batch without any weight push.
        stop_token_ids: Token ids that end a turn (e.g. the tokenizer's end-of-turn id).
        pad_token_id: Id used for left padding and for rows that already stopped.
        max_batch_size: The most requests generated together.
        batch_wait_s: How long the next batch waits for more requests before it starts.
        seed: Seeds the requests that carry no seed of their own.

    """

    def __init__(
        self,
        model: torch.nn.Module,
        stop_token_ids: Collection[int],
        pad_token_id: int,
        max_batch_size: int = 64,
        batch_wait_s: float = 0.002,
        seed: int = 0,
    ):
        if not stop_token_ids:
            raise ValueError("stop_token_ids is empty: generation would never end a turn")
        self.model = model
        self.stop_token_ids = frozenset(stop_token_ids)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.context_limit: int | None = getattr(model.config, "max_position_embeddings", None)
        self._seeds = torch.Generator().manual_seed(seed)
        self._pending: list[_Request] = []
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

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Queue a request and return its completion once a batch has generated it."""
        if self.context_limit and len(prompt_ids) + params.max_tokens > self.context_limit:
            raise ValueError(
                f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                f"model's context of {self.context_limit} tokens"
            )
        request = _Request(list(prompt_ids), params)
        self._pending.append(request)
        while request.result is None and request.error is None:
            async with self._lock:
                if request.result is None and request.error is None:
                    await anyio.sleep(self.batch_wait_s)
                    batch = self._pending[: self.max_batch_size]
                    del self._pending[: len(batch)]
                    await anyio.to_thread.run_sync(self._run_batch, batch)
        if request.error is not None:
            raise request.error
        assert request.result is not None  # the loop ends on a result or an error
        return request.result

    def _run_batch(self, batch: list[_Request]) -> None:
        """Generate a batch and store each result (or the error) on its request."""
        try:
            completions = self._sample([r.prompt_ids for r in batch], [r.params for r in batch])
        except Exception as error:  # every request of the batch must learn about it
            for request in batch:
                request.error = error
            return
        for request, completion in zip(batch, completions, strict=True):
            request.result = completion

    @torch.inference_mode()
    def _sample(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
    ) -> list[Completion]:
        device = next(self.model.parameters()).device  # what transformers' `model.device` reads
        ids_B_T, mask_B_T = self._left_pad(prompts, device)
        positions_B_T = (mask_B_T.cumsum(-1) - 1).clamp(min=0)
        temperature_B = torch.tensor([p.temperature for p in params], device=device)
        top_k_B = torch.tensor([p.top_k for p in params], device=device)
        top_p_B = torch.tensor([p.top_p for p in params], device=device)
        generators = [self._row_generator(p.seed, device) for p in params]
        out = self.model(
            input_ids=ids_B_T,
            attention_mask=mask_B_T,
            position_ids=positions_B_T,
            use_cache=True,
            logits_to_keep=1,
        )
        tokens: list[list[int]] = [[] for _ in prompts]
        logprobs: list[list[float]] = [[] for _ in prompts]
        stopped = [False] * len(prompts)
        done = [False] * len(prompts)
        for _ in range(max(p.max_tokens for p in params)):
            next_B, logprob_B = sample_tokens(
                out.logits[:, -1, :].float(), temperature_B, top_k_B, top_p_B, generators
            )
            for b, (token, logprob) in enumerate(
                zip(next_B.tolist(), logprob_B.tolist(), strict=True)
            ):
                if done[b]:
                    continue
                tokens[b].append(token)
                logprobs[b].append(logprob)
                stopped[b] = token in self.stop_token_ids
                done[b] = stopped[b] or len(tokens[b]) >= params[b].max_tokens
            if all(done):
                break
            finished_B = torch.tensor(done, device=device)
            next_B = next_B.masked_fill(finished_B, self.pad_token_id)
            mask_B_T = torch.cat([mask_B_T, torch.ones_like(mask_B_T[:, :1])], dim=-1)
            positions_B_T = positions_B_T[:, -1:] + 1
            out = self.model(
                input_ids=next_B.unsqueeze(-1),
                attention_mask=mask_B_T,
                position_ids=positions_B_T,
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        return [Completion(t, lp, s) for t, lp, s in zip(tokens, logprobs, stopped, strict=True)]

    def _row_generator(self, seed: int | None, device: torch.device) -> torch.Generator:
        """A request's own random stream: its draws do not depend on the rest of the batch."""
        if seed is None:
            seed = int(torch.randint(2**62, (1,), generator=self._seeds))
        return torch.Generator(device=device).manual_seed(seed)

    def _left_pad(
        self, prompts: Sequence[list[int]], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids_B_T = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask_B_T = torch.zeros((len(prompts), width), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            ids_B_T[b, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask_B_T[b, width - len(prompt) :] = 1
        return ids_B_T.to(device), mask_B_T.to(device)
