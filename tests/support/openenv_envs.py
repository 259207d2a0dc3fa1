"""OpenEnv environments written as OpenEnv's users write them, on its real base classes.

openenv-core ships no environments of its own (its echo, grid_world, maze, ... live in
OpenEnv's repository, served from Docker images or HF Spaces), so the tests play these: a walk
on a line (an enum action, a bounded field, step rewards, ``done``), one that shows a picture,
and an MCP environment whose FastMCP server's tools are the tools.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any

import numpy as np
import pytest

pytest.importorskip("openenv.core")  # collected for doctests too: skipped without openenv-core

from openenv.core import Action, Environment, Observation, State
from openenv.core.env_server.mcp_environment import MCPEnvironment
from pydantic import Field

GOAL = 3


class Direction(StrEnum):
    """Which way to walk."""

    LEFT = "left"
    RIGHT = "right"


class WalkAction(Action):
    """A walk: a direction and a number of squares."""

    direction: Direction = Field(description="Which way to walk.")
    squares: int = Field(default=1, ge=1, le=2, description="How far, 1 or 2 squares.")


class WalkObservation(Observation):
    """Where the walker stands."""

    message: str = Field(description="What happened.")


class Walk(Environment[WalkAction, WalkObservation, State]):
    """Walk from square 0 to square `GOAL` (or to ``goal``); each square closer earns 0.25."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, goal: int = GOAL) -> None:
        super().__init__()
        self.goal = goal
        self._state = State(step_count=0)
        self.position = 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, start: int = 0, **kwargs: Any
    ) -> WalkObservation:
        """Stand on square `start`."""
        self._state = State(episode_id=episode_id, step_count=0)
        self.position = start
        return WalkObservation(message=f"You are on square {start}; walk to square {self.goal}.")

    def step(self, action: WalkAction, timeout_s: float | None = None, **kwargs: Any):
        """Walk; reward: 0.25 per square closer to the goal, minus as much per square away."""
        self._state.step_count += 1
        before = abs(self.goal - self.position)
        sign = 1 if action.direction is Direction.RIGHT else -1
        self.position += sign * action.squares
        reward = 0.25 * (before - abs(self.goal - self.position))
        done = self.position == self.goal
        message = f"You are on square {self.position}." + (" You are there!" if done else "")
        return WalkObservation(message=message, reward=reward, done=done)

    @property
    def state(self) -> State:
        """The episode id and step count."""
        return self._state


class LookAction(Action):
    """Look again."""

    closer: bool = Field(description="Whether to look closer.")


class LookObservation(Observation):
    """A caption and a picture."""

    caption: str
    frame: Any = Field(description="A 4x4 RGB picture, a uint8 array.")


class Look(Environment[LookAction, LookObservation, State]):
    """Shows a red 4x4 picture; looking closer ends the episode with reward 1."""

    def reset(self, seed: int | None = None, **kwargs: Any) -> LookObservation:
        """Show the picture."""
        return LookObservation(caption="A square.", frame=_red())

    def step(self, action: LookAction, timeout_s: float | None = None, **kwargs: Any):
        """Show it again; looking closer ends the episode."""
        return LookObservation(
            caption="Closer." if action.closer else "The same.",
            frame=_red(),
            reward=1.0 if action.closer else 0.0,
            done=action.closer,
        )

    @property
    def state(self) -> State:
        """No state to speak of."""
        return State()


class Notes(MCPEnvironment):
    """Keeps notes through MCP tools: ``add_note``, ``count_notes``, ``fail``."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        from fastmcp import FastMCP

        server = FastMCP("notes")
        self.notes: list[str] = []

        @server.tool()
        def add_note(text: str, priority: Direction = Direction.LEFT) -> str:
            """Write a note down.

            Args:
                text: The note.
                priority: Which side of the page.
            """
            self.notes.append(text)
            return f"{len(self.notes)} notes."

        @server.tool()
        def count_notes() -> int:
            """How many notes there are."""
            return len(self.notes)

        @server.tool()
        def fail() -> str:
            """Always fails."""
            raise ValueError("the page is torn")

        super().__init__(server)

    def reset(self, seed: int | None = None, **kwargs: Any) -> Observation:
        """Start with no notes."""
        self.notes.clear()
        return Observation(metadata={"notes": 0})

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any):
        raise ValueError(f"Notes takes MCP actions only, not {type(action).__name__}")

    @property
    def state(self) -> State:
        """The notes' count."""
        return State(notes=len(self.notes))


class NotAnOpenEnvEnvironment:
    """A plain agentgrpo environment, which openenv: refuses."""

    def reset(self) -> None:
        """Nothing to reset."""


def _red() -> np.ndarray:
    frame = np.zeros((4, 4, 3), np.uint8)
    frame[..., 0] = 255
    return frame
