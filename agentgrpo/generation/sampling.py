"""The sampling settings every generator is given beyond temperature, top-p and top-k."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentgrpo.config import GRPOConfig


def sampling_overrides(args: GRPOConfig) -> dict[str, Any]:
    """Sampling fields beyond temperature, top-p and top-k, for either backend.

    `min_p` and `repetition_penalty` when set, then `generation_kwargs`, which win over
    everything else.
    """
    overrides: dict[str, Any] = {}
    if args.min_p is not None:
        overrides["min_p"] = args.min_p
    if args.repetition_penalty != 1.0:
        overrides["repetition_penalty"] = args.repetition_penalty
    generation_kwargs = args.generation_kwargs or {}
    assert isinstance(generation_kwargs, dict)  # GRPOConfig refuses any other kind
    return overrides | generation_kwargs
