"""What the built-ins answered by one number share: the expected answer, a submission, reward."""

from __future__ import annotations

import math
import threading

from environments.messages import number_text

_TOLERANCE = 1e-6


class NumberAnswer:
    """A task whose episode ends with one number submitted; reward 1.0 when it is right.

    A subclass adds its tools and a ``submit`` tool of its own (its docstring is what the model
    reads) that returns ``self._submit(answer)``. Rows have an ``answer`` column read by `reset`.
    """

    def reset(self, answer: float) -> None:
        """Remember the expected answer; nothing is added to the prompt."""
        self.expected = float(answer)
        self.submitted: float | None = None
        self.done = False
        self._submitting = threading.Lock()  # a turn's calls run concurrently, in threads

    def _submit(self, answer: float) -> str:
        """Record the first finite submission and end the episode.

        Raises:
            ValueError: An answer was already submitted, or this one is not a finite number.

        """
        if isinstance(answer, bool) or not math.isfinite(answer):
            raise ValueError(f"the answer must be a finite number, got {answer!r}")
        with self._submitting:
            if self.submitted is not None:
                raise ValueError("an answer was already submitted; only the first one counts")
            self.submitted = float(answer)
            self.done = True
        return f"Submitted {number_text(answer)}."

    def reward(self) -> float:
        """1.0 if the submitted answer is within 1e-6 of the expected one, else 0.0."""
        if self.submitted is None:
            return 0.0
        return 1.0 if abs(self.submitted - self.expected) <= _TOLERANCE else 0.0
