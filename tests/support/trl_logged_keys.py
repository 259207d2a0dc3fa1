"""One short GRPO run per kind of run, with TRL's GRPOTrainer or agentgrpo's: the keys it logs.

`tests/agentgrpo/trl/test_trl_metrics.py` imports `run_logs` to run agentgrpo in its own process,
and runs this script with `trl` (in a process of its own: importing TRL imports vLLM, which changes
torch's threading for the whole process) to check that its list of TRL's keys is what TRL 1.16
logs. By hand, from the repository root:

    PYTHONPATH=. python3 tests/support/trl_logged_keys.py trl MODEL_DIR OUT_DIR

MODEL_DIR holds a causal LM and its tokenizer (`save_pretrained`); the script prints a line
`LOGGED_KEYS {...}`: each kind of run (`KINDS`) to the sorted keys of its `log_history`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from datasets import Dataset
from transformers import AutoTokenizer

from tests.support.runs import CounterTools, one_step

# Each kind of run: its config fields beyond `settings`' (`environment`: played against the
# Counter below, which scores itself, with one plain tool besides).
KINDS: dict[str, dict[str, Any]] = {
    "dapo": {},
    "grpo_kl_entropy_eval": {
        "loss_type": "grpo",
        "beta": 0.04,
        "entropy_coef": 0.01,
        "eval_strategy": "steps",
        "eval_steps": 1,
        "per_device_eval_batch_size": 4,
    },
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
    "vespo": {"loss_type": "vespo"},
    "environment": {"max_completion_length": 24},
}


class Counter(CounterTools):
    """A counter the model increments; it scores itself by how far it got."""

    def reset(self, **kwargs) -> None:
        self.counter = 0

    def get_reward(self) -> float:
        return float(self.counter)


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def length_reward(completions, **kwargs) -> list[float]:
    return [len(str(completion)) / 100 for completion in completions]


def run_logs(grpo: Any, kind: str, model_dir: str, output_dir: str) -> list[dict[str, Any]]:
    """The `log_history` of a run of `kind`, with `grpo` (the `trl` or `agentgrpo` module)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    fields = one_step(output_dir, **KINDS[kind])
    arguments: dict[str, Any] = {"reward_funcs": length_reward}
    rows = Dataset.from_dict({"prompt": ["2+2=", "3+3="]})
    if kind == "environment":
        arguments = {"environment_factory": Counter, "tools": [add]}
        rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Count to 3."}]] * 2})
        if grpo.__name__ == "trl":  # ChatML with Hermes-style calls, whose calls TRL can parse
            template = Path(grpo.__file__).parent / "chat_templates" / "qwen2_5.jinja"
            tokenizer.chat_template = template.read_text()
        else:
            fields["chat_template"] = "chatml_tools"  # the same format
    trainer = grpo.GRPOTrainer(
        model=model_dir,
        args=grpo.GRPOConfig(**fields),
        processing_class=tokenizer,
        train_dataset=rows,
        eval_dataset=rows if "eval_strategy" in KINDS[kind] else None,
        **arguments,
    )
    trainer.train()
    return trainer.state.log_history


def logged_keys(logs: list[dict[str, Any]]) -> list[str]:
    """The sorted keys of every entry of a `log_history`."""
    return sorted({key for log in logs for key in log})


def main() -> None:
    which, model_dir, output_dir = sys.argv[1:4]
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    if which == "trl":
        import trl as grpo
    else:
        import agentgrpo as grpo
    keys = {
        kind: logged_keys(run_logs(grpo, kind, model_dir, str(Path(output_dir) / kind)))
        for kind in KINDS
    }
    print("LOGGED_KEYS", json.dumps(keys))


if __name__ == "__main__":
    main()
