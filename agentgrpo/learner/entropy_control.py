"""Adaptive entropy control (Skywork-OR1): move `entropy_coef` toward a target entropy.

The controller measures the mean token entropy of each optimizer step's whole accumulation
window (every micro-batch, every process: a token-weighted mean, not a mean of micro-batch
means) and, at the step boundary, moves the coefficient one `delta` up when that entropy is at
or below `target` and one `delta` down otherwise, within `[coef_min, coef_max]`. The bonus is
applied only while the last measured entropy is at or below `target`, with the coefficient the
last boundary left, so every micro-batch of a window applies the same bonus; before the first
measurement none is applied. This is TRL 1.16's `use_adaptive_entropy` behaviour.

Pure Python and torch; the trainer feeds it sums and reduces them over processes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def next_entropy_coef(
    coef: float, entropy: float, target: float, delta: float, coef_min: float, coef_max: float
) -> float:
    """The coefficient after one optimizer step that measured `entropy` (nats).

    Examples:
        >>> next_entropy_coef(0.01, entropy=0.1, target=0.2, delta=0.005, coef_min=0.0,
        ...                   coef_max=1.0)  # too little entropy: raise the bonus
        0.015
        >>> next_entropy_coef(0.002, 0.3, 0.2, 0.005, 0.0, 1.0)  # enough: lower it, floor 0
        0.0

    """
    if entropy <= target:
        return min(coef + delta, coef_max)
    return max(coef - delta, coef_min)


@dataclass
class AdaptiveEntropy:
    """The controller's state: the coefficient, the last measurement, the open window.

    Attributes:
        coef: The current coefficient (starts at `entropy_coef`).
        target: `entropy_target`, in nats.
        delta: `entropy_coef_delta`.
        coef_min: `entropy_coef_min`.
        coef_max: `entropy_coef_max`.
        last_entropy: Mean entropy of the last finished window; inf before the first.
        window_sum: Entropy summed over the open window's active tokens (this process).
        window_tokens: Active tokens of the open window (this process).

    """

    coef: float
    target: float
    delta: float
    coef_min: float
    coef_max: float
    last_entropy: float = math.inf
    window_sum: float = 0.0
    window_tokens: float = 0.0

    @classmethod
    def from_config(cls, args: object) -> AdaptiveEntropy | None:
        """The controller of a `GRPOConfig` with `use_adaptive_entropy`, else None."""
        if not getattr(args, "use_adaptive_entropy", False):
            return None
        return cls(
            coef=args.entropy_coef,  # type: ignore[attr-defined]
            target=args.entropy_target,  # type: ignore[attr-defined]
            delta=args.entropy_coef_delta,  # type: ignore[attr-defined]
            coef_min=args.entropy_coef_min,  # type: ignore[attr-defined]
            coef_max=args.entropy_coef_max,  # type: ignore[attr-defined]
        )

    @property
    def applied_coef(self) -> float:
        """The coefficient the loss uses now: `coef` while entropy is at or below target."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def observe(self, entropy_sum: float, tokens: float) -> None:
        """Add one micro-batch (its active tokens' entropy sum and count) to the window."""
        self.window_sum += entropy_sum
        self.window_tokens += tokens

    def end_step(self, entropy_sum: float, tokens: float) -> None:
        """Close the window with its totals over every process, and update the coefficient.

        Args:
            entropy_sum: The window's entropy sum, summed over processes.
            tokens: The window's active tokens, summed over processes.

        """
        self.last_entropy = entropy_sum / max(tokens, 1.0)
        self.coef = next_entropy_coef(
            self.coef, self.last_entropy, self.target, self.delta, self.coef_min, self.coef_max
        )
        self.window_sum = self.window_tokens = 0.0

    def state(self) -> dict[str, float]:
        """What a checkpoint keeps (TRL's `entropy_ctrl_state.json` keys)."""
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load(self, state: dict[str, float]) -> None:
        """Restore what `state` returned."""
        self.coef = float(state["entropy_coef"])
        self.last_entropy = float(state["last_world_entropy"])
