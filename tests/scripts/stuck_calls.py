"""Run by tests/rollout/test_hangs.py as `python tests/scripts/stuck_calls.py TOKENIZER_DIR`.

Plays one episode whose tools block for ever, call `sys.exit(3)` and raise `KeyboardInterrupt`,
then one whose `reset` raises `KeyboardInterrupt`, prints what the model and the user saw, and
returns. The interpreter must then exit at once: the blocked tool's thread must not hold it.
"""

from __future__ import annotations

import json
import sys
import threading

import anyio
from transformers import AutoTokenizer

from environments import EnvironmentResetError
from rollout import EpisodeConfig, RolloutEngine, ScriptedBackend


class Stubborn:
    def reset(self, **row) -> None:
        return None

    def wait(self) -> str:
        """Wait for an event that never comes."""
        threading.Event().wait()
        return "never"

    def quit(self) -> str:
        """Exit the interpreter."""
        sys.exit(3)

    def interrupt(self) -> str:
        """Interrupt the program."""
        raise KeyboardInterrupt


class InterruptedReset(Stubborn):
    def reset(self, **row) -> None:
        raise KeyboardInterrupt("in reset")


def engine(tokenizer, factory: type) -> RolloutEngine:
    """The engine the model plays through: it calls every tool once, then says it is done."""
    calls = [f'<tool_call>{{"name": "{name}", "arguments": {{}}}}</tool_call>' for name in
             ("wait", "quit", "interrupt")]  # fmt: skip
    eos = tokenizer.eos_token_id

    def respond(context: list[int]) -> list[int]:
        answered = "<tool_response>" in tokenizer.decode(context)
        text = "Done." if answered else "\n".join(calls)
        return tokenizer.encode(text, add_special_tokens=False) + [eos]

    config = EpisodeConfig(max_completion_length=512, max_turns=3, tool_timeout_s=0.5)
    return RolloutEngine(
        ScriptedBackend(respond, [eos]),
        tokenizer,
        environment_factory=factory,
        chat_template="chatml_tools",
        config=config,
    )


def main(tokenizer_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    [episode] = anyio.run(engine(tokenizer, Stubborn).run, [{"prompt": "Go."}])
    print(json.dumps([m["content"] for m in episode.messages if m["role"] == "tool"]))
    try:
        anyio.run(engine(tokenizer, InterruptedReset).run, [{"prompt": "Go."}])
    except EnvironmentResetError as error:
        print(f"reset failed: {error}")
    print("returned", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
