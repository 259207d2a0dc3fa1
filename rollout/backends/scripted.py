"""A scripted generation backend: a small, honest test double that replays token ids.

It is for engine tests and the engine-overhead benchmark; the same engine paths also run against
real models (the transformers backend, vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import anyio

from rollout.types import Completion, Pictures, SamplingParams


class ScriptedBackend:
    """Answers each request with the ids `respond(prompt_ids)` returns.

    The answer is cut to `max_tokens`; `stopped` is True when the (cut) answer ends on one of
    `stop_token_ids`. The logprob of the k-th token of an answer is `-(k + 1) / 100`, so tests can
    check that each logprob stays with its token.

    Args:
        respond: Maps the full context so far to the token ids to "sample" next.
        stop_token_ids: Ids that end a turn.
        delay_s: Simulated generation latency per request.
        context_limit: Reported context limit (None: unlimited).

    """

    def __init__(
        self,
        respond: Callable[[list[int]], list[int]],
        stop_token_ids: Collection[int],
        delay_s: float = 0.0,
        context_limit: int | None = None,
    ):
        if not stop_token_ids:
            raise ValueError("stop_token_ids is empty: generation would never end a turn")
        self.respond = respond
        self.stop_token_ids = frozenset(stop_token_ids)
        self.delay_s = delay_s
        self.context_limit = context_limit
        self.requests: list[tuple[list[int], SamplingParams]] = []

    reads_images = False  # a row with pictures is refused before it plays

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, pictures: Pictures | None = None
    ) -> Completion:
        """Replay the scripted answer for this context (see the class docstring)."""
        self.requests.append((list(prompt_ids), params))
        if self.delay_s:
            await anyio.sleep(self.delay_s)
        ids = list(self.respond(list(prompt_ids)))[: params.max_tokens]
        stopped = bool(ids) and ids[-1] in self.stop_token_ids
        return Completion(ids, [-(k + 1) / 100 for k in range(len(ids))], stopped)
