"""Planning prefills: which admitted requests read their prompts now, and which read together.

A `PrefillPlan` says how much of a request's prompt the prefix cache serves. `plan_wave` holds
back a request whose prompt an earlier one of the same wave will put in the cache (a group's
members arriving together); `similar_lengths` batches plans that read about as many tokens;
`cache_of_prefixes` and `left_padded` lay a batch out as the decoding batch keeps rows:
left-padded, positions contiguous and right-aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import DynamicCache

from rollout.backends import kv_cache
from rollout.backends.generation_rows import Request
from rollout.backends.kv_cache import KV, PrefixCache


@dataclass
class PrefillPlan:
    """How a request prefills: the first `reused` positions of `cached` serve its prompt."""

    request: Request
    reused: int
    cached: KV | None

    @property
    def prompt(self) -> list[int]:
        """The request's prompt ids."""
        return self.request.prompt_ids

    @property
    def reads(self) -> int:
        """Tokens the request must read."""
        return len(self.prompt) - self.reused


def plan_wave(
    requests: list[Request], prefixes: PrefixCache
) -> tuple[list[PrefillPlan], list[Request]]:
    """Plan the requests that prefill now; return their plans and the requests that wait.

    A request waits when an earlier plan of this wave shares more of its prompt than the prefix
    cache holds: once that plan has read, the cache serves the shared part.
    """
    wave: list[PrefillPlan] = []
    waiting: list[Request] = []
    for request in requests:
        prompt = request.prompt_ids
        reused, cached = prefixes.longest_prefix(prompt)
        shared = max(
            (kv_cache.shared_prefix_length(plan.prompt, prompt) for plan in wave), default=0
        )
        if shared > reused and prefixes.max_tokens > 0:
            waiting.append(request)
        else:  # read at least one token: its logits are needed
            wave.append(PrefillPlan(request, min(reused, len(prompt) - 1), cached))
    return wave, waiting


def cache_of_prefixes(plans: list[PrefillPlan], kept: list[int]) -> DynamicCache:
    """The first `kept[b]` cached positions of each plan's prompt as row b, left-padded."""
    if max(kept) == 0:
        return DynamicCache()
    any_cached = next(plan.cached for plan, n in zip(plans, kept, strict=True) if n > 0)
    rows = [
        kv_cache.first_positions(plan.cached if n > 0 else any_cached, n)  # type: ignore[arg-type]
        for plan, n in zip(plans, kept, strict=True)
    ]
    layers = range(len(rows[0]))
    return kv_cache.cache_of(kv_cache.stacked([row[i] for row in rows], max(kept)) for i in layers)


def similar_lengths(plans: list[PrefillPlan], batched: bool) -> list[list[PrefillPlan]]:
    """The plans in batches that read together, longest first (one each unless `batched`).

    Every row of a batch reads as many tokens as its longest, so a plan joins a batch only
    while it needs at least half of that, or no more than 16 tokens less: one more pass costs
    about as much as reading a few dozen more tokens in a pass (docs/measurements.md).
    """
    batches: list[list[PrefillPlan]] = []
    for plan in sorted(plans, key=lambda plan: plan.reads, reverse=True):
        longest = batches[-1][0].reads if batches else 0
        if batched and batches and (2 * plan.reads >= longest or longest - plan.reads <= 16):
            batches[-1].append(plan)
        else:
            batches.append([plan])
    return batches


def left_padded(values: list[int], width: int, pad: int) -> list[int]:
    """`values` after as many `pad`s as make it `width` long."""
    return [pad] * (width - len(values)) + values
