"""A run's fingerprint: what a refactor that changes no behaviour must leave bit-identical.

Runs `agentgrpo run ENV --max-steps N --seed S` (default `env:Counter`, 3 steps, seed 0) in its
own process and prints one JSON object: each logged step's loss, grad norm, reward and learning
rate as the run wrote them (`trainer_state.json`), and the SHA-256 of each file of the final
model. Two checkouts give the same object when they train the same way; compare them with
`diff`:

    python bench/fingerprint.py > before.json    # at the old commit
    python bench/fingerprint.py > after.json     # at the new one
    diff before.json after.json && echo identical

Options: `--env`, `--max-steps`, `--seed`, `--keep DIR` (the run's folder, kept).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

LOGGED = ("loss", "grad_norm", "reward", "learning_rate")


def main() -> None:
    args = _parser().parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        output_dir = Path(args.keep or scratch) / "run"
        command = [sys.executable, "-m", "agentgrpo", "run", args.env]
        command += ["--max-steps", str(args.max_steps), "--seed", str(args.seed)]
        command += ["--output-dir", str(output_dir)]
        finished = subprocess.run(command, capture_output=True, text=True)
        if finished.returncode != 0:
            sys.exit(f"the run failed ({finished.returncode}):\n{finished.stderr[-4000:]}")
        print(json.dumps(fingerprint(output_dir), indent=1, sort_keys=True))


def fingerprint(output_dir: Path) -> dict:
    """The logged steps' numbers and the final model's weight files' hashes of a finished run.

    The model is `OUTPUT_DIR/model` where the run saves it there (`agentgrpo run`), else
    `OUTPUT_DIR` itself.
    """
    states = sorted(output_dir.glob("**/trainer_state.json"), key=lambda p: p.stat().st_mtime)
    if not states:
        sys.exit(f"no trainer_state.json under {output_dir}: did the run save?")
    history = json.loads(states[-1].read_text())["log_history"]
    steps = [{key: entry[key] for key in LOGGED if key in entry} for entry in history]
    model_dir = output_dir / "model" if (output_dir / "model").is_dir() else output_dir
    return {
        "steps": [step for step in steps if step],
        "files": {path.name: _sha256(path) for path in sorted(model_dir.glob("*.safetensors"))},
    }


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="env:Counter", help="the ENV argument of the run")
    parser.add_argument("--max-steps", type=int, default=3, help="GRPO steps")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed")
    parser.add_argument("--keep", help="keep the run's folder here")
    return parser


if __name__ == "__main__":
    main()
