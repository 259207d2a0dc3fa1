"""Run by tests/rollout/test_hangs.py as `python tests/scripts/stuck_close.py MODEL_DIR`.

The model folder is read for its tokenizer only.

Plays one episode whose environment's `close()` never returns, with no environment timeout, and
prints `closing` when the close starts. A first Ctrl-C must then stop the run: it prints
`interrupted` and the calls left running, and returns, so the interpreter exits.
"""

from __future__ import annotations

import sys
import threading

import anyio
from transformers import AutoTokenizer

from environments import Counter
from rollout import EpisodeConfig, RolloutEngine, ScriptedBackend
from tools.threads import USER_CODE


class StuckClose(Counter):
    def close(self) -> None:
        print("closing", flush=True)
        threading.Event().wait()  # never returns


def main(tokenizer_dir: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos = tokenizer.eos_token_id
    engine = RolloutEngine(
        ScriptedBackend(lambda context: tokenizer.encode("Done.") + [eos], [eos]),
        tokenizer,
        environment_factory=StuckClose,
        chat_template="chatml_tools",
        config=EpisodeConfig(max_completion_length=64, environment_timeout_s=None),
    )
    try:
        anyio.run(engine.run, [{"prompt": "Reach 1.", "target": 1}])
    except KeyboardInterrupt:
        print(f"interrupted; still running: {USER_CODE.stuck}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
