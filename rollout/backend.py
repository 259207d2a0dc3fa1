"""The generation backend protocol: token ids in, token ids and sampler logprobs out.

Every backend (transformers, vLLM in-process, vLLM server, the scripted test double) implements
this, so the engine never knows which one it drives. `generate` may be called by many episodes at
once; a backend is free to batch concurrent requests.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rollout.types import Completion, Pictures, SamplingParams


@runtime_checkable
class GenerationBackend(Protocol):
    """What the rollout engine and the trainer need from a generator.

    ``isinstance(backend, GenerationBackend)`` checks only that the members exist.

    Attributes:
        context_limit: The most tokens (prompt and completion together) one sequence may hold,
            or None when the backend sets no limit.
        stop_token_ids: The ids that end a turn; not empty, fixed for the backend's life.
            `generate` stops on the first of them it samples and keeps it as the last id (with
            `stopped=True`). The trainer also reads them to tell whether a completion made
            elsewhere (a TRL-style `rollout_func`) ended on a stop token or was cut off.

    """

    context_limit: int | None
    stop_token_ids: frozenset[int]

    @property
    def reads_images(self) -> bool:
        """Whether `generate` takes `pictures` (a row with pictures is otherwise refused)."""
        ...

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, pictures: Pictures | None = None
    ) -> Completion:
        """Continue `prompt_ids` for at most `params.max_tokens` tokens.

        The returned ids are exactly the sampled ones; generation stops after a stop token (which
        is kept) or after `max_tokens`. `pictures`: those whose tokens `prompt_ids` hold, given
        only to a backend that `reads_images`.
        """
        ...
