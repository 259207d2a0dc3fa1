"""The generation backend protocol: token ids in, token ids and sampler logprobs out.

Every backend (transformers, vLLM in-process, vLLM server, the scripted test double) implements
this, so the engine never knows which one it drives. `generate` may be called by many episodes at
once; a backend is free to batch concurrent requests.
"""

from __future__ import annotations

from typing import Protocol

from rollout.types import Completion, SamplingParams


class GenerationBackend(Protocol):
    """What the rollout engine needs from a generator.

    Attributes:
        context_limit: The most tokens (prompt and completion together) one sequence may hold,
            or None when the backend sets no limit.

    """

    context_limit: int | None

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Continue `prompt_ids` for at most `params.max_tokens` tokens.

        The returned ids are exactly the sampled ones; generation stops after a stop token (which
        is kept) or after `max_tokens`.
        """
        ...
